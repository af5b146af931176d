"""lowprec: train neural networks in FP16, BF16, FP8 and smaller formats with FP32 accuracy.

The foundation lives in :mod:`lowprec.core`: number formats, rounding, granularity,
scales, scalers and the scaled tensor type.
"""

from lowprec._startup import guard_startup

guard_startup()  # a Ctrl-C while the lowprec command imports torch: one line, no traceback

from lowprec.core import tensor_ops as _tensor_ops  # noqa: F401  (registers the layout rules)
from lowprec.core.codes import from_bits, to_bits
from lowprec.core.formats import Format, get_format
from lowprec.core.granularity import Granularity
from lowprec.core.rounding import quantize
from lowprec.core.scalers import DelayedScaler, DynamicScaler, StaticScaler
from lowprec.core.scales import compute_scale
from lowprec.core.tensor import ScaledTensor, quantize_scaled
from lowprec.jobs.recorder import RunRecorder
from lowprec.recipes import Recipe, prepare

__all__ = [
    "DelayedScaler",
    "DynamicScaler",
    "Format",
    "Granularity",
    "Recipe",
    "RunRecorder",
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
