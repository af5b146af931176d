"""The hook the recipes call: a unit-scaled model and its u-μP AdamW parameter groups.

Base lr mapping: recipes pass the learning rate tuned for the standard model (the demo's
``3e-3``). u-μP's global ``η`` lives on another scale (unit-variance weights: O(1)); we use
``η = UMUP_LR_PER_LR · lr``, with ``UMUP_LR_PER_LR`` chosen by an η sweep of the
unit-scaled CharGPT at the demo config (see the constant). Each group's ``"lr_mult"`` is
relative to the *caller's* ``lr``, so ``group["lr"] = lr_now * group["lr_mult"]`` keeps the
caller's schedule.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lowprec.unit.transform import UnitConfig, unit_scale
from lowprec.unit.umup import umup_param_groups, umup_taus

__all__ = ["UMUP_LR_PER_LR", "apply_unit"]

# η = UMUP_LR_PER_LR · lr: the demo's lr 3e-3 maps to η = 1.0. Measured (unit-scaled
# CharGPT, fp32, demo config: width 64, depth 2, 300 steps, batch 32x128, AdamW, warm-up 20
# + cosine, the lr rules of lowprec.unit.umup), val loss by η: 0.25 -> 2.279, 0.5 -> 2.162,
# 1.0 -> 2.123, 2.0 -> 2.141 (AdamW weight decay 0.01; the standard fp32 model at lr 3e-3:
# 2.301). At the 120-step test config η 0.5 and 1.0 tie (2.487, 2.483).
UMUP_LR_PER_LR = 1.0 / 3e-3


def apply_unit(
    model: nn.Module, *, float8: bool, lr: float
) -> tuple[nn.Module, list[dict[str, Any]]]:
    """Return ``(unit_scale(model), u-μP AdamW parameter groups)`` for the caller's ``lr``.

    Residual τ by u-μP's depth rule (:func:`lowprec.unit.umup.umup_taus`), mults 1. The
    groups carry no ``"weight_decay"``: the caller's optimizer's default applies to every
    parameter, as it does to the standard model (decoupled: a group decays by its own
    ``lr·weight_decay`` per step). Measured at the demo config with the train loop's AdamW
    (weight decay 0.01): val loss 2.123, against 2.175 with no decay and 2.131 with decay on
    weights, embeddings and readout only. The model is a new module (``model`` is not
    changed); cast it afterwards as usual.

    Example:
        >>> from lowprec.jobs.model import CharGPT, ModelConfig
        >>> m, groups = apply_unit(CharGPT(ModelConfig(width=32, depth=1, heads=2)), float8=False, lr=3e-3)
        >>> sorted(round(g["lr_mult"], 1) for g in groups)  # η/lr · (1/√128, 1/√32, 1)
        [29.5, 58.9, 333.3]
    """  # noqa: E501
    unit = unit_scale(model, residual=umup_taus, config=UnitConfig(float8=float8))
    groups = umup_param_groups(unit, UMUP_LR_PER_LR * lr, optimizer="adamw")
    for g in groups:
        g["lr_mult"] = g["lr"] / lr
        del g["weight_decay"]  # the caller's optimizer's weight decay, as for the standard model
    return unit, groups
