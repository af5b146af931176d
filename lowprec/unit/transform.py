"""``unit_scale(model)``, the transform under :func:`lowprec.unit.apply`: turn a standard
PyTorch model (one of yours, or an HF transformers model, decoder or encoder, pre-norm or
post-norm) into its unit-scaled equivalent.

Four mechanisms, each doing what it is good at:

1. **Modules** (:mod:`lowprec.unit.convert`): norm-like and linear-like leaf modules that
   are not torch's (HF's ``LlamaRMSNorm``, GPT-2's ``Conv1D`` with its ``(in, out)``
   weight) are recognised by a probe of what they compute and made to call the ``F`` op
   (``F.rms_norm``, ``F.linear(x, Wᵀ, b)``); weights are then re-initialised to unit
   variance (``N(0, 1)``, biases 0, gains 1, an embedding's padding row 0; a tied output
   embedding keeps its input embedding's init).
2. **Residual adds**, module by module: with ``torch.fx`` where a module traces
   (:mod:`lowprec.unit.residual_fx`), else by running the model once on example inputs
   (``example_inputs``, or an HF model's own ``dummy_inputs``) and following the data
   (:mod:`lowprec.unit.residual_run`: pre-norm residuals, parallel branches). Each
   residual add gets its ``τ`` (``residual_split`` + ``residual_add``); a sum of embedding
   lookups (token + position) becomes a unit ``add``, either way.
3. **Ops** are converted at run time by a ``TorchFunctionMode`` (:mod:`lowprec.unit.mode`)
   entered in the model's ``forward`` (the root's class is swapped for a subclass doing
   that, so the signature, outputs and ``state_dict`` keys are unchanged): ``F.linear``,
   ``matmul``/``@``/``bmm``/``mm``, ``F.embedding`` (``padding_idx`` kept),
   ``F.layer_norm``, ``F.rms_norm``, ``gelu``, ``relu``, ``silu``, ``softmax``,
   ``log_softmax``, ``F.cross_entropy`` (true forward value; ``ignore_index`` kept),
   ``F.scaled_dot_product_attention`` (causal, boolean mask, dropout, grouped-query),
   ``F.dropout``, ``F.conv1d`` become the :mod:`lowprec.unit.functional` ops.
4. **The readout** (by default the last ``nn.Linear``) gets μP's extra forward
   ``1/√fan_in`` (a forward hook).

**Weights: re-initialised by default** (``reinit=True``). A unit-scaled layer computes
``x Wᵀ/√fan_in`` (and every op its own fixed factors), so a model's trained weights do not
compute its function any more; no consistent rescaling exists in general (the residual
``τ`` and the activations' factors change the mix). The default therefore re-initialises
every weight to unit variance, what a unit-scaled model trains from; ``reinit=False``
keeps the weights as they are, for loading a unit-scaled model's ``state_dict`` next.

**Residual adds of modules fx cannot trace** (a ``raise`` on a sequence length, a mask
sliced by it: CharGPT's and most hand-written models' forwards; HF layers) are found by
running the model once on example inputs: ``example_inputs``, else the model's
``dummy_inputs`` where its ``forward`` names every key (HF models, CharGPT), else the
model's first call, on its own inputs (``unit_report["analysed_by_running"]`` is
``"pending"`` until then; under ``torch.compile`` that call runs eagerly at a graph break,
which ``fullgraph=True`` refuses: call the model once, or pass ``example_inputs``, first).

**What is not handled is named**, with the module and the precise cause, in
``unit_report["unsupported"]`` and in ONE WARNING at transform time (or at the deferred
analysis, for what it finds): modules of types with no rule (Conv2d, BatchNorm, ...), leaf
modules whose forward matches no rule, and (from the example run) each call the unit ops
do not handle, e.g. ``model.layers.0.self_attn: F.scaled_dot_product_attention
called with arguments its unit rule does not handle: attn_mask: a float (additive) mask
...``. Such a call runs unchanged; one first seen later warns once then. ``strict=True``
raises ``NotImplementedError`` instead.

``float8=True``: every matmul (``F.linear``, ``matmul``) but the readout's rounds its operands
to E4M3 and the gradient flowing into its output to E5M2, saturating, with no scales (the
paper's setting). The readout stays in the model's dtype unless ``UnitConfig.float8_readout``
(its cost: ``docs/unit-scaling.md``).

This module holds :func:`unit_scale`, its checks and the readout; the fx-traced modules'
rewrite lives in :mod:`lowprec.unit.graphs`, the unit model's class, the analysis by
running and the end of the transform (τ, ``unit_report``, the warning) in
:mod:`lowprec.unit.wrapper`.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

from torch import Tensor, nn

from lowprec.core.warn import warn_once
from lowprec.unit import functional as U
from lowprec.unit.config import UnitConfig
from lowprec.unit.convert import convert_modules
from lowprec.unit.convert import reinit as _reinit
from lowprec.unit.core import scale_fwd
from lowprec.unit.graphs import _apply_fx
from lowprec.unit.moe import convert_moe, route_aux_losses
from lowprec.unit.residual_fx import find_residual_modules
from lowprec.unit.wrapper import _example, _finish, _Plan, _unit_forward_class

__all__ = ["UnitConfig", "unit_scale"]

log = logging.getLogger("lowprec.unit")

_SCHEMES = ("fixed", "running-mean", "weighted")  # lowprec.unit.functional.residual_taus
_NO_RULE_TYPES = (nn.Conv2d, nn.Conv3d, nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
                  nn.MultiheadAttention, nn.RNNBase)  # fmt: skip


class _TracedCrossEntropyLoss(nn.CrossEntropyLoss):
    """``nn.CrossEntropyLoss`` under another class object, and nothing else.

    Dynamo (torch 2.13) replaces a ``torch.nn.CrossEntropyLoss(...)`` built inside a
    compiled forward (HF's BERT, RoBERTa, T5 heads: ``loss_fct = CrossEntropyLoss()``) by a
    direct ``F.cross_entropy`` graph node that no torch function mode sees, so under
    ``torch.compile`` the unit mode could not give that loss its unit gradient (every
    gradient of the model off by one constant factor). A subclass is traced as an ordinary
    module, whose ``F.cross_entropy`` call reaches the mode."""


def _route_loss_modules(model: nn.Module) -> None:
    """Where a forward of ``model``'s modules (decorators unwrapped) names
    ``torch.nn.CrossEntropyLoss`` through its module's globals, bind that name to
    :class:`_TracedCrossEntropyLoss` (same behaviour, also for other models of that module;
    ``isinstance`` checks hold)."""
    seen: set[int] = set()
    for m in model.modules():
        fn = inspect.unwrap(type(m).forward)
        code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is None or not isinstance(scope, dict) or id(code) in seen:
            continue
        seen.add(id(code))
        for name in code.co_names:
            if scope.get(name) is nn.CrossEntropyLoss:
                scope[name] = _TracedCrossEntropyLoss
                log.debug("unit_scale: %s.%s now names a CrossEntropyLoss subclass that "
                          "torch.compile traces through", scope.get("__name__"), name)  # fmt: skip


def _config(config: UnitConfig | None, float8: bool | None, strict: bool | None) -> UnitConfig:
    """The transform's :class:`UnitConfig`: ``config``, or one from the keywords; both is
    refused (a config never silently overrides a keyword)."""
    for name, v in (("float8", float8), ("strict", strict)):
        if v is not None and not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__} {v!r}")
    if config is None:
        return UnitConfig(float8=bool(float8), strict=bool(strict))
    if not isinstance(config, UnitConfig):
        raise TypeError(f"config must be a UnitConfig or None, got {type(config).__name__}")
    given = [name for name, v in (("float8", float8), ("strict", strict)) if v is not None]
    if given:
        raise ValueError(
            f"{', '.join(given)}: set in the UnitConfig passed as config, not as keywords "
            f"too (e.g. config=UnitConfig(float8=True, strict=True))"
        )
    return config


def unit_scale(
    model: nn.Module,
    *,
    reinit: bool = True,
    float8: bool | None = None,
    residual: str | Sequence[float] | Callable[[int], list[float]] = "running-mean",
    tau: float = 0.5,
    readout: str | None = "auto",
    config: UnitConfig | None = None,
    strict: bool | None = None,
    example_inputs: Any = None,
) -> nn.Module:
    """Return a unit-scaled copy of ``model`` (``model`` itself is not changed): the
    transform behind :func:`lowprec.unit.apply`, the technique's entry point, with the
    residual τ scheme selectable.

    Called exactly like ``model``, with the same outputs (a loss from ``F.cross_entropy``
    keeps its true value; only gradients are scaled); every positional and keyword input
    reaches the model's own ``forward``.

    ``reinit``: ``True`` (default) re-initialises every weight to unit variance, which a
    unit-scaled model trains from; ``False`` keeps the weights as they are, for loading a
    unit-scaled model's ``state_dict`` into the result next (a model's own, e.g. pretrained,
    weights do not compute its function once unit-scaled: see the module doc).
    ``residual``: the τ scheme of :func:`lowprec.unit.functional.residual_taus`
    (``"running-mean"``, ``"fixed"`` with ``tau``), one ``τ`` per residual add found, or a
    function of their number ``n`` giving the list (e.g. :func:`lowprec.unit.umup.umup_taus`);
    a list's τ must lie in ``(0, 1)`` and ``tau`` goes only with ``"fixed"`` (``ValueError``
    here, not at the first call). The τ go to the adds in the order the model runs them
    where a run analyses it (fx's adds placed among the run's by the modules called before
    them), else in the order fx finds them (modules, then each graph's adds).
    ``output_mult`` and ``float8_readout`` need a readout.
    ``readout``: the output layer's module name (``"auto"``: the last ``nn.Linear``,
    unless it sits in a block of a module list, as in a headless backbone: then none, with
    a WARNING; ``None``: none). It computes
    :func:`lowprec.unit.functional.linear_readout` with ``mult=output_mult``.
    ``config``: a :class:`UnitConfig`; or ``float8``/``strict`` as
    keywords (default ``False``) — not both (``ValueError`` naming the keywords).
    ``example_inputs`` (a tuple of positional arguments, a dict of keyword arguments or one
    tensor; default: the model's ``dummy_inputs`` if its ``forward`` names every key, as HF
    models and :class:`~lowprec.jobs.model.CharGPT` carry them): run once, without
    gradients, to find the residual adds of modules fx cannot trace. With none, that
    analysis runs on the model's first call, on its inputs (``unit_report`` is complete
    from then on; until then ``unit_report["analysed_by_running"] == "pending"``). The
    result's ``unit_report`` dict says what was converted and what was left unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(reinit, bool):
        raise TypeError(f"reinit must be a bool, got {type(reinit).__name__} {reinit!r}")
    if hasattr(model, "_unit_config"):
        raise ValueError("model: already unit-scaled")
    if isinstance(residual, str) and residual not in _SCHEMES:
        raise ValueError(
            f"residual must be one of {list(_SCHEMES)}, a sequence of taus or a function of "
            f"their number, got {residual!r}"
        )
    if not (isinstance(residual, (str, Sequence)) or callable(residual)):
        raise TypeError(
            f"residual must be a scheme name, a sequence of taus or a function, got "
            f"{type(residual).__name__}"
        )
    if isinstance(residual, Sequence) and not isinstance(residual, str):
        for t in residual:  # checked here, not at the first forward
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t < 1.0:
                raise ValueError(f"residual: every tau must be a number in (0, 1), got {t!r}")
    if residual != "fixed" and tau != 0.5:
        raise ValueError(f"tau={tau!r} applies only to residual='fixed' (got {residual!r})")
    cfg = _config(config, float8, strict)
    if readout is None and (cfg.output_mult != 1.0 or cfg.float8_readout):
        raise ValueError(
            "readout=None: output_mult and float8_readout act on the readout layer; name it "
            "(readout='auto' or its module name) or leave them at their defaults"
        )
    ex = _example(model, example_inputs)
    model = copy.deepcopy(model)
    bad = sorted({f"{type(m).__name__}: no unit-scaling rule for this module type"
                  for m in model.modules() if isinstance(m, _NO_RULE_TYPES)})  # fmt: skip
    if bad and cfg.strict:
        raise NotImplementedError(f"unit_scale: no unit-scaling rule for modules {bad}")
    moe = convert_moe(model, cfg)
    converted, left = convert_modules(model)
    converted = moe + converted
    if reinit:
        named = {entry.split(" (")[0] for entry in left}
        left += [f"{entry} keep their init: no unit-variance init rule for them"
                 for entry in _reinit(model) if entry.split(" (")[0] not in named]  # fmt: skip
    if left and cfg.strict:
        raise NotImplementedError(f"unit_scale: {left[0]}")
    found, untraced = find_residual_modules(model)
    model, fx_adds, fx_sums = _apply_fx(model, found)
    head = _find_readout(model, readout)
    if head is not None:
        head_module = model.get_submodule(head)
        fan_in = cast(nn.Linear, head_module).in_features
        head_module.register_forward_hook(_ReadoutScale(cfg.output_mult / math.sqrt(fan_in)))
        if cfg.float8 and not cfg.float8_readout:
            head_module.forward = types.MethodType(_readout_forward, head_module)  # type: ignore[method-assign]
    _route_loss_modules(model)
    if moe:
        route_aux_losses(model)
    model.__class__ = _unit_forward_class(type(model))
    object.__setattr__(model, "_unit_config", cfg)
    object.__setattr__(model, "unit_report", {
        "residual_adds": [],
        "unit_adds": [],
        "readout": head,
        "converted_modules": converted,
        "untraced_modules": [f"{n_} ({c})" for n_, c in untraced],
        "analysed_by_running": False,
        "unsupported": [],
        "reinit": reinit,
    })  # fmt: skip
    plan = _Plan(residual, tau, fx_adds, fx_sums, untraced, bad + left)
    _finish(model, plan, ex)
    return model


