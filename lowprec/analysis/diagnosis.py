"""Plain-language diagnosis of a training run's numerics.

A :class:`Run` is what a run directory holds (``config.json``, the metrics records, their
summary and the :mod:`lowprec.analysis.tracking` records); :func:`diagnose` turns it into
findings, most important first. The thresholds: a gradient with :data:`UNDERFLOW_ALERT`
of its values below a format's smallest normal underflows; a tensor with
:data:`OVERFLOW_ALERT` of its values above a format's max overflows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowprec.analysis.tracking import BACKWARD_KINDS, KINDS
from lowprec.core.formats import get_format

__all__ = [
    "FAIL_GAP",
    "KIND_TEXT",
    "OVERFLOW_ALERT",
    "UNDERFLOW_ALERT",
    "Run",
    "diagnose",
    "gap_spread",
    "judged_formats",
    "reference_of",
    "summary_verdicts",
    "techniques",
    "verdict",
    "worst",
    "worst_overflow",
]

KIND_TEXT = {
    "input": "inputs",
    "output": "activations",
    "weight": "weights",
    "grad_output": "activation gradients",
    "weight_grad": "weight gradients",
}
UNDERFLOW_ALERT = 0.25  # share of a tensor below a format's smallest normal
OVERFLOW_ALERT = 1e-4  # share above a format's max


@dataclass
class Run:
    """A loaded run directory."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    numerics: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""  # the name shown; write_report makes it unique among the runs

    @property
    def name(self) -> str:
        return self.label or self.path.name

    @property
    def planned_steps(self) -> int | None:
        steps = self.config.get("train", {}).get("steps")
        return int(steps) if isinstance(steps, int) else None

    @property
    def stopped_early(self) -> bool:
        planned = self.planned_steps
        return planned is not None and int(self.summary.get("steps", 0)) < planned

    @property
    def recipe(self) -> str:
        return str(self.config.get("train", {}).get("recipe", "?"))

    @property
    def formats(self) -> list[str]:
        first = self.numerics[0] if self.numerics else {}
        return list(first.get("below_normal", {}))

    @property
    def float8(self) -> str | None:
        """The float8 preset of the run's recipe, if any."""
        rec = self.config.get("recipe", {})
        if rec.get("float8") is not None:  # the flat recipe dict of lowprec 0.1
            return str(rec["float8"])
        for t in rec.get("technique") or ():  # [{"technique": kind, "config": {...}}, ...]
            if isinstance(t, dict) and t.get("technique") == "float8":
                return str(t.get("config", {}).get("name") or "float8")
        return None

    @property
    def tracked_steps(self) -> list[int]:
        return sorted({int(r["step"]) for r in self.numerics})

    @property
    def compute_format(self) -> str:
        """The format the run's activations and gradients are stored in."""
        rec = self.config.get("recipe", {})
        return str(rec.get("autocast") or rec.get("param_dtype") or "fp32")


def worst(
    run: Run,
    step: int,
    measure: str,
    kinds: Sequence[str] | None = None,
    formats: Sequence[str] | None = None,
) -> list[tuple[float, str, dict[str, Any]]]:
    """(share, format, record) of ``measure`` at ``step``, largest first."""
    out = []
    for r in run.numerics:
        if r["step"] != step or (kinds is not None and r["kind"] not in kinds):
            continue
        for fmt, share in r[measure].items():
            if formats is None or fmt in formats:
                out.append((float(share), fmt, r))
    return sorted(out, key=lambda t: -t[0])


def judged_formats(run: Run, backward: bool) -> list[str]:
    """The formats a run's tensors are judged against: its own storage format and the FP8
    format of that pass (E5M2 for gradients, E4M3 for activations and weights)."""
    want: tuple[str, ...] = (run.compute_format, "e5m2" if backward else "e4m3fn")
    if run.float8 is not None:  # its FP8 operands are scaled first: unscaled shares mislead
        want = (run.compute_format,)
    return [f for f in dict.fromkeys(want) if f in run.formats]


def worst_overflow(run: Run, step: int) -> list[tuple[float, str, dict[str, Any]]]:
    """Overflow shares at ``step``: forward tensors in their formats, gradients in theirs."""
    fwd = [k for k in KINDS if k not in BACKWARD_KINDS]
    out = worst(run, step, "above_max", fwd, judged_formats(run, backward=False))
    out += worst(run, step, "above_max", BACKWARD_KINDS, judged_formats(run, backward=True))
    return sorted(out, key=lambda t: -t[0])


def diagnose(run: Run) -> list[str]:
    """Plain-language findings about ``run``, most important first.

    Gradients are judged against the run's own storage format and E5M2 (the FP8 gradient
    format), forward tensors against the own format and E4M3; one finding per format
    names the worst tensor and counts the others past the threshold
    (:data:`UNDERFLOW_ALERT` of the values below the smallest normal, or
    :data:`OVERFLOW_ALERT` above the max). "Would" marks a format the run does not use.
    """
    notes: list[str] = []
    s = run.summary
    if s.get("diverged_at") is not None:
        notes.append(
            f"The loss became NaN/Inf at step {s['diverged_at']}: the run diverged. Look for "
            "overflow below, lower the learning rate, or use loss scaling with skipped steps."
        )
    if run.stopped_early:
        notes.append(
            f"The run stopped at step {s.get('steps')} of {run.planned_steps} (interrupted?): "
            "its numbers are not final; `lowprec train --resume` continues it exactly."
        )
    if s.get("skipped_steps"):
        notes.append(
            f"The loss scaler skipped {s['skipped_steps']} step(s) with Inf/NaN gradients "
            "(expected while a dynamic loss scale finds its level)."
        )
    if not run.numerics:
        notes.append("No numerics were recorded for this run (no numerics.jsonl).")
        return notes
    last, own = run.tracked_steps[-1], run.compute_format
    found = False
    if run.float8 is not None:
        notes.append(
            f"Float8 recipe {run.float8!r}: each linear layer scales its GEMM operands before "
            "the cast to E4M3/E5M2, so its tensors are judged in the run's own format "
            f"({own}) only."
        )
    for fmt in judged_formats(run, backward=True):
        bad = [
            t
            for t in worst(run, last, "below_normal", BACKWARD_KINDS, [fmt])
            if t[0] >= UNDERFLOW_ALERT
        ]
        if not bad:
            continue
        found = True
        share, _, r = bad[0]
        n_grads = len(
            {
                (x["name"], x["kind"])
                for x in run.numerics
                if x["step"] == last and x["kind"] in BACKWARD_KINDS
            }
        )
        more = (
            f" ({len(bad) - 1} more of the {n_grads} gradient tensors too)" if len(bad) > 1 else ""
        )
        verb = "underflow in" if fmt == own else "would underflow if cast unscaled to"
        fix = (
            "use loss scaling or unit scaling"
            if fmt == own
            else "scale them (loss scaling, unit scaling or per-tensor float8 scales)"
        )
        notes.append(
            f"{100 * share:.0f}% of the {KIND_TEXT[r['kind']]} of {r['name']} {verb} {fmt} "
            f"(below its smallest normal, {get_format(fmt).min_normal:.3g}) at step {last}"
            f"{more}: {fix}."
        )
    for fmt in dict.fromkeys(
        judged_formats(run, backward=False) + judged_formats(run, backward=True)
    ):
        bad = [t for t in worst_overflow(run, last) if t[1] == fmt and t[0] >= OVERFLOW_ALERT]
        if not bad:
            continue
        found = True
        share, _, r = bad[0]
        verb = "overflow" if fmt == own else "would overflow"
        notes.append(
            f"{100 * share:.2g}% of the {KIND_TEXT[r['kind']]} of {r['name']} {verb} {fmt} "
            f"(above {get_format(fmt).max:g}) at step {last}: scale them (per-tensor or "
            "delayed scaling) or keep them in a wider format."
        )
    if not found:
        checked = ", ".join(dict.fromkeys(judged_formats(run, False) + judged_formats(run, True)))
        notes.append(
            f"Healthy at step {last}: no gradient has {100 * UNDERFLOW_ALERT:.0f}% of its values "
            f"below the smallest normal, and nothing overflows ({checked})."
        )
    return notes


# ---- verdicts: one line per run, judged against the seed-to-seed spread ------------------

FAIL_GAP = 0.05  # a val-loss gap above this (and above the spread) is a failure


