"""lowprec: train neural networks in FP16, BF16, FP8 and smaller formats with FP32 accuracy.

The foundation: number formats (:mod:`lowprec.core.formats`), scale selection
(:mod:`lowprec.core.scaling`) and the scaled tensor type (:mod:`lowprec.core.tensor`).
"""

from lowprec.core.formats import Format, from_bits, get_format, quantize, to_bits
from lowprec.core.scaling import (
    DelayedScaler,
    DynamicScaler,
    Granularity,
    StaticScaler,
    compute_scale,
)
from lowprec.core.tensor import ScaledTensor, quantize_scaled
from lowprec.recipes import Recipe, prepare

__all__ = [
    "DelayedScaler",
    "DynamicScaler",
    "Format",
    "Granularity",
    "Recipe",
    "ScaledTensor",
    "StaticScaler",
    "compute_scale",
    "from_bits",
    "get_format",
    "prepare",
    "quantize",
    "quantize_scaled",
    "to_bits",
]
__version__ = "0.1.0"
