"""Float8 training: ``Float8Linear``, scaling recipes, hardware FP8 GEMMs and exact emulation.

Quick start::

    import lowprec.float8
    model = lowprec.float8.apply(model, "delayed")   # every nn.Linear -> Float8Linear

``apply(model, config)`` is the technique's one entry point (``config``: a
:class:`Float8Config` or a preset name); :func:`convert_to_float8` is its documented alias
(and ``Float8Recipe`` of :class:`Float8Config`).

Recipes (:func:`recipe_names`): ``tensorwise``, ``delayed``, ``static``, ``rowwise``,
``blockwise``, ``mxfp8``, ``mxfp4``, ``nvfp4``; or build a :class:`Float8Config` from one
:class:`CastConfig` per role. ``Float8Config(attention="rowwise")`` also runs attention's
GEMMs in FP8 (:func:`fp8_attention`).
"""

from lowprec.float8 import presets as _presets  # noqa: F401  (registers the presets)
from lowprec.float8.attention import FP8Attention, fp8_attention
from lowprec.float8.calibration import calibrate
from lowprec.float8.config import PRESETS, CastConfig, Float8Config, Float8Recipe, recipe_names
from lowprec.float8.convert import apply, convert_back, convert_to_float8
from lowprec.float8.experts import Float8Experts
from lowprec.float8.grouped import grouped_linear
from lowprec.float8.linear import Float8Linear
from lowprec.float8.mm import hardware_fp8_available, scaled_mm
from lowprec.float8.quant import dequantize, quantize_operand

__all__ = [
    "PRESETS",
    "CastConfig",
    "FP8Attention",
    "Float8Config",
    "Float8Experts",
    "Float8Linear",
    "Float8Recipe",
    "apply",
    "calibrate",
    "convert_back",
    "convert_to_float8",
    "dequantize",
    "fp8_attention",
    "grouped_linear",
    "hardware_fp8_available",
    "quantize_operand",
    "recipe_names",
    "scaled_mm",
]
