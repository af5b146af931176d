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
from lowprec.analysis.verdicts import NOT_JUDGED, REFERENCE, of_kind, unit_scaled, verdict

__all__ = ["SETTINGS", "references", "settings_differ", "summary_verdicts"]

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
    either is not compared."""
    a, b = run.config.get("train", {}), ref.config.get("train", {})
    return [f"{k} {a[k]} vs {b[k]}" for k in SETTINGS if k in a and k in b and a[k] != b[k]]


def summary_verdicts(
    runs: Sequence[Run], tolerance: Mapping[str, float] | None = None
) -> list[tuple[str, str]]:
    """``(run name, verdict)`` for each run: a run in high precision
    (:attr:`Run.is_reference`) is a ``"reference"``; every other run's final val loss is
    judged against its reference in ``runs`` (:func:`references`: of its kind, unit-scaled
    runs against a unit-scaled reference only, trained with its settings where one is) with
    :func:`verdict` and ``tolerance`` (relative gap per reference recipe name; none: the
    spread is not measured). Without a reference the verdict says so and judges nothing:
    a low-precision run is never the reference. A run trained with other settings than its
    reference (:func:`settings_differ`), where either has no val loss recorded (never
    evaluated), or whose reference has no finite val loss (it diverged), is not judged,
    and the verdict says why, unless the run itself diverged (a failure whatever the
    settings)."""

    def val(run: Run) -> float:
        v = run.summary.get("val_loss")
        return float(v) if isinstance(v, (int, float)) else math.nan

    out = []
    for run, ref_run in zip(runs, references(runs), strict=True):
        s = run.summary
        skipped = int(s.get("skipped_steps") or 0)
        if run.is_reference:
            tail = f"; {skipped} step{'s' if skipped > 1 else ''} skipped" if skipped else ""
            diverged = s.get("diverged_at")
            text = (  # a diverged reference fails as any run does
                verdict(None, None, None, diverged_at=diverged, cause=s.get("diverged_cause"))
                if diverged is not None
                else REFERENCE + tail
            )
            out.append((run.name, text))
            continue
        ref = None if ref_run is None else ref_run.recipe
        differ = [] if ref_run is None else settings_differ(run, ref_run)
        if s.get("diverged_at") is None and ref_run is not None:
            if differ:
                out.append((run.name, f"{NOT_JUDGED} than {ref} ({'; '.join(differ)})"))
                continue
            missing = [x.name for x in (run, ref_run) if x.summary.get("evaluated") is False]
            if missing:  # never evaluated (a RunRecorder run without val losses)
                out.append((run.name, f"not judged: no val loss recorded ({', '.join(missing)})"))
                continue
        v, r = val(run), math.nan if ref_run is None else val(ref_run)
        if ref_run is not None and math.isfinite(v) and not (math.isfinite(r) and r > 0):
            out.append((run.name, f"not judged: its reference {ref} has no finite val loss"))
            continue
        gap = v / r - 1.0 if math.isfinite(v) and math.isfinite(r) and r > 0 else None
        text = verdict(
            gap,
            ref,
            (tolerance or {}).get(ref or ""),
            underflow=float(s.get("act_grad_underflow") or 0.0),
            skipped=skipped,
            diverged_at=s.get("diverged_at"),
            cause=s.get("diverged_cause"),
        )
        out.append((run.name, text))
    return out
