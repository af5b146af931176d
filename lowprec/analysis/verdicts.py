"""Verdicts: one line judging a run's val loss against its reference, and which run that is.

The reference of a run is a run of the same set in high precision: ``fp32``, or
``fp32-unit`` (the same unit-scaled model and u-μP learning rates in FP32) for a
unit-scaled recipe. A recipe is a reference by what it is, not by its name
(:func:`is_reference_recipe`): FP32 parameters and compute, no autocast, no float8 or
scalify technique, no FP8 casts of unit scaling. A low-precision recipe is never the
reference: a set without one gets the verdict "no reference", and its val losses are
reported, not judged.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

__all__ = [
    "FAIL_GAP",
    "NOT_JUDGED",
    "NO_REFERENCE",
    "REFERENCE",
    "as_reason",
    "curve_verdict",
    "failing",
    "gap_spread",
    "is_reference_recipe",
    "of_kind",
    "own_verdict",
    "percent",
    "reference_of",
    "skipped_tail",
    "unit_scaled",
    "val_verdict",
    "verdict",
]


def percent(share: float) -> str:
    """``share`` (a fraction, 0.9993) as a percentage for a sentence or a table cell:
    three significant digits and never an exponent (``"99.9%"``, ``"100%"``,
    ``"0.123%"``), ``"<0.001%"`` for a share below 1e-5 but not 0, ``"NaN%"`` if not finite."""
    v = 100 * float(share)
    if not math.isfinite(v):
        return "NaN%"
    if 0 < v < 0.001:
        return "<0.001%"
    if abs(v) >= 100:
        return f"{v:.0f}%"
    return f"{float(f'{v:.3g}'):g}%"


FAIL_GAP = 0.05  # a val-loss gap above this (and above the spread) is a failure
REFERENCE = "reference"
NO_REFERENCE = (
    "no reference: this set has no fp32 run of its kind to compare with; val loss not judged"
)
NOT_JUDGED = "not judged: trained with other settings"  # + " than <reference> (<settings>)"
_REFERENCE_NAMES = ("fp32", "fp32-unit")
# The loss curve (curve_verdict): fewer finite losses are too few to judge; from
# STALL_STEPS on, a loss that fell less than STALL is not learning; a final loss above the
# first by RISE, or above the best stretch of the curve by REBOUND, is diverging.
MIN_STEPS = 4
STALL_STEPS = 20
STALL = 0.01
RISE = 0.05
REBOUND = 0.25
_T = TypeVar("_T")


def _techniques(recipe: Mapping[str, Any]) -> list[dict[str, Any]]:
    tech = recipe.get("technique")
    return [t for t in tech if isinstance(t, dict)] if isinstance(tech, list) else []


def unit_scaled(recipe: Mapping[str, Any]) -> bool:
    """Whether a recipe (``Recipe.to_dict()``, or the flat dict of lowprec 0.1) unit-scales
    the model."""
    if recipe.get("technique") == "unit":  # flat
        return True
    return any(t.get("technique") == "unit" for t in _techniques(recipe))


def is_reference_recipe(recipe: Mapping[str, Any], name: str = "") -> bool:
    """Whether a recipe (``Recipe.to_dict()`` or the flat dict of lowprec 0.1) trains in
    high precision: FP32 parameters, no autocast, no loss scaling, FP32 optimizer states
    (``optimizer_state`` ``"auto"`` or ``"fp32"``), no stochastic rounding, no float8 or
    scalify technique and no FP8 casts of unit scaling. An empty dict (a run recorded
    with a recipe name only) is a reference only by the preset names ``fp32`` and
    ``fp32-unit``.

    Example:
        >>> is_reference_recipe({"param_dtype": "fp32", "technique": []})
        True
        >>> is_reference_recipe({"param_dtype": "fp32", "optimizer_state": "8bit"})
        False
    """
    if not recipe:
        return name in _REFERENCE_NAMES
    if recipe.get("param_dtype", "fp32") != "fp32" or recipe.get("autocast") is not None:
        return False
    if recipe.get("loss_scaling", "none") not in ("none", None):
        return False
    if recipe.get("optimizer_state", "auto") not in ("auto", "fp32", None):
        return False
    if recipe.get("stochastic_rounding"):
        return False
    flat = recipe.get("technique")
    if isinstance(flat, str):  # lowprec 0.1
        return flat in ("mixed-precision", "unit") and not recipe.get("unit_fp8")
    for t in _techniques(recipe):
        kind, cfg = t.get("technique"), t.get("config") or {}
        if kind != "unit" or cfg.get("float8"):
            return False
    return True


def of_kind(unit: bool, references: Sequence[tuple[_T, bool]]) -> list[_T]:
    """The references that may judge a run, in order: of ``references`` (``(reference,
    unit_scaled)`` pairs), those of the run's kind, unit-scaled for a unit-scaled run
    (``unit``) and plain for the others (:func:`reference_of` gives the reason).

    Example:
        >>> of_kind(True, [("fp32", False), ("fp32-unit", True), ("fp32-unit-2", True)])
        ['fp32-unit', 'fp32-unit-2']
    """
    return [ref for ref, u in references if u == unit]


def reference_of(unit: bool, references: Sequence[tuple[str, bool]]) -> str | None:
    """The name of the reference of a non-reference run among the set's ``references``
    (``(name, unit_scaled)`` of each run that :func:`is_reference_recipe`, in order): the
    first one of its own kind, unit-scaled for a unit-scaled run (``fp32-unit``) and plain
    for the others (``fp32``); ``None`` when the set has none of that kind (the verdict
    is then :data:`NO_REFERENCE`). A unit-scaled run is never judged against plain FP32:
    unit scaling trains another model (at the demo's 80 steps ``fp32-unit`` ends 3.7% below
    ``fp32``), so such a gap would mix the two and could call a failing run healthy.

    Example:
        >>> refs = [("fp32", False), ("fp32-unit", True)]
        >>> reference_of(True, refs), reference_of(False, refs), reference_of(True, refs[:1])
        ('fp32-unit', 'fp32', None)
    """
    return next(iter(of_kind(unit, references)), None)


def gap_spread(val_losses: Mapping[str, Sequence[float]], reference: str) -> float | None:
    """The seed-to-seed spread of a val-loss gap to ``reference``: for each other recipe,
    the sample standard deviation over seeds of ``val / val_ref - 1`` (paired: same seed),
    and the median of these over the recipes (robust to one erratic recipe). ``val_losses``
    maps each recipe to its val loss at seeds ``0..n-1`` (the same seeds for all); ``None``
    if fewer than 2 seeds or no other recipe has finite losses at every seed."""
    ref = val_losses.get(reference)
    if ref is None or len(ref) < 2 or not all(math.isfinite(v) and v > 0 for v in ref):
        return None
    sds = []
    for name, vals in val_losses.items():
        if name == reference or len(vals) != len(ref) or not all(map(math.isfinite, vals)):
            continue
        sds.append(statistics.stdev(v / r - 1.0 for v, r in zip(vals, ref, strict=True)))
    return statistics.median(sds) if sds else None


def verdict(
    gap: float | None,
    reference: str | None,
    tolerance: float | None,
    *,
    underflow: float = 0.0,
    skipped: int = 0,
    diverged_at: int | None = None,
    cause: str | None = None,
) -> str:
    """One line judging a run by its val-loss ``gap`` (``val / val_ref - 1``) to
    ``reference``, against ``tolerance`` (the relative gap that seed-to-seed noise can
    explain; ``None``: not measured for this configuration):

    * a run that diverged (``diverged_at``; ``cause``: what became NaN/Inf, the loss by
      default) or has no finite val loss fails;
    * without a reference (``None``): :data:`NO_REFERENCE`, never a pass;
    * ``gap > max(tolerance, FAIL_GAP)`` fails; a gap above the tolerance only is worse;
    * ``|gap| <= tolerance`` matches; with ``underflow`` (the share of activation gradients
      below their format's smallest normal) of 25% or more it says so;
    * a gap below ``-tolerance`` is better.

    Skipped steps are appended. A reference run's own verdict is :data:`REFERENCE`.

    Example:
        >>> verdict(0.30, "fp32", 0.004)
        'fails: +30.0% val loss vs fp32'
        >>> verdict(0.002, "fp32", 0.004, underflow=0.94)
        'activation gradients underflow (94%) but val loss within seed spread of fp32 (±0.4%)'
        >>> verdict(-0.0004, "fp32", 0.0035, skipped=2)
        'matches fp32 (within seed spread ±0.35%); 2 steps skipped'
        >>> verdict(0.0, None, 0.004).startswith("no reference")
        True
    """
    if diverged_at is not None:
        return f"fails: {cause or 'loss'} NaN/Inf at step {diverged_at}"
    tail = skipped_tail(skipped)
    if reference is None:
        return f"{NO_REFERENCE}{tail}"
    if gap is None or not math.isfinite(gap):
        return f"fails: no finite val loss{tail}"
    pct = f"{100 * gap:+.1f}%"
    tol = f"±{percent(tolerance)}" if tolerance is not None else "not measured"
    if gap > max(tolerance or 0.0, FAIL_GAP):
        return f"fails: {pct} val loss vs {reference}{tail}"
    if tolerance is None:
        return f"{pct} vs {reference} (seed spread {tol}){tail}"
    if gap > tolerance:
        return f"worse: {pct} vs {reference}, beyond seed spread ({tol}){tail}"
    if gap < -tolerance:
        return f"better: {pct} vs {reference}, beyond seed spread ({tol}){tail}"
    if underflow >= 0.25:
        return (
            f"activation gradients underflow ({100 * underflow:.0f}%) but val loss within "
            f"seed spread of {reference} ({tol}){tail}"
        )
    return f"matches {reference} (within seed spread {tol}){tail}"


def curve_verdict(summary: Mapping[str, Any]) -> str | None:
    """A verdict from a run's own train-loss curve (``summary``: the ``curve_steps``,
    ``start_loss``, ``end_loss`` and ``best_loss`` of
    :func:`lowprec.jobs.run_summary.loss_curve`), or ``None`` when the curve is a training
    one. Whatever its val loss and its reference's, a run fails where:

    * ``end > start·(1 + RISE)`` or ``end > best·(1 + REBOUND)`` (diverging: the loss
      rose above where it began, or well above the best stretch it reached);
    * from ``STALL_STEPS`` steps on, ``end > start·(1 - STALL)`` (not learning: the loss
      fell by less than 1%).

    With fewer than ``MIN_STEPS`` finite losses the run is too short to judge. A summary
    without these keys (an older run) is not judged by its curve (``None``).

    Example:
        >>> curve_verdict({"curve_steps": 40, "start_loss": 4.18, "end_loss": 233.6,
        ...                "best_loss": 3.1})
        'fails: loss rose from 4.18 at the start to 234 at the end (best 3.1): diverging'
        >>> curve_verdict({"curve_steps": 40, "start_loss": 4.18, "end_loss": 4.19,
        ...                "best_loss": 4.17})
        'fails: loss 4.18 at the start, 4.19 at the end (40 steps): not learning'
        >>> curve_verdict({"curve_steps": 2, "start_loss": 4.2, "end_loss": 4.1,
        ...                "best_loss": 4.1})
        'not judged: too short (2 steps; the loss curve needs 4)'
    """
    if "curve_steps" not in summary:
        return None
    n = int(summary["curve_steps"])
    if n < MIN_STEPS:
        steps = f"{n} step{'' if n == 1 else 's'}"
        return f"not judged: too short ({steps}; the loss curve needs {MIN_STEPS})"
    start, end, best = (float(summary[k]) for k in ("start_loss", "end_loss", "best_loss"))
    if end > start * (1 + RISE) or end > best * (1 + REBOUND):
        return (
            f"fails: loss rose from {start:.3g} at the start to {end:.3g} at the end "
            f"(best {best:.3g}): diverging"
        )
    if n >= STALL_STEPS and end > start * (1 - STALL):
        return (
            f"fails: loss {start:.3g} at the start, {end:.3g} at the end ({n} steps): not learning"
        )
    return None


def skipped_tail(n: int) -> str:
    """What a verdict appends for ``n`` skipped steps (nothing for none).

    Example:
        >>> skipped_tail(2), skipped_tail(0)
        ('; 2 steps skipped', '')
    """
    return f"; {n} step{'s' if n > 1 else ''} skipped" if n else ""


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def val_verdict(summary: Mapping[str, Any]) -> str | None:
    """A verdict from a run's own evaluations (``summary``: ``val_loss``, the last, and
    where :func:`lowprec.jobs.run_summary.summary_of` recorded them ``best_val_loss``,
    ``best_val_step`` and ``nonfinite_val_step``), or ``None``. A run fails where an
    evaluation gave a NaN/Inf val loss (at any step: the model was NaN/Inf there), or its
    last val loss is above its best by :data:`REBOUND` (diverging: the last updates
    undid the training, or overfitting; a reference's gap to it would judge every other
    run against a broken model).

    Example:
        >>> val_verdict({"val_loss": 9.0, "best_val_loss": 3.0, "best_val_step": 20})
        'fails: val loss rose from 3 at step 20 to 9 at the end (diverging or overfitting)'
        >>> val_verdict({"val_loss": 3.1, "best_val_loss": 3.0, "best_val_step": 20}) is None
        True
    """
    bad = summary.get("nonfinite_val_step")
    if bad is not None:
        return f"fails: val loss NaN/Inf at step {bad}"
    v, best = _number(summary.get("val_loss")), _number(summary.get("best_val_loss"))
    if v is None or best is None or not (math.isfinite(v) and math.isfinite(best)):
        return None
    if v > best * (1 + REBOUND) and v - best > 1e-12:
        at = summary.get("best_val_step")
        where = f" at step {at}" if at is not None else ""
        return (
            f"fails: val loss rose from {best:.3g}{where} to {v:.3g} at the end (diverging "
            "or overfitting)"
        )
    return None


def own_verdict(summary: Mapping[str, Any]) -> str | None:
    """A run judged by itself, before any comparison, from its summary
    (:func:`lowprec.jobs.run_summary.summary_of`): a run that diverged fails
    (:func:`verdict`); else one that logged a NaN/Inf train loss on a step it did not mark
    skipped, whose loss curve fails or is too short (:func:`curve_verdict`), whose
    evaluations fail (:func:`val_verdict`), or that evaluated to a NaN/Inf val loss, gets
    that verdict with its skipped steps appended; ``None`` for a run its reference may
    judge. A reference run is judged so too: one that fails judges no other run.

    Example:
        >>> own_verdict({"diverged_at": 3, "diverged_cause": "loss"})
        'fails: loss NaN/Inf at step 3'
        >>> own_verdict({"val_loss": float("nan"), "skipped_steps": 1})
        'fails: no finite val loss; 1 step skipped'
        >>> own_verdict({"nonfinite_loss_steps": 10, "first_nonfinite_loss_step": 11})
        'fails: loss NaN/Inf at 10 steps not skipped (the first at step 11)'
    """
    if summary.get("diverged_at") is not None:
        at, cause = summary["diverged_at"], summary.get("diverged_cause")
        return verdict(None, None, None, diverged_at=at, cause=cause)
    text = None
    n_bad = int(summary.get("nonfinite_loss_steps") or 0)
    if n_bad:
        first = summary.get("first_nonfinite_loss_step")
        steps = f"{n_bad} step{'' if n_bad == 1 else 's'}"
        text = f"fails: loss NaN/Inf at {steps} not skipped (the first at step {first})"
    text = text or curve_verdict(summary)
    v = summary.get("val_loss")
    evaluated = summary.get("evaluated") is not False
    if text is None and evaluated and isinstance(v, (int, float)) and not math.isfinite(v):
        text = "fails: no finite val loss"
    if text is None and evaluated:
        text = val_verdict(summary)
    return None if text is None else text + skipped_tail(int(summary.get("skipped_steps") or 0))


def as_reason(text: str) -> str:
    """A verdict as the reason another run is not judged: ``"fails: x"`` → ``"fails
    (x)"``.

    Example:
        >>> as_reason("fails: loss NaN/Inf at step 3")
        'fails (loss NaN/Inf at step 3)'
    """
    head, _, rest = text.partition(": ")
    return f"{head} ({rest})" if rest else head


def failing(text: str) -> bool:
    """Whether a :func:`verdict` is a failure or worse than its reference."""
    return text.startswith(("fails", "worse"))