class _ReadoutScale:
    """Forward hook: μP's readout multiplier ``output_mult/√fan_in`` on ``x Wᵀ`` (forward
    only), the bias left as it is, as :func:`lowprec.unit.functional.linear_readout`
    computes it: ``f·(y - b) + b``. (It scaled the whole output, the bias included.) The
    ``b`` subtracted and added back is the parameter itself, so its gradient is the unit
    linear's; ``y - b`` rounds once in the output's dtype."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        bias = getattr(module, "bias", None)
        if bias is None:
            return scale_fwd(out, self.factor)
        b = bias.to(out.dtype)
        return cast(Tensor, scale_fwd(out - b, self.factor) + b)


def _readout_forward(self: nn.Linear, x: Tensor) -> Tensor:
    """The readout's forward under ``float8``: the readout's unit linear (input gradient
    unconstrained, :class:`~lowprec.unit.mode.UnitMode`'s ``readout``) without FP8
    rounding."""
    return U.linear(x, self.weight, self.bias, constraint=None)


def _find_readout(model: nn.Module, readout: str | None) -> str | None:
    if readout is None:
        return None
    if readout == "auto":
        names: list[str] = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not names:
            return None
        if any(part.isdigit() for part in names[-1].split(".")[:-1]):  # in a block of a list
            warn_once(
                log, f"unit:readout:{type(model).__name__}",
                "unit_scale: readout='auto' found no output head (the last nn.Linear, %r, is "
                "inside a repeated block): the model is taken as a backbone without a readout "
                "(no μP output multiplier, hidden learning rates for every weight); pass "
                "readout=<module name> to name one", names[-1],
            )  # fmt: skip
            return None
        return names[-1]
    try:
        m = model.get_submodule(readout)
    except AttributeError:
        m = None
    if not isinstance(m, nn.Linear):
        raise ValueError(f"readout: {readout!r} is not an nn.Linear submodule of the model")
    return readout
