"""The choice: per GEMM of each linear layer, the cheapest candidate within the budget.

Each GEMM ``g`` (a layer's ``forward``, ``input_grad`` or ``weight_grad``) with FLOPs
``F_g`` gets the budget share ``s_g = F_g / Σ F``. With ``e_g(c)`` the share of the budget
that lowering only ``g`` to candidate ``c`` used when measured
(:meth:`~lowprec.autopilot.sensitivity.Measured.error`):

1. **start**: ``g`` gets the cheapest ``c`` (largest ``rate(c, target)``) with
   ``e_g(c) ≤ s_g``; between candidates of one cost the safer (smaller ``e_g``), then the
   earlier in :data:`~lowprec.autopilot.cost.CANDIDATES`. ``bf16`` (``e = 0``) always
   qualifies; on the ``cpu`` target every rate is 1, so every GEMM stays ``bf16``. A GEMM
   that never ran (``F_g = 0``: the input gradient of a layer fed data) stays ``bf16``: its
   error was never measured and lowering it saves nothing.
2. **repair**: the whole plan is run (:meth:`~lowprec.autopilot.sensitivity.Probe.run`);
   while its error ``E = loss_delta / loss + grad_err2 / grad²`` exceeds 1, the lowered GEMM
   with the largest ``e_g`` moves to its next safer choice (its first fallback) and the
   plan is run again;
3. **improve**: while the plan is within budget, the GEMM whose next cheaper candidate
   (the safest of the next cost class) costs the least measured error per unit of cost
   saved, ``e_g(c') / (F_g (1/rate(c) − 1/rate(c')))``, is tried there; the move is kept
   if the whole plan, run again, stays within budget, else refused for good. The share
   rule of step 1 is conservative (the errors of GEMMs rarely add up to their sum); this
   step spends what is left of the budget where it buys the most.

A GEMM's **fallbacks** are its safer choices in the order a guard should take them: the
candidates at least as costly as its choice, cheapest first, each kept only if its measured
``e_g`` is below that of the one before it; ``bf16`` last.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from lowprec.autopilot.cost import CANDIDATES, GEMMS, candidate_config, rate
from lowprec.autopilot.sensitivity import Measured, Outcome
from lowprec.float8 import Float8Config

__all__ = [
    "Key",
    "describe_layer",
    "errors_of",
    "fallbacks",
    "improve",
    "layer_choices",
    "layer_config",
    "repair",
    "start",
]

Key = tuple[str, str]  # (layer fqn, gemm)


def _order(c: str, err: float, target: str) -> tuple[float, float, int]:
    return (1.0 / rate(c, target), err, CANDIDATES.index(c))


def start(
    flops: Mapping[Key, float],
    errors: Mapping[Key, Mapping[str, float]],
    target: str,
) -> dict[Key, str]:
    """Step 1 (module docstring): ``errors[key][candidate]`` is ``e_g(c)``."""
    total = sum(flops.values())
    choice = {}
    for key, f in flops.items():
        if f <= 0.0:  # a GEMM that never ran (no input gradient): nothing to save, unmeasured
            choice[key] = "bf16"
            continue
        share = f / total if total > 0 else 0.0
        ok = [c for c, e in errors[key].items() if c == "bf16" or e <= share]
        choice[key] = min(ok, key=lambda c: _order(c, errors[key].get(c, 0.0), target))
    return choice


def fallbacks(errors: Mapping[str, float], chosen: str, target: str) -> list[str]:
    """The safer choices after ``chosen`` (module docstring), ending with ``bf16``."""
    out: list[str] = []
    if chosen == "bf16":
        return out
    here = 1.0 / rate(chosen, target)
    last = errors.get(chosen, 0.0)
    for c in sorted(errors, key=lambda c: _order(c, errors[c], target)):
        if c in ("bf16", chosen) or 1.0 / rate(c, target) < here:
            continue
        if errors[c] < last:
            out.append(c)
            last = errors[c]
    return [*out, "bf16"]


def repair(
    choice: dict[Key, str],
    errors: Mapping[Key, Mapping[str, float]],
    target: str,
    evaluate: Callable[[Mapping[Key, str]], Outcome],
    plan_error: Callable[[Outcome], float],
) -> tuple[dict[Key, str], Outcome, list[Key]]:
    """Step 2 (module docstring): returns the repaired choice, the outcome of its last
    run, and the keys moved, in order."""
    choice = dict(choice)
    moved: list[Key] = []
    outcome = evaluate(choice)
    while plan_error(outcome) > 1.0:
        lowered = [k for k, c in choice.items() if c != "bf16"]
        if not lowered:
            break  # all in the model's own precision: the plan is the reference
        worst = max(lowered, key=lambda k: (errors[k].get(choice[k], 0.0), k))
        choice[worst] = fallbacks(errors[worst], choice[worst], target)[0]
        moved.append(worst)
        outcome = evaluate(choice)
    return choice, outcome, moved


def improve(
    choice: dict[Key, str],
    errors: Mapping[Key, Mapping[str, float]],
    flops: Mapping[Key, float],
    target: str,
    evaluate: Callable[[Mapping[Key, str]], Outcome],
    plan_error: Callable[[Outcome], float],
    outcome: Outcome,
) -> tuple[dict[Key, str], Outcome, list[Key]]:
    """Step 3 (module docstring): returns the improved choice, the outcome of its last
    accepted run, and the keys lowered, in order."""
    choice = dict(choice)
    lowered: list[Key] = []
    refused: set[tuple[Key, str]] = set()
    while plan_error(outcome) <= 1.0:
        best: tuple[float, Key, str] | None = None
        for k, c in choice.items():
            here = rate(c, target)
            up = [x for x in errors[k] if rate(x, target) > here and (k, x) not in refused]
            if not up:
                continue
            step = min(rate(x, target) for x in up)
            x = min((x for x in up if rate(x, target) == step), key=lambda x: errors[k][x])
            saved = flops[k] * (1.0 / here - 1.0 / step)
            score = errors[k][x] / saved if saved > 0 else math.inf
            if best is None or (score, k, x) < best:
                best = (score, k, x)
        if best is None or not math.isfinite(best[0]):
            break
        _, k, x = best
        trial = {**choice, k: x}
        o = evaluate(trial)
        if plan_error(o) <= 1.0:
            choice, outcome = trial, o
            lowered.append(k)
        else:
            refused.add((k, x))
    return choice, outcome, lowered


def layer_config(gemms: Mapping[str, str]) -> Float8Config | None:
    """The float8 config of a layer whose GEMMs get the candidates ``gemms`` (``{gemm:
    candidate}``; a missing GEMM is ``bf16``): ``None`` if all are ``bf16``; else the
    config of the first lowered GEMM's candidate, the ``bf16`` GEMMs in
    ``high_precision_gemms`` and the GEMMs of other candidates in ``gemms``."""
    lowered = [g for g in GEMMS if gemms.get(g, "bf16") != "bf16"]
    if not lowered:
        return None
    first = gemms[lowered[0]]
    base = candidate_config(first)
    assert base is not None
    own = tuple(
        (g, c)
        for g in lowered
        if gemms[g] != first and (c := candidate_config(gemms[g])) is not None
    )
    hp = tuple(g for g in GEMMS if g not in lowered)
    name = describe_layer(gemms)
    if own:
        return base.replace(name=name, high_precision_gemms=hp, gemms=own)
    return base.replace(name=name, high_precision_gemms=hp)


def describe_layer(gemms: Mapping[str, str]) -> str:
    """``nvfp4`` when every GEMM has one candidate, else ``fwd=nvfp4,dgrad=...,wgrad=...``."""
    names = [gemms.get(g, "bf16") for g in GEMMS]
    if len(set(names)) == 1:
        return names[0]
    return ",".join(f"{s}={n}" for s, n in zip(("fwd", "dgrad", "wgrad"), names, strict=True))


def errors_of(
    measured: Mapping[Key, Mapping[str, Measured]], loss_budget: float, grad_budget: float
) -> dict[Key, dict[str, float]]:
    """``e_g(c)`` of every measurement."""
    return {
        k: {c: m.error(loss_budget, grad_budget) for c, m in per.items()}
        for k, per in measured.items()
    }


def layer_choices(choice: Mapping[Key, str], layers: Sequence[str]) -> dict[str, dict[str, str]]:
    """``{fqn: {gemm: candidate}}`` of a per-GEMM choice."""
    return {fqn: {g: choice[(fqn, g)] for g in GEMMS} for fqn in layers}
