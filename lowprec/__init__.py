"""lowprec: train neural networks in FP16, BF16, FP8 and smaller formats with FP32 accuracy.

Where a user starts: a :class:`Recipe` (``get_recipe(name)`` or built) applied to a model
by :func:`prepare`; or one technique on its own through its package's ``apply`` —
:mod:`lowprec.amp` (loss scaling, master weights), :mod:`lowprec.unit` (unit scaling and
u-μP), :mod:`lowprec.float8` (float8 GEMMs), :mod:`lowprec.scalify` (scaled arithmetic);
:mod:`lowprec.distributed` for FSDP2/DDP/tensor parallelism, :mod:`lowprec.analysis` for
statistics, and :class:`RunRecorder` to record your own training loop for ``lowprec
report``; :func:`tune` (the autopilot, :mod:`lowprec.autopilot`) chooses a format per
GEMM of each layer and returns a :class:`Plan` whose ``recipe`` trains. The foundation
lives in :mod:`lowprec.core`: number formats, rounding, granularity, scales, scalers and
the scaled tensor type (its main names are re-exported).
"""

from lowprec._startup import guard_startup

guard_startup()  # a Ctrl-C while the lowprec command imports torch: one line, no traceback

# The technique packages, and distributed (which also makes Float8Linear run on DTensor
# weights under tensor parallelism: lowprec.distributed.float8_dtensor registers it).
from lowprec import amp, analysis, distributed, float8, recipes, scalify, unit
from lowprec.autopilot import Plan, tune
from lowprec.core import tensor_ops as _tensor_ops  # noqa: F401  (registers the layout rules)
from lowprec.core.codes import from_bits, to_bits
from lowprec.core.formats import Format, get_format
from lowprec.core.granularity import Granularity
from lowprec.core.rounding import quantize, to_format
from lowprec.core.scalers import DelayedScaler, DynamicScaler, StaticScaler
from lowprec.core.scales import compute_scale
from lowprec.core.tensor import ScaledTensor, quantize_scaled
from lowprec.jobs.recorder import RunRecorder
from lowprec.recipes import Recipe, get_recipe, prepare

__all__ = [
    "DelayedScaler",
    "DynamicScaler",
    "Format",
    "Granularity",
    "Plan",
    "Recipe",
    "RunRecorder",
    "ScaledTensor",
    "StaticScaler",
    "amp",
    "analysis",
    "compute_scale",
    "distributed",
    "float8",
    "from_bits",
    "get_format",
    "get_recipe",
    "prepare",
    "quantize",
    "quantize_scaled",
    "recipes",
    "scalify",
    "to_bits",
    "to_format",
    "tune",
    "unit",
]
__version__ = "0.1.0"
