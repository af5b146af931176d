"""The unit technique's entry point: :func:`apply`.

:func:`apply` ``(model, config_or_preset)`` turns a standard model into its unit-scaled u-μP
equivalent (residual τ by u-μP's depth rule, :func:`lowprec.unit.umup.umup_taus`);
:func:`recipe_param_groups` gives its u-μP AdamW parameter groups for a caller's learning
rate (``lowprec.recipes`` calls the two).
:func:`lowprec.unit.unit_scale` is the transform under :func:`apply`, with the residual
τ scheme selectable (default: running mean).

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

from lowprec.core.registry import Registry
from lowprec.unit.config import UnitConfig
from lowprec.unit.transform import unit_scale
from lowprec.unit.umup import umup_param_groups, umup_taus

__all__ = ["PRESETS", "UMUP_LR_PER_LR", "apply", "recipe_param_groups"]

# η = UMUP_LR_PER_LR · lr: the demo's lr 3e-3 maps to η = 1.0 (the sweep behind it:
# docs/unit-scaling.md; rerun with benchmarks/bench_umup_sweep.py).
UMUP_LR_PER_LR = 1.0 / 3e-3


PRESETS: Registry[UnitConfig] = Registry("unit preset", UnitConfig)
PRESETS.add("default", description="unit scaling and u-muP in the model's dtype")
PRESETS.add("float8", float8=True,
            description="every hidden matmul rounded to E4M3/E5M2 (the readout not)")  # fmt: skip
PRESETS.add("float8-readout", float8=True, float8_readout=True,
            description="every matmul, the readout's included, rounded to E4M3/E5M2")  # fmt: skip


def apply(
    model: nn.Module,
    config: UnitConfig | str | None = None,
    *,
    reinit: bool = True,
    readout: str | None = "auto",
    example_inputs: Any = None,
) -> nn.Module:
    """A unit-scaled u-μP copy of ``model`` (``model`` is not changed): the unit
    technique's one entry point.

    ``config``: a :class:`UnitConfig`, a preset name of :data:`PRESETS` (``"default"``,
    ``"float8"``, ``"float8-readout"``) or ``None`` (``UnitConfig()``); every setting of
    the technique is in it (no keyword overrides it). Residual τ follow u-μP's depth rule
    (:func:`lowprec.unit.umup.umup_taus`). ``reinit``, ``readout`` and ``example_inputs``:
    as :func:`lowprec.unit.unit_scale` (by default every weight is re-initialised to unit
    variance, which a unit-scaled model trains from). Cast the result afterwards as
    usual; train it with :func:`recipe_param_groups` (or
    :func:`lowprec.unit.umup_param_groups`).

    Example:
        >>> from lowprec.jobs.model import CharGPT, ModelConfig
        >>> m = apply(CharGPT(ModelConfig(width=32, depth=1, heads=2)), "float8")
        >>> [t.split()[-1] for t in m.unit_report["residual_adds"]]  # umup_taus(2)
        ['(tau=0.3333)', '(tau=0.25)']
        >>> m._unit_config.float8, m.unit_report["unsupported"]
        (True, [])
    """
    if config is None:
        config = UnitConfig()
    elif isinstance(config, str):
        config = PRESETS.get(config)
    if not isinstance(config, UnitConfig):
        raise TypeError(
            f"config must be a UnitConfig, a preset name ({', '.join(PRESETS)}) or None, "
            f"got {type(config).__name__}"
        )
    return unit_scale(
        model,
        reinit=reinit,
        residual=umup_taus,
        config=config,
        readout=readout,
        example_inputs=example_inputs,
    )


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
