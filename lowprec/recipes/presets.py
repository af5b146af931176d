"""The named recipes, registered in the one :class:`~lowprec.core.registry.Registry` of
:mod:`lowprec.recipes.recipe` (which :meth:`~lowprec.recipes.Recipe.from_name` reads).

A preset's keyword arguments are :class:`~lowprec.recipes.Policy` fields plus the
:class:`~lowprec.recipes.Recipe` fields ``technique``, ``float8_skip`` and
``calibration_batches``; :func:`get_recipe` builds it, with keyword overrides.

Example:
    >>> get_recipe("fp16-dynamic-ls", growth_interval=100).policy.growth_interval
    100
    >>> get_recipe("fp8-unit").unit
    UnitConfig(float8=True, float8_readout=False, strict=False, act_mult=1.0, softmax_mult=1.0, output_mult=1.0)
"""  # noqa: E501

from __future__ import annotations

from typing import Any

from lowprec.float8 import Float8Config
from lowprec.recipes.layers import LayerRule
from lowprec.recipes.recipe import build_recipe, get_recipe, recipe_names, register
from lowprec.scalify import ScalifyConfig
from lowprec.unit import UnitConfig

__all__ = ["get_recipe", "recipe_names", "register"]


def _add(name: str, description: str, **kwargs: Any) -> None:
    register(build_recipe(name, description, **kwargs))  # validated now, not at first use


_MIXED = {"param_dtype": "bf16", "master_weights": True}  # BF16 params, FP32 master weights
_F8 = "E4M3 forward, E5M2 gradients; output head in BF16"

_add("fp32", "FP32 everything: the reference")
_add("bf16", "BF16 params and compute, FP32 master weights", **_MIXED)
_add(
    "fp16",
    "FP16 params and compute, FP32 master weights, no loss scaling",
    param_dtype="fp16",
    master_weights=True,
)
_add(
    "fp16-static-ls",
    "FP16 as above with a static loss scale of 2^12",
    param_dtype="fp16",
    master_weights=True,
    loss_scaling="static",
    loss_scale=2.0**12,
)
_add(
    "fp16-dynamic-ls",
    "FP16 as above with dynamic loss scaling (2^16, x0.5 on overflow, x2 per 200 steps)",
    param_dtype="fp16",
    master_weights=True,
    loss_scaling="dynamic",
    growth_interval=200,
)
_add("amp-bf16", "FP32 params, torch.autocast to BF16 for compute", autocast="bf16")
for _name, _what in (
    ("tensorwise", "dynamic per-tensor scales"),
    ("delayed", "delayed per-tensor scales (amax history of 16, max)"),
    ("rowwise", "dynamic per-row scales"),
):
    _add(
        f"fp8-{_name}",
        f"BF16 params (FP32 master weights), float8 linears with {_what}; {_F8}",
        technique=Float8Config.from_name(_name),
        **_MIXED,
    )
_add(
    "mxfp8",
    "BF16 params (FP32 master weights), float8 linears with OCP MX scales (blocks of 32, "
    f"E8M0); {_F8}",
    technique=Float8Config.from_name("mxfp8"),
    **_MIXED,
)
for _dt, _what in (
    ("fp32", "FP32 params and compute"),
    ("fp16", "FP16 params and compute (FP32 master weights), no loss scaling"),
    ("bf16", "BF16 params and compute (FP32 master weights), no loss scaling"),
):
    _add(
        f"{_dt}-unit",
        f"Unit-scaled model (lowprec.unit.unit_scale) with u-muP learning rates; {_what}",
        param_dtype=_dt,
        master_weights=_dt != "fp32",
        technique=UnitConfig(),
    )
