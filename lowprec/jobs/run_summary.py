"""A run's final numbers from its metrics records: :func:`summary_of` (what
``summary.json`` holds and the tables show), the running form the progress bar shows
(:class:`RunningSummary`), where a run diverged (:func:`diverged_at`), and the table cells
(:func:`summary_cells`). Reading the records from a run directory is
:func:`lowprec.jobs.rundir.summarize`."""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable
from typing import Any

__all__ = [
    "TAIL",
    "RunningSummary",
    "diverged_at",
    "diverged_cause",
    "loss_curve",
    "share_cell",
    "summary_cells",
    "summary_of",
]


def diverged_at(recs: list[dict[str, Any]]) -> int | None:
    """The step at which a run diverged, or ``None``: where the run ended on a NaN/Inf
    loss (the last record's, or that of a record marked ``"stopped": "nonfinite"``), the
    first step of that final run of non-finite losses (a loss-scaled run that skipped 25
    NaN-loss steps in a row diverged at the first of them, not where it stopped); else the
    step of the stop marker (the gradients or weights became NaN/Inf there, the loss
    finite). A loss-scaled run whose scaler skipped a bad step and recovered did not
    diverge."""
    end = next((i for i, r in enumerate(recs) if r.get("stopped") == "nonfinite"), None)
    if end is None:
        if not recs or math.isfinite(recs[-1]["loss"]):
            return None
        end = len(recs) - 1
    i = end
    while i > 0 and not math.isfinite(recs[i]["loss"]) and not math.isfinite(recs[i - 1]["loss"]):
        i -= 1
    step: int = recs[i]["step"]
    return step


def diverged_cause(recs: list[dict[str, Any]]) -> str | None:
    """What became NaN/Inf where the run diverged (:func:`diverged_at`): the stopping
    record's ``"stop_cause"`` (``"loss"``, ``"gradients"``, ``"loss and gradients"`` or
    ``"weights"``; ``"loss"`` for records written before it was kept, and for a run that
    ended with a NaN/Inf loss); ``None`` when the run did not diverge."""
    if diverged_at(recs) is None:
        return None
    cause = next((r.get("stop_cause") for r in recs if r.get("stopped") == "nonfinite"), None)
    return str(cause) if cause else "loss"


TAIL = 10  # the train loss of a run is the mean of its last TAIL steps' losses


class RunningSummary:
    """The train loss and step time of a run as :func:`summary_of` measures them, kept up
    to date step by step (the progress bar shows these, so that it ends on the numbers of
    the final table): ``train_loss`` the mean loss of the last :data:`TAIL` steps,
    ``step_time_ms`` the median step time, in milliseconds, of every step added (NaN
    before the first)."""

    def __init__(self, records: Iterable[dict[str, Any]] = ()) -> None:
        self._losses: list[float] = []
        self._times: list[float] = []  # sorted
        for r in records:
            self.add(r["loss"], r["step_time"])

    def add(self, loss: float, step_time: float) -> None:
        """Count one step: its train loss and its time in seconds."""
        self._losses = [*self._losses[1 - TAIL :], float(loss)]
        bisect.insort(self._times, float(step_time))

    @property
    def train_loss(self) -> float:
        return statistics.fmean(self._losses) if self._losses else math.nan

    @property
    def step_time_ms(self) -> float:
        return 1e3 * statistics.median(self._times) if self._times else math.nan


