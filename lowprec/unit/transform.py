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
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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
from lowprec.unit.residual_fx import (
    find_residual_modules,
    rewrite_embedding_sums,
    rewrite_residual,
)
from lowprec.unit.residual_run import Runtime, analyse

__all__ = ["UnitConfig", "unit_scale"]

log = logging.getLogger("lowprec.unit")
# Marks messages already in the transform's one WARNING as warned, without logging them.
_quiet = logging.getLogger("lowprec.unit.reported")
_quiet.propagate = False
_quiet.addHandler(logging.NullHandler())

_SCHEMES = ("fixed", "running-mean", "weighted")  # lowprec.unit.functional.residual_taus
_NO_RULE_TYPES = (nn.Conv2d, nn.Conv3d, nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
                  nn.MultiheadAttention, nn.RNNBase)  # fmt: skip


def _unit_forward_class(cls: type[nn.Module]) -> type[nn.Module]:
    @functools.wraps(cls.forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # every input, positional or keyword, goes to the model's own forward unchanged
        d = self.__dict__
        if d.get("_unit_analysing"):  # the analysis run: its own mode converts the ops
            return _own_forward(self, args, kwargs)
        if d.get("_unit_pending") is not None:
            return _first_call(self, args, kwargs)
        with UnitMode(cast(UnitConfig, self._unit_config), d.get("_unit_runtime")):
            return _own_forward(self, args, kwargs)

    attrs = {"forward": forward, "__module__": cls.__module__, "_unit_wrapper": True}
    new_cls = type(f"Unit{cls.__name__}", (cls,), attrs)
    return new_cls


def _own_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward of the unit model's original class (an fx-rewritten root: its graph's,
    called with the original signature), on the call's inputs."""
    if isinstance(model, fx.GraphModule):
        return _graph_forward(model, *args, **kwargs)
    # The class after the unit wrapper in the MRO: classes made *around* it later (FSDP2's
    # fully_shard makes FSDP<UnitX>) must not be taken for the original (a recursion).
    mro = type(model).__mro__
    wrappers = [i for i, c in enumerate(mro) if c.__dict__.get("_unit_wrapper")]
    base = mro[wrappers[-1] + 1] if wrappers else type(model)
    return cast(Any, base).forward(model, *args, **kwargs)


def _generated_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """The forward fx generated for ``gm``'s graph (its class's; recompiling replaces it)."""
    for c in type(gm).__mro__:
        if not c.__dict__.get("_unit_wrapper") and "forward" in c.__dict__:
            return cast(Callable[..., Any], c.__dict__["forward"])
    raise AssertionError("unreachable: a GraphModule class has a generated forward")


