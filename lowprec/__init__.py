"""lowprec: train neural networks in FP16, BF16, FP8 and smaller formats with FP32 accuracy."""

from lowprec.formats import Format, from_bits, get_format, quantize, to_bits

__all__ = ["Format", "from_bits", "get_format", "quantize", "to_bits"]
__version__ = "0.1.0"