def summary_of(recs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Final numbers of a run from its metrics records and ``config.json``: the mean train
    loss of the last :data:`TAIL` (10) steps, the last val loss and its bits per character
    (``/ ln 2``; NaN if the run never evaluated: ``evaluated`` false), the steps skipped (not
    applied: Inf/NaN gradients; a step that stopped the run among them), the mean share of
    zero gradient values and of activation-gradient underflow over the steps applied (a
    skipped step's gradients hold Inf/NaN, whose shares measure nothing; NaN when no step
    was applied), the median step time, and the step where it diverged
    (:func:`diverged_at`) and what became NaN/Inf there (:func:`diverged_cause`); the
    least finite val loss and its step (``best_val_loss``, ``best_val_step``), the first
    step of an evaluation before the last that gave a NaN/Inf val loss
    (``nonfinite_val_step``), and the steps before the divergence, not marked skipped, that
    logged a NaN/Inf loss (``nonfinite_loss_steps``, ``first_nonfinite_loss_step``: a
    training loop that logs them without skipping). A run without records has a NaN train
    loss and 0 step time."""
    vals = [r for r in recs if "val_loss" in r]
    running = RunningSummary(recs)
    curve = loss_curve([float(r["loss"]) for r in recs])
    final_val = vals[-1]["val_loss"] if vals else math.nan
    applied = [r for r in recs if not r["skipped"]]
    finite_vals = [r for r in vals if math.isfinite(r["val_loss"])]
    best = min(finite_vals, key=lambda r: r["val_loss"]) if finite_vals else None
    # NaN/Inf before the end: a loss on a step not skipped, an evaluation (the last
    # record's belong to diverged_at and to the final val loss)
    bad_losses = [r["step"] for r in recs[:-1] if not r["skipped"] and not math.isfinite(r["loss"])]
    at = diverged_at(recs)
    if at is not None:
        bad_losses = [s for s in bad_losses if s < at]
    bad_vals = [r["step"] for r in vals[:-1] if not math.isfinite(r["val_loss"])]
    return {
        "recipe": cfg["train"].get("recipe", "?"),
        "steps": recs[-1]["step"] if recs else 0,
        "train_loss": running.train_loss,
        "val_loss": final_val,
        "val_bpc": final_val / math.log(2),
        "evaluated": bool(vals),
        "skipped_steps": sum(bool(r["skipped"]) for r in recs),
        "grad_zero_share": _mean(applied, "grad_zero_share"),
        "act_grad_underflow": _mean(applied, "act_grad_underflow"),
        "act_grad_zero": _mean(applied, "act_grad_zero"),
        "step_time_ms": running.step_time_ms if recs else 0,
        "diverged_at": at,
        "diverged_cause": diverged_cause(recs),
        "best_val_loss": best["val_loss"] if best is not None else math.nan,
        "best_val_step": best["step"] if best is not None else None,
        "nonfinite_val_step": bad_vals[0] if bad_vals else None,
        "nonfinite_loss_steps": len(bad_losses),
        "first_nonfinite_loss_step": bad_losses[0] if bad_losses else None,
        "state_bytes_per_param": _last(recs, "state_bytes_per_param"),
        **curve,
    }


def loss_curve(losses: list[float]) -> dict[str, Any]:
    """The shape of a run's train-loss curve, which
    :func:`lowprec.analysis.verdicts.curve_verdict` judges: over the finite losses (in step
    order), ``curve_steps`` their count, ``start_loss`` the first, ``end_loss`` the mean of
    the last ``w = min(TAIL, max(1, n // 4))`` and ``best_loss`` the least mean of ``w``
    consecutive ones (NaN without a finite loss)."""
    xs = [x for x in losses if math.isfinite(x)]
    if not xs:
        return {"curve_steps": 0, "start_loss": math.nan, "end_loss": math.nan,
                "best_loss": math.nan}  # fmt: skip
    w = min(TAIL, max(1, len(xs) // 4))
    means = [statistics.fmean(xs[i : i + w]) for i in range(len(xs) - w + 1)]
    return {"curve_steps": len(xs), "start_loss": xs[0], "end_loss": means[-1],
            "best_loss": min(means)}  # fmt: skip


def summary_cells(s: dict[str, Any]) -> dict[str, str]:
    """The table cells of a :func:`summary_of` result, by column name (losses to 4
    decimals, bpc to 3, shares in percent, step time in whole milliseconds)."""
    return {
        "recipe": s["recipe"],
        "steps": str(s["steps"]),
        "train loss": f"{s['train_loss']:.4f}",
        "val loss": f"{s['val_loss']:.4f}" if s.get("evaluated", True) else "–",
        "val bpc": f"{s['val_bpc']:.3f}" if s.get("evaluated", True) else "–",
        "skipped": str(s["skipped_steps"]),
        "act-grad underflow": share_cell(s["act_grad_underflow"], 1),
        "act-grad zeros": share_cell(s["act_grad_zero"], 2),
        "ms/step": f"{s['step_time_ms']:.0f}",
        "state B/param": "–"
        if s.get("state_bytes_per_param") is None
        else f"{s['state_bytes_per_param']:.2f}",
        "peak MiB": "–" if s.get("peak_rss_mib") is None else f"{s['peak_rss_mib']:.0f}",
    }


def share_cell(share: float | None, digits: int) -> str:
    """A share as a percentage with ``digits`` decimals; "–" when it is not measured
    (``None`` or NaN: no step applied, or a run without that measure)."""
    if share is None or not math.isfinite(share):
        return "–"
    return f"{100 * share:.{digits}f}%"


def _last(recs: list[dict[str, Any]], key: str) -> Any:
    return next((r[key] for r in reversed(recs) if key in r), None)


def _mean(recs: list[dict[str, Any]], key: str) -> float:
    """The mean of ``key`` over the records that have it; NaN when none has."""
    vals = [r[key] for r in recs if key in r]
    return statistics.fmean(vals) if vals else math.nan
