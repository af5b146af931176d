"""Float8 training: ``Float8Linear``, scaling recipes, hardware FP8 GEMMs and exact emulation.

Quick start::

    from lowprec.float8 import convert_to_float8
    model = convert_to_float8(model, "delayed")   # every nn.Linear -> Float8Linear

Recipes (:func:`recipe_names`): ``tensorwise``, ``delayed``, ``static``, ``rowwise``,
``blockwise``, ``mxfp8``, ``mxfp4``, ``nvfp4``; or build a :class:`Float8Recipe` from one
:class:`CastConfig` per role.
"""

from lowprec.float8.linear import Float8Linear, calibrate, convert_back, convert_to_float8
from lowprec.float8.quant import (
    Operand,
    dequantize,
    hardware_fp8_available,
    quantize_operand,
    scaled_mm,
)
from lowprec.float8.recipe import CastConfig, Float8Recipe, recipe_names

__all__ = [
    "CastConfig",
    "Float8Linear",
    "Float8Recipe",
    "Operand",
    "calibrate",
    "convert_back",
    "convert_to_float8",
    "dequantize",
    "hardware_fp8_available",
    "quantize_operand",
    "recipe_names",
    "scaled_mm",
]
