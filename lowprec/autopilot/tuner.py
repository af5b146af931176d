"""``tune(model, batches, loss_fn=...)``: measure, choose, and return a :class:`Plan`.

The steps (docs/autopilot.md):

1. the reference: the batches' losses and gradients with the model (a deep copy) in its
   own precision, and the FLOPs of each GEMM (:class:`~lowprec.autopilot.sensitivity.Probe`);
2. the sensitivity: each GEMM of each linear layer lowered alone to each candidate
   (:meth:`~lowprec.autopilot.sensitivity.Probe.sensitivity`); candidates that cannot
   make a GEMM cheaper on the target (rate 1, as everything on ``cpu``) are not run;
3. the choice and its repair (:mod:`lowprec.autopilot.search`);
4. the plan: a :class:`~lowprec.Recipe` with one layer rule per linear layer, the cost
   (:func:`~lowprec.autopilot.cost.gemm_cost`) and every number behind the choice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from lowprec.autopilot import search
from lowprec.autopilot.cost import GEMMS, check_candidates, check_target, gemm_cost, rate
from lowprec.autopilot.plan import Budget, Plan
from lowprec.autopilot.sensitivity import LossFn, Measured, Outcome, Probe
from lowprec.float8 import Float8Config
from lowprec.recipes import get_recipe
from lowprec.recipes.layers import LayerRule

__all__ = ["tune"]


def tune(
    model: nn.Module,
    batches: Sequence[Any],
    *,
    loss_fn: LossFn,
    target: str = "h100",
    budget: Budget | float | None = None,
    candidates: Sequence[str] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """A per-layer, per-GEMM low-precision plan for ``model`` on ``target``.

    Args:
        model: the model (not modified: the tuner works on a deep copy).
        batches: a few batches; ``loss_fn(model, batch)`` returns each one's scalar loss.
        target: ``h100``, ``h200``, ``b200`` or ``cpu`` (the rate table of
            :mod:`lowprec.autopilot.cost`).
        budget: the error the plan may add (:class:`Budget`; a float ``b`` is
            ``Budget(loss=b, grad=10·b)``; ``None``: the default ``Budget()``).
        candidates: the formats to choose among (default all of
            :data:`~lowprec.autopilot.cost.CANDIDATES`; ``bf16`` is always one).
        seed: seeds each batch's run (``torch.manual_seed(seed + b)``); the same seed gives
            the same plan.
        progress: called with a line of text after each measured layer and step.

    Returns:
        The :class:`Plan`: ``plan.recipe`` to train with, ``plan.cost``, ``plan.layers``.

    Example:
        >>> import torch
        >>> torch.manual_seed(0) and None
        >>> m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
        ...                         torch.nn.Linear(64, 8))
        >>> data = [torch.randn(16, 32) for _ in range(2)]
        >>> plan = tune(m, data, loss_fn=lambda m, x: m(x).square().mean(), target="cpu")
        >>> plan.cost, sorted(set(plan.formats().values()))
        (1.0, ['bf16'])
    """
    check_target(target)
    b = Budget.of(budget)
    cands = check_candidates(candidates)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    say = progress or (lambda _line: None)
    probe = Probe(model, batches, loss_fn, seed)
    say(
        f"reference: loss {probe.ref_loss:.4f} on {len(probe.batches)} batch(es), "
        f"{len(probe.layers)} linear layers"
    )
    useful = tuple(c for c in cands if c == "bf16" or rate(c, target) > 1.0)
    done = iter(range(1, len(probe.layers) + 1))
    measured = probe.sensitivity(
        useful, lambda fqn: say(f"measured {fqn} ({next(done)}/{len(probe.layers)})")
    )
    errors = search.errors_of(measured, b.loss, b.grad)
    choice = search.start(probe.flops, errors, target)

    def evaluate(ch: Mapping[tuple[str, str], str]) -> Outcome:
        configs = _configs(search.layer_choices(ch, probe.layers))
        return probe.run(configs) if configs else Outcome(0.0, 0.0)

    def plan_error(o: Outcome) -> float:
        return o.error(b.loss, b.grad)

    choice, outcome, moved = search.repair(choice, errors, target, evaluate, plan_error)
    for k in moved:
        say(f"over budget: {k[0]} {k[1]} -> {choice[k]}")
    choice, outcome, lowered = search.improve(
        choice, errors, probe.flops, target, evaluate, plan_error, outcome
    )
    for k in lowered:
        say(f"within budget: {k[0]} {k[1]} -> {choice[k]}")
    cost = gemm_cost(probe.flops, choice, target)
    per_layer = search.layer_choices(choice, probe.layers)
    base = get_recipe("fp8-tensorwise")
    recipe = dataclasses.replace(
        base,
        name=f"plan-{target}",
        description=f"lowprec tune plan for {target}: modelled GEMM cost {cost:.3f} of BF16",
        float8_skip=(),
        # every tuned layer by name; any other layer (a model of another shape than the
        # tuned one) stays BF16: its formats were never measured
        layers=(
            *(LayerRule(fqn, search.layer_config(g)) for fqn, g in per_layer.items()),
            LayerRule("*", None),
        ),
    )
    layers = {
        fqn: _layer_record(fqn, gemms, probe.flops, measured, errors, target)
        for fqn, gemms in per_layer.items()
    }
    say(f"plan: cost {cost:.3f} of BF16 on {target}, error {plan_error(outcome):.2f} of budget")
    return Plan(
        recipe=recipe,
        cost=cost,
        target=target,
        budget=b,
        seed=seed,
        reference_loss=probe.ref_loss,
        layers=layers,
        measured={
            "loss_delta": outcome.loss_delta,
            "grad_err": math.sqrt(outcome.grad_err2),
            "error": plan_error(outcome),
        },
        candidates=cands,
        moved=tuple(f"{fqn}:{g}" for fqn, g in moved),
    )


def _configs(per_layer: Mapping[str, Mapping[str, str]]) -> dict[str, Float8Config]:
    out = {}
    for fqn, gemms in per_layer.items():
        cfg = search.layer_config(gemms)
        if cfg is not None:
            out[fqn] = cfg
    return out


def _layer_record(
    fqn: str,
    gemms: Mapping[str, str],
    flops: Mapping[tuple[str, str], float],
    measured: Mapping[tuple[str, str], Mapping[str, Measured]],
    errors: Mapping[tuple[str, str], Mapping[str, float]],
    target: str,
) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    for g in GEMMS:
        c = gemms[g]
        m = measured[(fqn, g)][c]
        rec[g] = {
            "format": c,
            "flops": flops[(fqn, g)],
            "loss_delta": m.loss_delta,
            "grad_err": math.sqrt(m.grad_err2),
            "sqnr_db": m.sqnr_db,
            "rel_err": m.rel_err,
            "error": errors[(fqn, g)][c],
            "fallbacks": search.fallbacks(errors[(fqn, g)], c, target),
        }
    return {
        "format": search.describe_layer(gemms),
        "flops": sum(flops[(fqn, g)] for g in GEMMS),
        "gemms": rec,
    }