_add(
    "fp8-unit",
    "Unit-scaled model with u-muP learning rates; every hidden matmul's inputs rounded "
    "to E4M3 in forward and its gradients to E5M2 in backward, with no per-tensor scales "
    "and no loss scaling; the readout matmul stays in BF16 (BF16 params, FP32 master weights)",
    technique=UnitConfig(float8=True),
    **_MIXED,
)
_add(
    "fp16-scalify",
    "Scaled arithmetic (lowprec.scalify): FP16 data with FP32 scales propagated through "
    "every op of forward and backward; FP32 params; no unit scaling, no loss scaling",
    technique=ScalifyConfig(data_format="fp16"),
)
_add(
    "fp8-scalify",
    "Scaled arithmetic: matmul inputs in FP8 (E4M3 forward, E5M2 backward) with "
    "propagated scales, FP16 data elsewhere; FP32 params; no loss scaling",
    technique=ScalifyConfig(data_format="fp8"),
)
# The float8 configs that had no recipe before composable recipes.
_add(
    "fp8-blockwise",
    "BF16 params (FP32 master weights), float8 linears with dynamic block scales (inputs "
    f"and gradients 1x128, weights 128x128); {_F8}",
    technique=Float8Config.from_name("blockwise"),
    **_MIXED,
)
_add(
    "fp8-static",
    "BF16 params (FP32 master weights), float8 linears with static per-tensor scales for "
    "inputs and gradients, calibrated on the first 4 training batches (running max of "
    f"amax), dynamic weight scales; {_F8}",
    technique=Float8Config.from_name("static"),
    calibration_batches=4,
    **_MIXED,
)
_add(
    "mxfp4",
    "BF16 params (FP32 master weights), linears with MXFP4 operands (E2M1, blocks of 32, "
    "E8M0 scales) for inputs, weights and gradients; output head in BF16",
    technique=Float8Config.from_name("mxfp4"),
    **_MIXED,
)
_add(
    "nvfp4",
    "BF16 params (FP32 master weights), linears with NVFP4 operands (E2M1, blocks of 16, "
    "E4M3 scales) for inputs, weights and gradients; output head in BF16",
    technique=Float8Config.from_name("nvfp4"),
    **_MIXED,
)
_add(
    "fp8-unit-rowwise",
    "Unit-scaled model with u-muP learning rates whose hidden linears cast their operands "
    "with float8 rowwise scales (E4M3 forward, E5M2 gradients); readout in BF16 (BF16 "
    "params, FP32 master weights)",
    technique=(UnitConfig(), Float8Config.from_name("rowwise")),
    **_MIXED,
)
# The failures the techniques cure, for the demo.
_add(
    "fp8-naive",
    "BF16 params (FP32 master weights), float8 linears with NO scaling (scale 1: values "
    f"rounded to the formats as they are); {_F8}. The failure float8 scaling cures",
    technique=Float8Config.from_name("naive"),
    **_MIXED,
)
_add(
    "fp16-pure",
    "FP16 params, compute, optimizer state and update: no FP32 master weights, no loss "
    "scaling. The failure master weights cure",
    param_dtype="fp16",
)
# Lean training state (docs/mixed-precision.md, "Lean training state").
_add(
    "bf16-sr",
    "BF16 params and compute, no master weights: the update computed in FP32 and rounded "
    "stochastically into BF16 (seeded, resumable); FP32 AdamW states",
    param_dtype="bf16",
    master="none",
    stochastic_rounding=True,
)
_add(
    "bf16-remainder",
    "BF16 params and compute plus a 16-bit remainder per parameter: together the exact "
    "FP32 master (no FP32 copy); FP32 AdamW states",
    param_dtype="bf16",
    master="remainder",
)
_add(
    "bf16-8bit",
    "BF16 params (FP32 master weights) with 8-bit optimizer states (E4M3 blocks of 256 "
    "with FP32 scales; the second moment as its square root)",
    optimizer_state="8bit",
    **_MIXED,
)
_add(
    "fp8-lean",
    "Float8 tensorwise linears, BF16 params without master weights (stochastically "
    f"rounded update), 8-bit AdamW states; {_F8}",
    technique=Float8Config.from_name("tensorwise"),
    param_dtype="bf16",
    master="none",
    stochastic_rounding=True,
    optimizer_state="8bit",
)
# FP4 training as published (issue 31; docs/float8.md, "FP4 training"). The linears that stay
# in BF16: the output head (float8_skip) and every linear of the last 15% of the blocks
# (FP4_BF16_BLOCKS, a depth-relative rule: lowprec.recipes.layers; the published recipe keeps
# about 15% of the linears in BF16, mostly the last blocks). Replace ``layers`` to change it,
# e.g. layers=(LayerRule("*.{first:1}.*", None), LayerRule("*.{last:2}.*", None)).
FP4_BF16_BLOCKS = LayerRule("*.{last:15%}.*", None)
for _name, _what in (
    (
        "nvfp4-train",
        "NVFP4 (E2M1, E4M3 scales per 16, FP32 tensor scale) with 16x16 weight scales, "
        "stochastic rounding of gradients and a random Hadamard transform (16) on the "
        "weight-gradient GEMM",
    ),
    (
        "mxfp4-train",
        "MXFP4 (E2M1, E8M0 scales per 32) with 32x32 weight scales, stochastic rounding of "
        "gradients and a random Hadamard transform (32) on the weight-gradient GEMM",
    ),
    (
        "fp8-deepseek",
        "DeepSeek-V3 float8: E4M3 everywhere, 1x128 activation/gradient and 128x128 weight "
        "blocks, power-of-two scales, FP32 accumulation",
    ),
):
    fp4 = _name != "fp8-deepseek"
    _add(
        _name,
        f"BF16 params (FP32 master weights), linears in {_what}; output head "
        + ("and the last 15% of the blocks in BF16" if fp4 else "in BF16"),
        technique=Float8Config.from_name(_name),
        layers=(FP4_BF16_BLOCKS,) if fp4 else (),
        **_MIXED,
    )