def _graph_forward(gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """Call ``gm``'s generated forward with the signature of the module it was traced from.

    fx's generated ``forward`` lists the parameters in the traced code's order, keyword-only
    ones moved before ``*args`` and none positional-only (``(a, /, b, *args, c, **kw)``
    becomes ``(a, b, c, *args, **kw)``): a call in the original form would bind its inputs
    to other parameters. The inputs are bound to the original signature and passed on in
    the generated one's order."""
    fwd = _generated_forward(gm)
    sig = gm.__dict__.get("_unit_signature")
    if sig is None:
        return fwd(gm, *args, **kwargs)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    pos, var, varkw = [], (), {}
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            var = a.get(p.name, ())
        elif p.kind is p.VAR_KEYWORD:
            varkw = a.get(p.name, {})
        else:
            pos.append(a[p.name])
    return fwd(gm, *pos, *var, **varkw)


def _keep_signature(gm: fx.GraphModule, original: Callable[..., Any], root: bool) -> None:
    """Make ``gm`` (traced from a module whose bound forward is ``original``) take its
    inputs as ``original`` does (:func:`_graph_forward`), where fx's generated signature
    differs: positional-only, keyword-only, ``*args`` or ``**kwargs`` parameters. A root
    is called through the unit model's forward; a child gets an instance ``forward``."""
    try:
        sig = inspect.signature(original)
    except (TypeError, ValueError):
        return
    if all(p.kind is p.POSITIONAL_OR_KEYWORD for p in sig.parameters.values()):
        return
    gm.__dict__["_unit_signature"] = sig
    if not root:
        gm.forward = types.MethodType(_graph_forward, gm)  # type: ignore[method-assign]


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
        if not isinstance(ex, Mapping) or not _names_all(model, ex):
            return None  # (e.g. HF's generic input_ids for ViT): analysed on the first call
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


def _names_all(model: nn.Module, kw: Mapping[str, Any]) -> bool:
    """Whether ``model.forward`` names every key of ``kw`` as a parameter (a key only a
    ``**kwargs`` would take, as HF's generic ``input_ids`` for ViT, is not its input)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return all(k in named for k in kw)


def _run_analysis(
    model: nn.Module, cfg: UnitConfig, ex: tuple[tuple[Any, ...], dict[str, Any]]
) -> tuple[Any, list[tuple[str, int]], list[tuple[str, str]]]:
    """Run ``model`` once on ``ex`` (no gradients, eval mode, its own forward: the unit
    model's mode is the analysis' outer one) and return the plans, the residual adds in
    call order and the unhandled calls seen."""
    collected: list[tuple[str, str]] = []
    args, kw = ex
    modes = [m for m in model.modules() if m.training]
    object.__setattr__(model, "_unit_analysing", True)
    try:
        model.eval()  # dropout off: the example run draws no random numbers
        with torch.no_grad():
            plans, order = analyse(
                model,
                lambda: model(*args, **kw),
                lambda where: UnitMode(cfg, _Where(where), collected),
            )
    finally:
        object.__setattr__(model, "_unit_analysing", False)
        for m in modes:
            m.train()
    return plans, order, collected


class _Where:
    """Names the running module for the unit mode during the example run."""

    frames: tuple[()] = ()

    def __init__(self, where: Callable[[], str | None]) -> None:
        self.where = where


@dataclass
class _Plan:
    """What :func:`_finish` needs to complete a transform: at transform time, or on the
    model's first call when the analysis by running waits for its first inputs."""

    residual: str | Sequence[float] | Callable[[int], list[float]]
    tau: float
    # (label, module name, split node name, add node name) of each residual add fx found
    fx_adds: list[tuple[str, str, str, str]]
    fx_sums: list[str]  # labels of the embedding sums fx found
    untraced: list[tuple[str, str]]
    unsupported: list[str]  # known at transform time (module types, leaf modules)
    warned: set[str] = field(default_factory=set)


def _taus(plan: _Plan, n: int, final: bool) -> list[float]:
    """One τ per residual add, ``n`` of them (``final=False``: the adds fx found, before a
    deferred analysis adds its own: a list of τ may then be longer)."""
    if isinstance(plan.residual, str):
        return U.residual_taus(n, plan.residual, plan.tau)
    taus = list(plan.residual(n)) if callable(plan.residual) else [float(t) for t in plan.residual]
    if len(taus) != n and (final or len(taus) < n):
        raise ValueError(f"residual: {n} residual adds found, got {len(taus)} taus")
    return taus[:n]


def _finish(
    model: nn.Module, plan: _Plan, ex: tuple[tuple[Any, ...], dict[str, Any]] | None
) -> None:
    """Find the residual adds of the modules fx could not trace by running ``model`` on
    ``ex`` (if given), set every residual's τ, install the runtime and write
    ``unit_report``; log what is not handled (once per message)."""
    cfg = cast(UnitConfig, model._unit_config)
    pending = ex is None and bool(plan.untraced)
    plans: dict[str, Any] = {}
    order: list[tuple[str, int]] = []
    op_msgs: list[tuple[str, str]] = []
    if ex is not None and plan.untraced:
        plans, order, op_msgs = _run_analysis(model, cfg, ex)
    n = len(plan.fx_adds) + len(order)
    taus = _taus(plan, n, final=not pending)
    residual_names = _set_fx_taus(model, plan.fx_adds, taus[: len(plan.fx_adds)])
    for (mname, k), t in zip(order, taus[len(plan.fx_adds) :], strict=True):
        plans[mname][k].tau = t
        residual_names.append(f"{mname}: add #{k} (tau={t:.4g})")
    unit_adds = plan.fx_sums + [
        f"{mname}: add #{k} ({st.kind})"
        for mname, steps in plans.items()
        for k, st in steps.items()
        if st.kind != "residual"
    ]
    runtime = None
    if plan.untraced and ex is not None:  # the plans, and module names for run-time messages
        runtime = Runtime(plans)
        runtime.install(model)
    seen_ops: dict[str, str] = {}
    for key, msg in op_msgs:
        seen_ops.setdefault(key, msg)
        warn_once(_quiet, key, "%s", msg)
    unsupported = plan.unsupported + list(seen_ops.values())
    new = [u for u in unsupported if u not in plan.warned]
    plan.warned.update(new)
    if new:
        log.warning("unit_scale: not handled, left unchanged (standard init and ops):\n  %s",
                    "\n  ".join(new))  # fmt: skip
    object.__setattr__(model, "_unit_runtime", runtime)
    object.__setattr__(model, "_unit_pending", plan if pending else None)
    report = model.__dict__["unit_report"]
    report.update({
        "residual_adds": residual_names,
        "unit_adds": unit_adds,
        "analysed_by_running": "pending" if pending else runtime is not None,
        "unsupported": unsupported,
    })  # fmt: skip


def _first_call_eager(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The first call of a unit model whose analysis by running was deferred (modules fx
    cannot trace, no example inputs): analyse on these inputs, then run the forward (with
    the root's runtime frame its hooks would have pushed). Eager, also under
    ``torch.compile`` (a graph break; ``fullgraph=True`` refuses it: call the model once,
    or give ``example_inputs``, before compiling so)."""
    plan = cast(_Plan, model.__dict__["_unit_pending"])
    _finish(model, plan, (args, kwargs))
    rt = cast(Runtime, model.__dict__["_unit_runtime"])
    rt.reset()
    rt.enter("<root>", model, args, kwargs)
    try:
        with UnitMode(cast(UnitConfig, model._unit_config), rt):
            return _own_forward(model, args, kwargs)
    finally:
        rt.reset()


_first_call = cast(Callable[..., Any], torch.compiler.disable(_first_call_eager))  # type: ignore[no-untyped-call]


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
    function of their number ``n`` giving the list (e.g. :func:`lowprec.unit.umup.umup_taus`).
    ``readout``: the output layer's module name (``"auto"``: the last ``nn.Linear``;
    ``None``: none). ``config``: a :class:`UnitConfig`; or ``float8``/``strict`` as
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
    cfg = _config(config, float8, strict)
    ex = _example(model, example_inputs)
    model = copy.deepcopy(model)
    bad = sorted({f"{type(m).__name__}: no unit-scaling rule for this module type"
                  for m in model.modules() if isinstance(m, _NO_RULE_TYPES)})  # fmt: skip
    if bad and cfg.strict:
        raise NotImplementedError(f"unit_scale: no unit-scaling rule for modules {bad}")
    converted, left = convert_modules(model)
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


def _apply_fx(
    model: nn.Module, found: list[tuple[str, nn.Module, fx.Graph, list[Any]]]
) -> tuple[nn.Module, list[tuple[str, str, str, str]], list[str]]:
    """Rewrite the residual adds fx found (τ set later by :func:`_set_fx_taus`) and its
    embedding sums; returns the model (a new root if the root was traced), for each
    residual add ``(label, module name, split node name, add node name)`` (names, not
    nodes: they survive a deep copy), and the embedding sums' labels."""
    adds: list[tuple[str, str, str, str]] = []
    sums: list[str] = []
    for name, m, graph, res in found:
        for add, skip, out in res:
            split = rewrite_residual(graph, add, skip, out, 0.5)
            adds.append((f"{name or '<root>'}.{add.name}", name, split.name, add.name))
        sums += [f"{name or '<root>'}.{n} (embed_sum)" for n in rewrite_embedding_sums(m, graph)]
    for name, m, graph, _ in reversed(found):  # deepest first: parents copy rewritten children
        gm = fx.GraphModule(m, graph, class_name=type(m).__name__)
        _keep_signature(gm, m.forward, root=not name)
        if not name:
            model = gm
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, gm)
    return model, adds, sums


def _set_fx_taus(
    model: nn.Module, adds: list[tuple[str, str, str, str]], taus: list[float]
) -> list[str]:
    """Set each fx residual add's τ (and its split's), recompiling the modules changed."""
    names, dirty = [], {}
    for (label, mname, split_name, add_name), t in zip(adds, taus, strict=True):
        gm = cast(fx.GraphModule, model.get_submodule(mname))
        nodes = {n.name: n for n in gm.graph.nodes}
        split, add = nodes[split_name], nodes[add_name]
        if split.args[1] != t or add.args[2] != t:
            split.args = (split.args[0], t)
            add.args = (add.args[0], add.args[1], t)
            dirty[id(gm)] = gm
        names.append(f"{label} (tau={t:.4g})")
    for gm in dirty.values():
        cls = type(gm)
        if cls.__dict__.get("_unit_wrapper"):  # the unit root: recompile into its fx class
            gm.__class__ = cls.__bases__[0]
            try:
                gm.recompile()
            finally:
                gm.__class__ = cls
        else:
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
