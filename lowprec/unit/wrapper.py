"""The unit model of :func:`~lowprec.unit.transform.unit_scale` and the end of the transform.

:func:`_unit_forward_class` makes the subclass the unit model's root takes: its ``forward``
runs the model's own one (:func:`_own_forward`) under the unit mode
(:class:`~lowprec.unit.mode.UnitMode`). :func:`_finish` completes a transform: it runs the
model once on example inputs (:func:`_example`) to find the residual adds of the modules fx
could not trace (:func:`_run_analysis`, :mod:`lowprec.unit.residual_run`), sets every
residual's τ (:class:`_Plan` holds what it needs), installs the runtime, writes
``unit_report`` and logs what is not handled. Without example inputs it runs on the
model's first call instead (:func:`_first_call`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, fx, nn

from lowprec.core.modes import checkpointed_layer
from lowprec.core.warn import warn_once
from lowprec.unit import functional as U
from lowprec.unit.config import UnitConfig
from lowprec.unit.graphs import _graph_forward, _set_fx_taus
from lowprec.unit.mode import UnitMode
from lowprec.unit.residual_run import Runtime, analyse

log = logging.getLogger("lowprec.unit")
# Marks messages already in the transform's one WARNING as warned, without logging them.
_quiet = logging.getLogger("lowprec.unit.reported")
_quiet.propagate = False
_quiet.addHandler(logging.NullHandler())


def readout_of(model: nn.Module) -> nn.Module | None:
    """The readout layer of a unit-scaled ``model`` (its ``unit_report["readout"]``, looked
    up at each call: a float8 conversion may have replaced the module), or ``None``."""
    report = model.__dict__.get("unit_report")
    name = report.get("readout") if isinstance(report, dict) else None
    return model.get_submodule(name) if name else None


def _unit_forward_class(cls: type[nn.Module]) -> type[nn.Module]:
    @functools.wraps(cls.forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # every input, positional or keyword, goes to the model's own forward unchanged
        d = self.__dict__
        if d.get("_unit_analysing"):  # the analysis run: its own mode converts the ops
            return _own_forward(self, args, kwargs)
        if d.get("_unit_pending") is not None:
            return _first_call(self, args, kwargs)
        if (
            self.training
            and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and checkpointed_layer(self) is not None
        ):
            raise NotImplementedError(
                "unit_scale: activation checkpointing (gradient_checkpointing_enable) "
                "recomputes layers in backward outside the unit mode, so their gradients "
                "would be those of the plain layers (16x to 3e7x off, measured); call "
                "model.gradient_checkpointing_disable() to train a unit-scaled model"
            )
        cfg = cast(UnitConfig, self._unit_config)
        with UnitMode(cfg, d.get("_unit_runtime"), readout=readout_of(self)):
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
) -> tuple[Any, list[tuple[str, int]], list[tuple[str, str, int]], list[tuple[str, str]]]:
    """Run ``model`` once on ``ex`` (no gradients, eval mode, its own forward: the unit
    model's mode is the analysis' outer one) and return the plans, the residual adds in
    call order, the call's events (:func:`~lowprec.unit.residual_run.analyse`) and the
    unhandled calls seen."""
    collected: list[tuple[str, str]] = []
    args, kw = ex
    modes = [m for m in model.modules() if m.training]
    object.__setattr__(model, "_unit_analysing", True)
    try:
        model.eval()  # dropout off: the example run draws no random numbers
        with torch.no_grad():
            plans, order, events = analyse(
                model,
                lambda: model(*args, **kw),
                lambda where: UnitMode(cfg, _Where(where), collected, readout=readout_of(model)),
            )
    finally:
        object.__setattr__(model, "_unit_analysing", False)
        for m in modes:
            m.train()
    return plans, order, events, collected


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


def _call_order(
    model: nn.Module,
    fx_adds: list[tuple[str, str, str, str]],
    order: list[tuple[str, int]],
    events: list[tuple[str, str, int]],
) -> list[int | tuple[str, int]]:
    """Every residual add in the order the model runs them, which the residual schemes'
    τ follow: ``fx_adds``' indices and ``order``'s ``(module, k)``, placed by ``events``
    of an analysis run (:func:`~lowprec.unit.residual_run.analyse`). An fx add runs
    after the last module its graph calls before it (else at its module's call) and
    before the next: it is placed just after that call's ``post`` (or the ``pre``) event.
    Without events (no run), and for an fx module the run never called, fx's adds come
    first, in the order fx found them (modules in ``named_modules`` order, each graph's
    adds in graph order)."""
    if not events:
        return [*range(len(fx_adds)), *order]
    keyed: list[tuple[tuple[int, int, int], int | tuple[str, int]]] = []
    at = {e: i for i, e in reversed(list(enumerate(events)))}  # an event's first place
    for e, i in at.items():
        if e[0] == "add":
            keyed.append(((i, 0, 0), (e[1], e[2])))
    for idx, (_, mname, _, add_name) in enumerate(fx_adds):
        name = mname or "<root>"
        start = at.get(("pre", name, 0))
        if start is None:
            keyed.append(((-1, 0, idx), idx))
            continue
        nodes = list(cast(fx.GraphModule, model.get_submodule(mname)).graph.nodes)
        anchor = ("pre", name, 0)
        pos = next(p for p, node in enumerate(nodes) if node.name == add_name)
        for node in nodes[:pos]:
            if node.op == "call_module":
                anchor = ("post", f"{mname}.{node.target}" if mname else str(node.target), 0)
        i = next((j for j in range(start, len(events)) if events[j] == anchor), start)
        keyed.append(((i, 1, pos), idx))
    keyed.sort(key=lambda kv: kv[0])
    return [a for _, a in keyed]


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
    events: list[tuple[str, str, int]] = []
    op_msgs: list[tuple[str, str]] = []
    if ex is not None and plan.untraced:
        plans, order, events, op_msgs = _run_analysis(model, cfg, ex)
    adds = _call_order(model, plan.fx_adds, order, events)
    taus = _taus(plan, len(adds), final=not pending)
    fx_taus = [0.0] * len(plan.fx_adds)
    for a, t in zip(adds, taus, strict=True):
        if isinstance(a, int):
            fx_taus[a] = t
        else:
            plans[a[0]][a[1]].tau = t
    fx_names = _set_fx_taus(model, plan.fx_adds, fx_taus)
    residual_names = [
        fx_names[a] if isinstance(a, int) else f"{a[0]}: add #{a[1]} (tau={t:.4g})"
        for a, t in zip(adds, taus, strict=True)
    ]
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
        cfg = cast(UnitConfig, model._unit_config)
        with UnitMode(cfg, rt, readout=readout_of(model)):
            return _own_forward(model, args, kwargs)
    finally:
        rt.reset()


_first_call = cast(Callable[..., Any], torch.compiler.disable(_first_call_eager))  # type: ignore[no-untyped-call]
