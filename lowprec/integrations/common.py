"""What every trainer adapter shares: module filters, weight-decay groups, lowprec's own
checkpoint state.

* :func:`with_module_filter`: a recipe whose float8 conversion skips the linears that
  ``module_filter(module, fqn)`` refuses, in the style of Accelerate's
  ``AORecipeKwargs(module_filter_func=...)``: each refused layer becomes a
  :class:`~lowprec.recipes.layers.LayerRule` ``(fqn, None)`` in front of the recipe's own
  rules (the first matching rule wins), so the filter is recorded in the recipe and in
  every checkpoint that stores it.
* :func:`decay_groups`: a ``param_groups`` callback for :func:`lowprec.recipes.prepare`
  that splits each group (u-μP's included, their ``"lr_mult"`` kept) into the parameters
  that decay and those that do not, as HF's ``Trainer`` does.
* :func:`factory_of`: an optimizer factory that rebuilds a user's (fresh) optimizer over
  the prepared parameters: its class and its defaults.
* :func:`lowprec_state` / :func:`load_lowprec_state`: the part of a
  :class:`~lowprec.recipes.Prepared` that a trainer's own checkpoint does not hold: the
  recipe (checked on load), the model's buffers (float8 amax histories, static scales,
  calibration maxima) and the progress of a static-scale calibration. Parameters,
  optimizer (with FP32 masters, lean states and the stochastic-rounding generator) and
  loss scaler are saved by the trainer as its model, optimizer and scaler.

Example:
    >>> import torch
    >>> from torch import nn
    >>> m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> r = with_module_filter("fp8-tensorwise", m, lambda mod, fqn: mod.out_features > 2)
    >>> [(rule.pattern, rule.float8) for rule in r.layers]
    [('2', None)]
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import lowprec.unit
from lowprec.recipes import OptimizerFactory, Prepared, Recipe, get_recipe
from lowprec.recipes.layers import LayerRule

__all__ = [
    "ModuleFilter",
    "decay_groups",
    "factory_of",
    "linear_layers",
    "load_lowprec_state",
    "lowprec_state",
    "move_scheduler",
    "unit_accumulated",
    "unwrap",
    "with_module_filter",
]

ModuleFilter = Callable[[nn.Module, str], bool]
STATE_VERSION = 1


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(fqn, module)`` of every layer a float8 recipe converts: ``nn.Linear`` (and
    subclasses) and HF transformers' ``Conv1D``."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    ]


def _escape(fqn: str) -> str:
    """``fqn`` as an :func:`fnmatch.fnmatchcase` pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in fqn)


def with_module_filter(
    recipe: str | Recipe, model: nn.Module, module_filter: ModuleFilter | None
) -> Recipe:
    """``recipe`` whose float8 conversion leaves in high precision every linear of ``model``
    that ``module_filter(module, fqn)`` refuses (see the module docstring). ``None``
    returns the recipe as it is. The fqns are those of ``model`` as given (a unit recipe
    converts a unit-scaled copy with the same names)."""
    r = get_recipe(recipe)
    if module_filter is None:
        return r
    if not callable(module_filter):
        raise TypeError(
            f"module_filter must be a callable (module, fqn) -> bool, got "
            f"{type(module_filter).__name__}"
        )
    if r.float8 is None:
        raise ValueError(
            f"module_filter: recipe {r.name!r} converts no layer to float8 (it has no float8 "
            "technique), so there is nothing to filter"
        )
    refused = tuple(
        LayerRule(_escape(fqn), None)
        for fqn, m in linear_layers(model)
        if not module_filter(m, fqn)
    )
    return replace(r, layers=refused + r.layers)


