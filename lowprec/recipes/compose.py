"""Which techniques a recipe may combine, and how they are applied to a model.

A recipe's ``technique`` is a tuple of at most one config per technique, kept in the
order they are applied: unit scaling (:class:`~lowprec.unit.UnitConfig`), then float8
(:class:`~lowprec.float8.Float8Config`), then scalify
(:class:`~lowprec.scalify.ScalifyConfig`). Accepted: none, any one, or unit + float8 (a
unit-scaled model whose linears cast their GEMM operands with a float8 scaling recipe).
Refused, with the reason (:func:`check`): scalify with anything else, unit's own
unscaled FP8 casts together with a float8 recipe, unit with float8's FP8 attention
(``Float8Config.attention``: it has no unit rule), scalify with non-FP32 parameters, loss
scaling or autocast.

Unit + float8. A unit-scaled linear is ``y = s_out·(x' W'ᵀ)`` with ``x' = x`` and
``W' = W`` in forward whose backward multiplies ``∂x`` by ``s_x`` and ``∂W`` by ``s_W``
(:func:`lowprec.unit.functional.linear`). Composed, the product ``x' W'ᵀ`` is the layer's
float8 GEMM: the float8 recipe's scaled casts of input, weight and output gradient (with
the layer's delayed/static state), inside unit scaling's fixed factors. Mechanism: the GEMM
is injected — each converted layer's :attr:`~lowprec.float8.Float8Linear.linear_fn` is the
unit linear (:func:`lowprec.unit.functional.linear`), which it calls with its own GEMM as
``matmul`` (as unit-scaling's simulated-format transform swaps a unit op's matmul). The
readout and layers in ``float8_skip`` stay unit-scaled in the model's dtype.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

import lowprec.float8
import lowprec.scalify
import lowprec.unit
import lowprec.unit.moe
from lowprec.float8 import Float8Config, Float8Linear
from lowprec.float8.conv1d import Float8Conv1D
from lowprec.float8.grouped import grouped_config
from lowprec.recipes.layers import LayerRule, block_depths, layer_config
from lowprec.recipes.policy import Policy
from lowprec.scalify import ScalifyConfig
from lowprec.unit import UnitConfig
from lowprec.unit.functional import linear as unit_linear

__all__ = [
    "KINDS",
    "LayerRulesError",
    "TechniqueConfig",
    "apply",
    "check",
    "check_layer_rules",
    "kind_of",
    "normalize",
]

log = logging.getLogger(__name__)

TechniqueConfig = UnitConfig | Float8Config | ScalifyConfig
# Technique name -> config class, in the order prepare() applies them.
KINDS: dict[str, type] = {"unit": UnitConfig, "float8": Float8Config, "scalify": ScalifyConfig}
_ORDER = list(KINDS)


def kind_of(config: object) -> str:
    """``"unit"``, ``"float8"`` or ``"scalify"`` for a technique config; ``TypeError`` else."""
    for name, cls in KINDS.items():
        if isinstance(config, cls):
            return name
    raise TypeError(
        "technique must be one of Float8Config, UnitConfig, ScalifyConfig (or a tuple of "
        f"them), got {type(config).__name__} ({config!r})"
    )


def normalize(technique: object) -> tuple[TechniqueConfig, ...]:
    """``technique`` (``None``, one config, or a sequence of configs) as a tuple in
    application order; a technique given twice raises ``ValueError``."""
    if technique is None:
        items: Sequence[object] = ()
    elif isinstance(technique, (tuple, list)):
        items = technique
    else:
        items = (technique,)
    kinds = [kind_of(c) for c in items]
    twice = sorted({k for k in kinds if kinds.count(k) > 1})
    if twice:
        raise ValueError(f"technique: {twice} given more than once (one config per technique)")
    pairs = sorted(zip(kinds, items, strict=True), key=lambda p: _ORDER.index(p[0]))
    return tuple(c for _, c in pairs)  # type: ignore[misc]


def check(policy: Policy, technique: tuple[TechniqueConfig, ...]) -> None:
    """``ValueError`` with the reason if ``technique`` does not compose with itself or
    with ``policy`` (see the module docstring)."""
    by: dict[str, Any] = {kind_of(c): c for c in technique}
    sc = by.get("scalify")
    if sc is not None:
        others = [k for k in by if k != "scalify"]
        if others:
            raise ValueError(
                f"technique: scalify does not compose with {others}: scalify runs every op "
                "on ScaledTensors with its own scale rules (and its own FP8 matmul casts, "
                "data_format='fp8'); unit scaling's ops and Float8Linear have no scalify rules"
            )
        if policy.param_dtype != "fp32" or policy.loss_scaling != "none":
            raise ValueError(
                "technique: scalify keeps fp32 parameters (the scales carry the range) and "
                f"needs no loss scaling, got param_dtype={policy.param_dtype!r}, "
                f"loss_scaling={policy.loss_scaling!r}"
            )
        if policy.autocast is not None:
            raise ValueError(
                f"technique: scalify picks its data format itself (data_format="
                f"{sc.data_format!r}); autocast={policy.autocast!r} would recast its data"
            )
    unit = by.get("unit")
    if unit is not None and "float8" in by and getattr(unit, "float8", False):
        raise ValueError(
            "technique: UnitConfig(float8=True) rounds matmul operands to FP8 unscaled; with a "
            "Float8Config the linears would be cast twice. Use UnitConfig(float8=False) with "
            "the Float8Config (scaled casts), or UnitConfig(float8=True) alone"
        )
    if unit is not None and getattr(by.get("float8"), "attention", None) is not None:
        raise ValueError(
            "technique: Float8Config.attention replaces the model's attention by FP8 "
            "attention, which has no unit-scaling rule: with a UnitConfig the attention "
            "would lose unit scaling's scales. Use Float8Config(attention=None) with unit"
        )


# ---- application -----------------------------------------------------------------------


def apply(
    model: nn.Module,
    technique: tuple[TechniqueConfig, ...],
    dtype: Any,
    lr: float,
    float8_skip: tuple[str, ...],
    layers: tuple[LayerRule, ...] = (),
    name: str = "",
) -> tuple[nn.Module, list[Any] | None]:
    """Apply ``technique`` to ``model`` through each technique's entry point
    (:func:`lowprec.unit.apply` with :func:`lowprec.unit.recipe_param_groups`,
    :func:`lowprec.scalify.apply`, :func:`lowprec.float8.apply`) and cast it to
    ``dtype`` (BF16 or FP16 without scalify: its floating-point inputs too,
    :class:`CastInputs`), BatchNorm modules excepted (FP32 parameters and running
    statistics, which FP16/BF16 would not accumulate: torch's kernels take FP16/BF16
    inputs with them); return the model (a new module for unit and scalify) and u-μP parameter
    groups (unit) or ``None``. Unit scaling re-initialises the model's weights to unit
    variance (:func:`lowprec.unit.apply`'s default; a pretrained model's weights are not
    kept).

    ``lr`` is the optimizer's base learning rate (u-μP's groups are relative to it); the
    float8 conversion gives each linear its config by ``layers``
    (:func:`~lowprec.recipes.layers.layer_config`: the first matching rule's config, else
    the float8 technique's unless its last name component is in ``float8_skip``, or it is a
    unit-scaled model's readout), checked against the model by :func:`check_layer_rules`
    (``name``: the recipe's, for its messages).
    """
    by: dict[str, Any] = {kind_of(c): c for c in technique}
    groups: list[Any] | None = None
    if "unit" in by:
        # unit scaling re-initialises every weight (unit variance); prepare() documents it
        model = lowprec.unit.apply(model, by["unit"])
        groups = lowprec.unit.recipe_param_groups(model, lr)
    if "scalify" in by:
        model = lowprec.scalify.apply(model, by["scalify"])
    model.to(dtype)
    for m in model.modules():  # running statistics accumulate in place: kept in FP32
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.float()
    if dtype in (torch.bfloat16, torch.float16) and "scalify" not in by:
        # (scalify scales its FP32 inputs into the format itself: a cast first would not)
        model.register_forward_pre_hook(CastInputs(dtype), with_kwargs=True)
    if "float8" in by:
        default = by["float8"]
        depths = block_depths(model)
        # a unit model's readout (whatever its name) stays in the model's dtype, as the
        # float8 skip names do, unless a layer rule names it
        readout = getattr(model, "unit_report", {}).get("readout") if "unit" in by else None

        seen: list[str] = []  # the linear-like layers the conversion asked about
        unit_experts: list[tuple[str, nn.Module, Float8Config]] = []

        def config(m: nn.Module, fqn: str) -> Float8Config | None:
            seen.append(fqn)
            if fqn == readout and not any(r.matches(fqn, depths) for r in layers):
                return None
            c = layer_config(layers, fqn, default, float8_skip, depths)
            form = getattr(type(m), "_unit_form", None) if "unit" in by else None
            if form == "experts" and c is not None:  # keeps its unit forward (its GEMMs:
                unit_experts.append((fqn, m, c))  # _unit_float8)
                return None
            if form == "router":  # unit's router (a readout-like x Wᵀ/H) stays as it is
                return None
            return c

        model = lowprec.float8.apply(model, default, config)
        check_layer_rules(name, layers, seen, depths)
        if "unit" in by:
            _unit_float8(model, unit_experts)
    return model, groups


class LayerRulesError(ValueError):
    """A recipe's layer rules match none of the model's layers (:func:`check_layer_rules`)."""


def _some(names: Sequence[str], k: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:k])
    return shown + (f" and {len(names) - k} more" if len(names) > k else "")


def check_layer_rules(
    name: str,
    rules: tuple[LayerRule, ...],
    fqns: Sequence[str],
    depths: dict[str, int] | None = None,
) -> None:
    """Check a recipe's layer ``rules`` against the fully-qualified names ``fqns`` of the
    model's linear-like layers, as its float8 conversion saw them. A rule is checked unless
    it is a catch-all (a pattern of ``*`` only, such as the ``LayerRule("*", None)`` that
    ends a plan of ``lowprec tune``) or depth-relative (``{last:15%}`` may rightly match no
    block of a shallow model). ``ValueError`` if no checked rule matches any layer (the
    recipe would train as if it had no rules: a plan tuned on another model, whose layer
    names are not this model's); a WARNING naming the checked rules that match no layer
    (a misspelt pattern: that layer silently gets the recipe's default)."""
    checked = [r for r in rules if r.pattern.strip("*") and not r.depth_relative]
    if not checked:
        return
    unmatched = [r.pattern for r in checked if not any(r.matches(f, depths) for f in fqns)]
    if not unmatched:
        return
    what = f"recipe {name!r}" if name else "recipe"
    if len(unmatched) == len(checked):
        layers = (
            f"its linear layers are {_some(list(fqns))}"
            if fqns
            else "it has no linear layer a float8 recipe converts"
        )
        raise LayerRulesError(
            f"{what}: none of its {len(checked)} layer rules matches a layer of this model "
            f"(the rules name {_some(unmatched)}; {layers}); it would train without them. "
            "A plan of lowprec tune names the layers of the model it was tuned on: tune "
            "again for this model"
        )
    log.warning(
        "%s: %d of its %d layer rules match no layer of this model (a misspelt name, or a "
        "model of another shape), so the layers they were meant for get a later rule's or "
        "the recipe's default config: %s",
        what,
        len(unmatched),
        len(checked),
        ", ".join(repr(p) for p in unmatched),
    )


class CastInputs:
    """A forward pre-hook (``with_kwargs``) that casts the plain floating-point tensors
    among a call's arguments (nested in lists, tuples and dicts too) to ``dtype``: a model
    whose parameters a recipe made BF16 or FP16 takes FP32 inputs, as FSDP2's
    ``MixedPrecisionPolicy(cast_forward_inputs=True)`` gives it them. Integer tensors (token
    ids, labels), tensor subclasses (``ScaledTensor``, ``DTensor``) and other values pass
    unchanged. A class, not a closure: the prepared model stays picklable."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def _cast(self, v: Any) -> Any:
        if type(v) is torch.Tensor and v.is_floating_point() and v.dtype != self.dtype:
            return v.to(self.dtype)
        return v

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tree_map(self._cast, args), tree_map(self._cast, kwargs)


# ---- unit + float8 ------------------------------------------------------------------------


def _unit_float8(model: nn.Module, experts: list[tuple[str, nn.Module, Float8Config]]) -> None:
    """Every plain ``Float8Linear`` of ``model`` (and ``Float8Conv1D``: GPT-2's layers)
    computes the unit linear around its GEMM; each unit experts module of ``experts``
    (``(fqn, module, config)``) computes its experts' unit linears around float8 GEMMs of
    its config (one group per expert, :func:`lowprec.float8.grouped_linear`; dynamic
    scaling and nearest rounding where the config asks for what the grouped GEMMs do not
    implement, as :class:`~lowprec.float8.Float8Experts` runs it)."""
    readout = getattr(model, "unit_report", {}).get("readout")
    head = model.get_submodule(readout) if readout else None
    for m in model.modules():
        if isinstance(m, Float8Linear) and type(m) in (Float8Linear, Float8Conv1D):
            # the readout's input gradient is unconstrained (lowprec.unit.mode.UnitMode)
            m.linear_fn = (
                functools.partial(unit_linear, constraint=None) if m is head else unit_linear
            )
    for fqn, mod, cfg in experts:
        run, changes = grouped_config(cfg)
        if changes:
            log.warning(
                "%s: unit experts run %s with dynamic scaling and nearest rounding (the "
                "grouped GEMMs do not implement %s)",
                fqn,
                cfg.name,
                "; ".join(changes),
            )
        lowprec.unit.moe.inject_matmul(mod, _ExpertGemm(run))


class _ExpertGemm:
    """``x Wᵀ`` of one expert's 2-D operands as a float8 grouped GEMM of one group."""

    def __init__(self, config: Float8Config) -> None:
        self.config = config

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([x.shape[0]], dtype=torch.int32, device=x.device)
        return lowprec.float8.grouped_linear(x, w.unsqueeze(0), offs, self.config)

    def __repr__(self) -> str:
        return f"float8 expert GEMM ({self.config.name})"
