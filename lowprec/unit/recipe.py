"""The unit technique's entry point: :func:`apply`, and the recipes' hook :func:`apply_unit`.

:func:`apply` turns a standard model into its unit-scaled u-μP equivalent (residual τ by
u-μP's depth rule, :func:`lowprec.unit.umup.umup_taus`); :func:`recipe_param_groups` gives
its u-μP AdamW parameter groups for a caller's learning rate; :func:`apply_unit` is the two
together, as ``lowprec.recipes`` calls them.

Base lr mapping: recipes pass the learning rate tuned for the standard model (the demo's
``3e-3``). u-μP's global ``η`` lives on another scale (unit-variance weights: O(1)), so
``η = UMUP_LR_PER_LR · lr``, the constant chosen so that the demo's ``lr`` maps to the best
``η`` of an η sweep of the unit-scaled CharGPT (results: ``docs/unit-scaling.md``). Each
group's ``"lr_mult"`` is relative to the *caller's* ``lr``, so
``group["lr"] = lr_now * group["lr_mult"]`` keeps the caller's schedule.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from lowprec.unit.config import UnitConfig
from lowprec.unit.transform import unit_scale
from lowprec.unit.umup import umup_param_groups, umup_taus

__all__ = ["UMUP_LR_PER_LR", "apply", "apply_unit", "recipe_param_groups"]

# η = UMUP_LR_PER_LR · lr: the demo's lr 3e-3 maps to η = 1.0 (the sweep behind it:
# docs/unit-scaling.md; rerun with benchmarks/bench_umup_sweep.py).
UMUP_LR_PER_LR = 1.0 / 3e-3


def apply(
    model: nn.Module, config: UnitConfig | None = None, *, reinit: bool = False, **kw: Any
) -> nn.Module:
    """A unit-scaled u-μP copy of ``model`` (``model`` is not changed): the unit technique's
    one entry point.

    :func:`lowprec.unit.unit_scale` with ``config`` (default ``UnitConfig()``), residual τ
    by u-μP's depth rule and the readout found automatically (the last ``nn.Linear``).
    Every weight is re-initialised to unit variance, so ``reinit=True`` is required (a
    model's own weights are never discarded silently); ``kw`` goes to ``unit_scale``
    (e.g. ``example_inputs``). Cast the result afterwards as usual; train it with
    :func:`recipe_param_groups` (or :func:`lowprec.unit.umup_param_groups`).

    Example:
        >>> from lowprec.jobs.model import CharGPT, ModelConfig
        >>> m = apply(CharGPT(ModelConfig(width=32, depth=1, heads=2)), UnitConfig(), reinit=True)
        >>> [t.split()[-1] for t in m.unit_report["residual_adds"]]  # umup_taus(2)
        ['(tau=0.3333)', '(tau=0.25)']
    """
    if config is None:
        config = UnitConfig()
    if not isinstance(config, UnitConfig):
        raise TypeError(f"config must be a UnitConfig, got {type(config).__name__}")
    return unit_scale(model, reinit=reinit, residual=umup_taus, config=config, **kw)


def recipe_param_groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """u-μP AdamW parameter groups of a unit-scaled ``model`` for the caller's ``lr``.

    :func:`lowprec.unit.umup_param_groups` at ``η = UMUP_LR_PER_LR · lr``, with each
    group's ``"lr_mult"`` relative to ``lr`` (``group["lr"] = lr · group["lr_mult"]``) and
    no ``"weight_decay"``: the caller's optimizer's default applies to every parameter, as
    it does to the standard model (decoupled: a group decays by its own
    ``lr·weight_decay`` per step; other choices compared in ``docs/unit-scaling.md``).
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (0 < lr < math.inf):
        raise ValueError(f"lr must be a finite float > 0, got {lr!r}")
    groups = umup_param_groups(model, UMUP_LR_PER_LR * lr, optimizer="adamw")
    for g in groups:
        g["lr_mult"] = g["lr"] / lr
        del g["weight_decay"]  # the caller's optimizer's weight decay, as for the standard model
    return groups


def apply_unit(
    model: nn.Module, *, float8: bool, lr: float, reinit: bool = False
) -> tuple[nn.Module, list[dict[str, Any]]]:
    """``(apply(model, UnitConfig(float8=float8), reinit=reinit), recipe_param_groups(·, lr))``.

    Example:
        >>> from lowprec.jobs.model import CharGPT, ModelConfig
        >>> m, groups = apply_unit(CharGPT(ModelConfig(width=32, depth=1, heads=2)), float8=False, lr=3e-3, reinit=True)
        >>> sorted(round(g["lr_mult"], 1) for g in groups)  # η/lr · (1/√128, 1/√32, 1)
        [29.5, 58.9, 333.3]
    """  # noqa: E501
    unit = apply(model, UnitConfig(float8=float8), reinit=reinit)
    return unit, recipe_param_groups(unit, lr)
