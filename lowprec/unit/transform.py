"""``unit_scale(model, reinit=True)``: turn a standard PyTorch model (one of yours, or an HF
transformers model, decoder or encoder, pre-norm or post-norm) into its unit-scaled
equivalent.

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
   (:mod:`lowprec.unit.residual_run`: pre-norm residuals, parallel branches, embedding
   sums). Each residual add gets its ``τ`` (``residual_split`` + ``residual_add``).
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

**Pretrained weights are never discarded silently.** A unit-scaled layer computes
``x Wᵀ/√fan_in`` (and every op its own fixed factors), so a model's trained weights do not
compute its function any more; no consistent rescaling exists in general (the residual
``τ`` and the activations' factors change the mix). ``unit_scale`` therefore always
re-initialises, and refuses (``ValueError``) unless called with ``reinit=True``.

**What is not handled is named**, with the module and the precise cause, in
``unit_report["unsupported"]`` and in ONE WARNING at transform time: modules of types with
no rule (Conv2d, BatchNorm, ...), leaf modules whose forward matches no rule, modules fx
cannot trace when no example inputs were given, and (from the example run) each call the
unit ops do not handle, e.g. ``model.layers.0.self_attn: F.scaled_dot_product_attention
called with arguments its unit rule does not handle: attn_mask: a float (additive) mask
...``. Such a call runs unchanged; one first seen later warns once then. ``strict=True``
raises ``NotImplementedError`` instead.

``float8=True``: every matmul (``F.linear``, ``matmul``) but the readout's rounds its operands
to E4M3 and the gradient flowing into its output to E5M2, saturating, with no scales (the
paper's setting). The readout stays in the model's dtype unless ``UnitConfig.float8_readout``
(its cost: ``docs/unit-scaling.md``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, fx, nn

from lowprec.core.warn import warn_once
from lowprec.unit import functional as U
from lowprec.unit.config import UnitConfig
from lowprec.unit.convert import convert_modules
from lowprec.unit.convert import reinit as _reinit
from lowprec.unit.core import scale_fwd
from lowprec.unit.mode import UnitMode
from lowprec.unit.residual_fx import find_residual_modules, rewrite_residual
from lowprec.unit.residual_run import Runtime, analyse

__all__ = ["UnitConfig", "unit_scale"]

log = logging.getLogger("lowprec.unit")
# Marks messages already in the transform's one WARNING as warned, without logging them.
_quiet = logging.getLogger("lowprec.unit.reported")
_quiet.propagate = False
_quiet.addHandler(logging.NullHandler())

_NO_RULE_TYPES = (nn.Conv2d, nn.Conv3d, nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
                  nn.MultiheadAttention, nn.RNNBase)  # fmt: skip


def _unit_forward_class(cls: type[nn.Module]) -> type[nn.Module]:
    @functools.wraps(cls.forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        rt = self.__dict__.get("_unit_runtime")
        with UnitMode(cast(UnitConfig, self._unit_config), rt):
            return super(new_cls, self).forward(*args, **kwargs)  # type: ignore[arg-type]

    attrs = {"forward": forward, "__module__": cls.__module__}
    new_cls = type(f"Unit{cls.__name__}", (cls,), attrs)
    return new_cls


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


def _example(
    model: nn.Module, example_inputs: Any
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    ex = example_inputs
    if ex is None:
        try:  # HF transformers models carry their own (a property that may raise)
            ex = getattr(model, "dummy_inputs", None)
        except Exception:
            ex = None
        if not isinstance(ex, Mapping):
            return None
    if isinstance(ex, Mapping):
        return (), dict(ex)
    if isinstance(ex, tuple):
        return ex, {}
    if isinstance(ex, Tensor):
        return (ex,), {}
    raise TypeError(
        f"example_inputs must be a tuple of positional arguments, a dict of keyword "
        f"arguments, a Tensor or None, got {type(ex).__name__}"
    )


def _run_analysis(
    model: nn.Module, cfg: UnitConfig, ex: tuple[tuple[Any, ...], dict[str, Any]]
) -> tuple[Any, list[tuple[str, int]], list[tuple[str, str]]]:
    collected: list[tuple[str, str]] = []
    args, kw = ex
    modes = [m for m in model.modules() if m.training]
    try:
        model.eval()  # dropout off: the example run draws no random numbers
        with torch.no_grad():
            plans, order = analyse(
                model,
                lambda: model(*args, **kw),
                lambda where: UnitMode(cfg, _Where(where), collected),
            )
    finally:
        for m in modes:
            m.train()
    return plans, order, collected


class _Where:
    """Names the running module for the unit mode during the example run."""

    frames: tuple[()] = ()

    def __init__(self, where: Callable[[], str | None]) -> None:
        self.where = where


def unit_scale(
    model: nn.Module,
    *,
    reinit: bool = False,
    float8: bool = False,
    residual: str | Sequence[float] | Callable[[int], list[float]] = "running-mean",
    tau: float = 0.5,
    readout: str | None = "auto",
    config: UnitConfig | None = None,
    strict: bool = False,
    example_inputs: Any = None,
) -> nn.Module:
    """Return a unit-scaled copy of ``model`` (``model`` itself is not changed).

    ``reinit=True`` is required: every weight is re-initialised to unit variance (see the
    module doc: a model's own, e.g. pretrained, weights are never kept silently).
    Called exactly like ``model``, with the same outputs (a loss from ``F.cross_entropy``
    keeps its true value; only gradients are scaled). ``residual``: the τ scheme of
    :func:`lowprec.unit.functional.residual_taus` (``"running-mean"``, ``"fixed"`` with
    ``tau``), one ``τ`` per residual add found, or a function of their number ``n`` giving
    the list (e.g. :func:`lowprec.unit.umup.umup_taus`). ``readout``: the output layer's
    module name (``"auto"``: the last ``nn.Linear``; ``None``: none). ``config`` overrides
    ``float8``/``strict`` and sets the mults. ``example_inputs`` (a tuple of positional
    arguments, a dict of keyword arguments or one tensor; default: an HF model's
    ``dummy_inputs``): run once, without gradients, to find the residual adds of modules
    fx cannot trace. The result's ``unit_report`` dict says what was converted and what
    was left unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if reinit is not True:
        raise ValueError(
            f"reinit: unit_scale re-initialises every weight to unit variance (a model's own, "
            f"e.g. pretrained, weights do not compute its function once unit-scaled); pass "
            f"reinit=True to confirm, got reinit={reinit!r}"
        )
    if hasattr(model, "_unit_config"):
        raise ValueError("model: already unit-scaled")
    if config is not None and not isinstance(config, UnitConfig):
        raise TypeError(f"config must be a UnitConfig or None, got {type(config).__name__}")
    cfg = config or UnitConfig(float8=float8, strict=strict)
    ex = _example(model, example_inputs)
    model = copy.deepcopy(model)
    bad = sorted({f"{type(m).__name__}: no unit-scaling rule for this module type"
                  for m in model.modules() if isinstance(m, _NO_RULE_TYPES)})  # fmt: skip
    if bad and cfg.strict:
        raise NotImplementedError(f"unit_scale: no unit-scaling rule for modules {bad}")
    converted, left = convert_modules(model)
    _reinit(model)
    if left and cfg.strict:
        raise NotImplementedError(f"unit_scale: {left[0]}")
    found, untraced = find_residual_modules(model)
    model, fx_adds = _apply_fx(model, found)
    plans: dict[str, Any] = {}
    order: list[tuple[str, int]] = []
    op_msgs: list[tuple[str, str]] = []
    if untraced and ex is not None:
        plans, order, op_msgs = _run_analysis(model, cfg, ex)
    n = len(fx_adds) + len(order)
    if isinstance(residual, str):
        taus = U.residual_taus(n, residual, tau)
    elif callable(residual):
        taus = list(residual(n))
    else:
        taus = [float(t) for t in residual]
    if len(taus) != n:
        raise ValueError(f"residual: {n} residual adds found, got {len(taus)} taus")
    found_names = _set_fx_taus(fx_adds, taus[: len(fx_adds)])
    residual_names = found_names
    unit_adds = []
    for (mname, k), t in zip(order, taus[len(fx_adds) :], strict=True):
        plans[mname][k].tau = t
        residual_names.append(f"{mname}: add #{k} (tau={t:.4g})")
    for mname, steps in plans.items():
        unit_adds += [f"{mname}: add #{k} ({st.kind})" for k, st in steps.items()
                      if st.kind != "residual"]  # fmt: skip
    head = _find_readout(model, readout)
    if head is not None:
        head_module = model.get_submodule(head)
        fan_in = cast(nn.Linear, head_module).in_features
        head_module.register_forward_hook(_ReadoutScale(cfg.output_mult / math.sqrt(fan_in)))
        if cfg.float8 and not cfg.float8_readout:
            head_module.forward = types.MethodType(_readout_forward, head_module)  # type: ignore[method-assign]
    runtime = None
    if untraced and ex is not None:  # the plans, and module names for run-time messages
        runtime = Runtime(plans)
        runtime.install(model)
    why = "torch.fx cannot trace it and no example_inputs were given: its adds stay plain adds"
    not_run = [f"{n_} ({c}): {why}" for n_, c in untraced] if ex is None else []
    seen_ops: dict[str, str] = {}
    for key, msg in op_msgs:
        seen_ops.setdefault(key, msg)
        warn_once(_quiet, key, "%s", msg)
    unsupported = bad + left + not_run + list(seen_ops.values())
    if unsupported:
        log.warning("unit_scale: not handled, left unchanged (standard init and ops):\n  %s",
                    "\n  ".join(unsupported))  # fmt: skip
    _route_loss_modules(model)
    model.__class__ = _unit_forward_class(type(model))
    object.__setattr__(model, "_unit_config", cfg)
    object.__setattr__(model, "_unit_runtime", runtime)
    object.__setattr__(model, "unit_report", {
        "residual_adds": residual_names,
        "unit_adds": unit_adds,
        "readout": head,
        "converted_modules": converted,
        "untraced_modules": [f"{n_} ({c})" for n_, c in untraced],
        "analysed_by_running": runtime is not None,
        "unsupported": unsupported,
        "reinit": True,
    })  # fmt: skip
    return model


def _apply_fx(
    model: nn.Module, found: list[tuple[str, nn.Module, fx.Graph, list[Any]]]
) -> tuple[nn.Module, list[tuple[str, fx.GraphModule, fx.Node, fx.Node]]]:
    """Rewrite the residual adds fx found (τ set later by :func:`_set_fx_taus`); returns
    the model (a new root if the root was traced) and ``(name, module, split, add)`` each."""
    adds: list[tuple[str, Any, fx.Node, fx.Node]] = []
    for name, _m, graph, res in found:
        for add, skip, out in res:
            split = rewrite_residual(graph, add, skip, out, 0.5)
            adds.append((f"{name or '<root>'}.{add.name}", name, split, add))
    gms: dict[str, fx.GraphModule] = {}
    for name, m, graph, _ in reversed(found):  # deepest first: parents copy rewritten children
        gm = fx.GraphModule(m, graph, class_name=type(m).__name__)
        gms[name] = gm
        if not name:
            model = gm
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, gm)
    return model, [(label, gms[name], split, add) for label, name, split, add in adds]


def _set_fx_taus(
    adds: list[tuple[str, fx.GraphModule, fx.Node, fx.Node]], taus: list[float]
) -> list[str]:
    names, dirty = [], {}
    for (label, gm, split, add), t in zip(adds, taus, strict=True):
        split.args = (split.args[0], t)
        add.args = (add.args[0], add.args[1], t)
        dirty[id(gm)] = gm
        names.append(f"{label} (tau={t:.4g})")
    for gm in dirty.values():
        gm.recompile()
    return names


class _ReadoutScale:
    """Forward hook: μP's readout multiplier ``output_mult/√fan_in`` (forward only)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        return scale_fwd(out, self.factor)


def _readout_forward(self: nn.Linear, x: Tensor) -> Tensor:
    """The readout's forward under ``float8``: the unit linear without FP8 rounding."""
    return U.linear(x, self.weight, self.bias)


def _find_readout(model: nn.Module, readout: str | None) -> str | None:
    if readout is None:
        return None
    if readout == "auto":
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        return names[-1] if names else None
    try:
        m = model.get_submodule(readout)
    except AttributeError:
        m = None
    if not isinstance(m, nn.Linear):
        raise ValueError(f"readout: {readout!r} is not an nn.Linear submodule of the model")
    return readout