def decay_groups(
    decay: Collection[str] | Callable[[nn.Module], Collection[str]], weight_decay: float
) -> Callable[[nn.Module, list[Any]], list[Any]]:
    """A ``param_groups`` callback for :func:`lowprec.recipes.prepare`: every group (or
    the one list of parameters) is split into the parameters whose name is in ``decay``
    (``weight_decay``) and the others (``0.0``); empty groups are dropped, other group
    options (u-μP's ``"lr"``, ``"lr_mult"``) are kept. ``decay`` may be a function of the
    prepared model (names change when a technique wraps the model)."""
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
        raise TypeError(f"weight_decay must be a number, got {type(weight_decay).__name__}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")

    def regroup(model: nn.Module, params: list[Any]) -> list[Any]:
        names = set(decay(model) if callable(decay) else decay)
        decays = {id(p) for n, p in model.named_parameters() if n in names}
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        out: list[dict[str, Any]] = []
        for g in groups:
            ps = list(g["params"])
            for wd, keep in ((float(weight_decay), True), (0.0, False)):
                sel = [p for p in ps if (id(p) in decays) == keep]
                if sel:
                    out.append({**g, "params": sel, "weight_decay": wd})
        return out

    return regroup


def factory_of(
    optimizer: torch.optim.Optimizer, model: nn.Module | None = None
) -> OptimizerFactory:
    """A factory that builds ``type(optimizer)(params, **optimizer.defaults)``: the user's
    optimizer over the prepared parameters. ``optimizer`` must be fresh (no state yet) and
    have one parameter group (per-group options cannot follow the parameters through a
    conversion; pass a factory and, for groups, ``param_groups`` instead). With ``model``:
    the prepared optimizer updates every trainable parameter of ``model``, so
    ``optimizer`` must hold exactly those (``ValueError`` naming the others: one built over
    a part of the model would otherwise train all of it)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if len(optimizer.state) > 0:
        raise ValueError("optimizer: it has stepped already (state present); pass a fresh one")
    if len(optimizer.param_groups) != 1:
        raise ValueError(
            f"optimizer: {len(optimizer.param_groups)} parameter groups; lowprec rebuilds the "
            "optimizer over the prepared parameters and keeps only its class and defaults: "
            "pass one group (or an optimizer factory)"
        )
    if model is not None:
        held = {id(q) for g in optimizer.param_groups for q in g["params"]}
        named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        left = [n for n, q in named if id(q) not in held]
        foreign = len(held - {id(q) for _, q in named})
        if left or foreign:
            raise ValueError(
                f"optimizer: it holds {len(held) - foreign} of the model's {len(named)} "
                f"trainable parameters{f' and {foreign} that are not' if foreign else ''} "
                f"(not held: {left[:3]}); lowprec rebuilds the optimizer over every trainable "
                "parameter: freeze the others with requires_grad_(False), or pass a factory "
                "and param_groups"
            )
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters  # defaults may hold more keys
    group = optimizer.param_groups[0]
    defaults = {k: group.get(k, v) for k, v in optimizer.defaults.items() if k in accepted}

    def factory(params: list[Any]) -> torch.optim.Optimizer:
        return cls(params, **defaults)

    return factory


def lowprec_state(prepared: Prepared) -> dict[str, Any]:
    """What a trainer's checkpoint lacks of ``prepared`` (see the module docstring): plain
    tensors, numbers and strings only (``torch.load(weights_only=True)`` reads it)."""
    sd = unwrap(prepared.model).state_dict(keep_vars=True)
    buffers = {k: v.detach().clone() for k, v in sd.items() if not isinstance(v, nn.Parameter)}
    return {
        "version": STATE_VERSION,
        "recipe": prepared.recipe.to_dict(),
        "buffers": buffers,
        "calibration": prepared.calibration_progress(),
    }


def unwrap(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wraps (its state's keys without
    ``module.``: a checkpoint of a data-parallel run resumes on one process, and back),
    else ``model``."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def load_lowprec_state(prepared: Prepared, state: dict[str, Any]) -> None:
    """Restore :func:`lowprec_state` into ``prepared`` (after the trainer loaded the
    model's parameters). ``ValueError`` if it was saved with another recipe or holds
    buffers the model does not have."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise ValueError(f"state: not a lowprec integration state (version {STATE_VERSION})")
    saved = Recipe.from_dict(state["recipe"])
    if saved != prepared.recipe:
        raise ValueError(
            f"state: saved with recipe {saved.name!r}, this run uses {prepared.recipe.name!r}"
        )
    buffers = state["buffers"]
    _, unexpected = unwrap(prepared.model).load_state_dict(buffers, strict=False)
    if unexpected:
        raise ValueError(f"state: buffers the model does not have: {sorted(unexpected)[:5]}")
    prepared.resume_calibration(state.get("calibration"))


def unit_accumulated(loss: Tensor, recipe: Recipe, k: int) -> Tensor:
    """A micro-batch's ``loss`` of one of ``k`` accumulated into a step, its backward
    scaled by ``√k`` for a unit ``recipe`` (the trainer divides the loss by ``k``): a unit
    weight gradient carries ``b^-1/2`` of its own backward's ``b`` tokens, so the ``k``
    micro-batches' gradients sum to ``√k`` times one batch of ``k·b`` tokens, and
    ``√k / k`` makes the step's gradient that batch's. ``loss`` itself otherwise."""
    if recipe.unit is None or k <= 1:
        return loss
    return lowprec.unit.scale_bwd(loss, math.sqrt(k))


def move_scheduler(scheduler: Any, new: torch.optim.Optimizer) -> None:
    """Rebind a torch LR ``scheduler`` built on a user's optimizer to ``new``, the one
    lowprec built over the prepared parameters (its base rates from ``new``'s groups, and
    ``new.step`` marked as torch's schedulers mark their own optimizer's). Where the group
    counts differ (u-μP's groups, the weight-decay split), a per-group setting that is the
    same for every group (``LambdaLR``'s one ``lr_lambda``) serves every group of ``new``;
    ``ValueError`` where they differ between groups. A scheduler already on ``new`` is
    left as it is."""
    if getattr(scheduler, "optimizer", None) is new:
        return
    old = getattr(scheduler, "optimizer", None)
    n_old, n_new = (len(o.param_groups) for o in (old, new)) if old is not None else (0, 0)
    if n_old != n_new:  # per-group settings (LambdaLR's lr_lambdas): one for all, or refuse
        per_group = {
            k: v
            for k, v in vars(scheduler).items()
            if k not in ("base_lrs", "_last_lr") and isinstance(v, list) and len(v) == n_old
        }
        for k, v in per_group.items():
            if any(x is not v[0] and x != v[0] for x in v):
                raise ValueError(
                    f"scheduler: its {k} differ between the {n_old} parameter groups it was "
                    f"built on; lowprec's optimizer has {n_new} (u-muP or weight-decay "
                    "groups): build the scheduler on the optimizer lowprec made"
                )
            setattr(scheduler, k, [v[0]] * n_new)
    # the schedule's current factor (its last rate over its base) carries over to new
    factors = [1.0]
    if old is not None and getattr(scheduler, "base_lrs", None):
        factors = [float(g["lr"]) / b if b else 1.0
                   for g, b in zip(old.param_groups, scheduler.base_lrs, strict=False)]  # fmt: skip
    scheduler.optimizer = new
    for g in new.param_groups:
        g.setdefault("initial_lr", g["lr"])
    scheduler.base_lrs = [g["initial_lr"] for g in new.param_groups]
    for i, g in enumerate(new.param_groups):
        g["lr"] = g["initial_lr"] * (factors[i] if len(factors) == n_new else factors[0])
    scheduler._last_lr = [g["lr"] for g in new.param_groups]
    _track_step(new)


def _track_step(optimizer: Any) -> None:
    """Mark ``optimizer.step`` calls as torch's LR schedulers do for their own optimizer
    (their check that ``optimizer.step()`` ran before ``scheduler.step()``)."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper
