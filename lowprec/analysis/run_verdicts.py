"""Each run of a set judged against its reference (the report's leading verdicts).

:func:`references` picks each run's reference among the set: of its kind
(:func:`~lowprec.analysis.verdicts.of_kind`: unit-scaled runs against a unit-scaled
reference only), trained with its settings (:func:`settings_differ`) where one is.
:func:`summary_verdicts` then judges each run's final val loss against it with
:func:`~lowprec.analysis.verdicts.verdict`; :mod:`lowprec.analysis.diagnosis` explains the
verdicts from the run's numerics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from lowprec.analysis.diagnosis import Run
from lowprec.analysis.verdicts import (
    NOT_JUDGED,
    REFERENCE,
    as_reason,
    of_kind,
    own_verdict,
    skipped_tail,
    unit_scaled,
    verdict,
)

__all__ = ["SETTINGS", "compared_vals", "references", "settings_differ", "summary_verdicts"]

# The training settings (config.json's "train") that a val-loss comparison assumes equal.
SETTINGS = ("model", "steps", "batch_size", "seq_len", "width", "depth", "heads", "lr",
            "warmup", "seed", "eval_batches")  # fmt: skip


def references(runs: Sequence[Run]) -> list[Run | None]:
    """Each run's reference among ``runs``: ``None`` for a high-precision run
    (:attr:`Run.is_reference`) and where the set has none of its kind; else, among the
    reference runs of its kind (:func:`reference_of`: unit-scaled for a unit-scaled run,
    plain otherwise), the first trained with the same settings (:func:`settings_differ`),
    or the first of them all when none is (its verdict then names the settings that
    differ)."""
    refs = [r for r in runs if r.is_reference]
    out: list[Run | None] = []
    for run in runs:
        if run.is_reference:
            out.append(None)
            continue
        kind = of_kind(unit_scaled(run.recipe_dict), [(r, _unit_reference(r)) for r in refs])
        same = [r for r in kind if not settings_differ(run, r)]
        out.append((same or kind)[0] if kind else None)
    return out


def _unit_reference(run: Run) -> bool:
    """Whether the reference run ``run`` is a unit-scaled one (``fp32-unit``)."""
    return unit_scaled(run.recipe_dict) or run.recipe == "fp32-unit"


def settings_differ(run: Run, ref: Run) -> list[str]:
    """The training settings (:data:`SETTINGS`, from each run's ``config.json``) in which
    ``run`` differs from ``ref``, as ``"lr 0.01 vs 0.003"``; a setting missing from
    either is not compared. Values that print alike (``"30"`` and ``30``) are quoted."""
    a, b = run.config.get("train", {}), ref.config.get("train", {})
    out = []
    for k in SETTINGS:
        if k in a and k in b and a[k] != b[k]:
            x, y = (repr(a[k]), repr(b[k])) if str(a[k]) == str(b[k]) else (a[k], b[k])
            out.append(f"{k} {x} vs {y}")
    return out


def _val_at(run: Run) -> dict[int, float]:
    """The val losses of ``run`` by step (its metrics records)."""
    out = {}
    for r in run.metrics:
        v = r.get("val_loss")
        if isinstance(v, (int, float)):
            out[int(r["step"])] = float(v)
    return out


def compared_vals(run: Run, ref_run: Run) -> tuple[float, float, int] | str | None:
    """The val losses a verdict compares, ``(run's, reference's, step)``: the run's last
    evaluation and the reference's at the same step (step ``-1``: runs loaded from summaries
    without records, their final values). A reason (``"not judged: ..."``) where the
    reference has no val loss at that step or none finite; ``None`` where the run has no
    val loss."""
    mine = _val_at(run)
    v = run.summary.get("val_loss")
    if not mine and isinstance(v, (int, float)):
        mine = {-1: float(v)}
    if not mine:
        return None
    step = max(mine)
    theirs = _val_at(ref_run) if step >= 0 else {}
    if not theirs:
        r = ref_run.summary.get("val_loss")
        theirs = {step: float(r)} if isinstance(r, (int, float)) else {}
    if step not in theirs:
        last = f"its last at step {max(theirs)}" if theirs else "none recorded"
        return f"not judged: {ref_run.recipe} has no val loss at step {step} ({last})"
    r = theirs[step]
    if math.isfinite(mine[step]) and not (math.isfinite(r) and r > 0):
        return f"not judged: its reference {ref_run.recipe} has no finite val loss"
    return mine[step], r, step


def summary_verdicts(
    runs: Sequence[Run], tolerance: Mapping[str, float] | None = None
) -> list[tuple[str, str]]:
    """``(run name, verdict)`` for each run.

    Every run is first judged by itself: one that diverged (NaN/Inf) fails, one whose
    loss curve rose or did not fall fails, and one too short to show a curve is not
    judged (:func:`~lowprec.analysis.verdicts.own_verdict`); a reference run in high
    precision (:attr:`Run.is_reference`) that passes is a ``"reference"``. Every other run's
    val loss is judged against its reference in ``runs`` (:func:`references`: of its kind,
    unit-scaled runs against a unit-scaled reference only, trained with its settings where
    one is) with :func:`verdict` and ``tolerance`` (relative gap per reference recipe name;
    none: the spread is not measured), at the same step: the run's last evaluation, with
    the reference's val loss at that step (an interrupted run is compared where it
    stopped, and says so). Without a reference the verdict says so and judges nothing: a
    low-precision run is never the reference. A run is not judged, and the verdict says
    why, where it was trained with other settings than its reference
    (:func:`settings_differ`), either has no val loss recorded, its reference fails or was
    not judged itself, or the reference has no finite val loss at the run's step."""
    own: dict[int, str] = {}
    for i, run in enumerate(runs):
        text = own_verdict(run.summary)
        if text is not None:
            own[i] = text
    index = {id(r): i for i, r in enumerate(runs)}
    out = []
    for i, (run, ref_run) in enumerate(zip(runs, references(runs), strict=True)):
        s = run.summary
        skipped = int(s.get("skipped_steps") or 0)
        if i in own:
            out.append((run.name, own[i]))
            continue
        if run.is_reference:
            out.append((run.name, REFERENCE + skipped_tail(skipped)))
            continue
        ref = None if ref_run is None else ref_run.recipe
        if ref_run is not None:
            ref_own = own.get(index[id(ref_run)])
            if ref_own is not None:
                out.append((run.name, f"not judged: its reference {ref} {as_reason(ref_own)}"))
                continue
            differ = settings_differ(run, ref_run)
            if differ:
                out.append((run.name, f"{NOT_JUDGED} than {ref} ({'; '.join(differ)})"))
                continue
            missing = [x.name for x in (run, ref_run) if x.summary.get("evaluated") is False]
            if missing:  # never evaluated (a RunRecorder run without val losses)
                out.append((run.name, f"not judged: no val loss recorded ({', '.join(missing)})"))
                continue
        gap, where = None, ""
        if ref_run is not None:
            pair = compared_vals(run, ref_run)
            if isinstance(pair, str):
                out.append((run.name, pair))
                continue
            if pair is not None:
                v, r, step = pair
                gap = v / r - 1.0 if math.isfinite(v) else None
                if run.stopped_early and step >= 0:
                    where = f" (at step {step}, where it stopped)"
        text = verdict(
            gap,
            ref,
            (tolerance or {}).get(ref or ""),
            underflow=float(s.get("act_grad_underflow") or 0.0),
            skipped=skipped,
        )
        out.append((run.name, text + where))
    return out