def techniques(run: Run) -> list[str]:
    """The technique kinds of the run's recipe (``"unit"``, ``"float8"``, ``"scalify"``)."""
    rec = run.config.get("recipe", {})
    kinds = [str(t.get("technique")) for t in rec.get("technique") or () if isinstance(t, dict)]
    return kinds + [k for k in ("float8", "unit_fp8", "scalify_format") if rec.get(k)]


def reference_of(recipe: str, unit_scaled: bool, available: Sequence[str]) -> str | None:
    """The run a recipe's val loss is compared with: ``fp32-unit`` for a unit-scaled recipe
    (the same model and u-μP learning rates in FP32) where it ran, else ``fp32``; ``None``
    for the reference itself or when the reference did not run."""
    ref = "fp32-unit" if unit_scaled and "fp32-unit" in available else "fp32"
    if recipe == ref or ref not in available:
        return None
    return ref


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
) -> str:
    """One line judging a run by its val-loss ``gap`` (``val / val_ref - 1``) to
    ``reference``, against ``tolerance`` (the relative gap that seed-to-seed noise can
    explain; ``None``: not measured for this configuration):

    * a run that diverged or has no finite val loss fails;
    * ``gap > max(tolerance, FAIL_GAP)`` fails; a gap above the tolerance only is worse;
    * ``|gap| <= tolerance`` matches; with ``underflow`` (the share of activation gradients
      below their format's smallest normal) of :data:`UNDERFLOW_ALERT` or more it says so;
    * a gap below ``-tolerance`` is better.

    Skipped steps are appended.

    Example:
        >>> verdict(0.30, "fp32", 0.004)
        'fails: +30.0% val loss vs fp32'
        >>> verdict(0.002, "fp32", 0.004, underflow=0.94)
        'activation gradients underflow (94%) but val loss within seed spread of fp32 (±0.4%)'
        >>> verdict(-0.0004, "fp32", 0.0035, skipped=2)
        'matches fp32 (within seed spread ±0.35%); 2 steps skipped'
    """
    if diverged_at is not None:
        return f"fails: loss NaN/Inf at step {diverged_at}"
    tail = f"; {skipped} step{'s' if skipped > 1 else ''} skipped" if skipped else ""
    if reference is None:
        return f"reference{tail}"
    if gap is None or not math.isfinite(gap):
        return f"fails: no finite val loss{tail}"
    pct = f"{100 * gap:+.1f}%"
    tol = f"±{100 * tolerance:.2g}%" if tolerance is not None else "not measured"
    if gap > max(tolerance or 0.0, FAIL_GAP):
        return f"fails: {pct} val loss vs {reference}{tail}"
    if tolerance is None:
        return f"{pct} vs {reference} (seed spread {tol}){tail}"
    if gap > tolerance:
        return f"worse: {pct} vs {reference}, beyond seed spread ({tol}){tail}"
    if gap < -tolerance:
        return f"better: {pct} vs {reference}, beyond seed spread ({tol}){tail}"
    if underflow >= UNDERFLOW_ALERT:
        return (
            f"activation gradients underflow ({100 * underflow:.0f}%) but val loss within "
            f"seed spread of {reference} ({tol}){tail}"
        )
    return f"matches {reference} (within seed spread {tol}){tail}"


def summary_verdicts(
    runs: Sequence[Run], tolerance: Mapping[str, float] | None = None
) -> list[tuple[str, str]]:
    """``(run name, verdict)`` for each run: its final val loss against its reference
    among ``runs`` (by recipe name, :func:`reference_of`), judged with :func:`verdict` and
    ``tolerance`` (relative gap per reference name; none: the spread is not measured)."""
    val: dict[str, float] = {}
    for run in runs:
        v = run.summary.get("val_loss")
        val.setdefault(run.recipe, float(v) if isinstance(v, (int, float)) else math.nan)
    out = []
    for run in runs:
        s = run.summary
        ref = reference_of(run.recipe, "unit" in techniques(run), list(val))
        r, v = val.get(ref or run.recipe, math.nan), val[run.recipe]
        gap = v / r - 1.0 if math.isfinite(v) and math.isfinite(r) and r > 0 else None
        text = verdict(
            gap,
            ref,
            (tolerance or {}).get(ref or ""),
            underflow=float(s.get("act_grad_underflow") or 0.0),
            skipped=int(s.get("skipped_steps") or 0),
            diverged_at=s.get("diverged_at"),
        )
        out.append((run.name, text))
    return out
