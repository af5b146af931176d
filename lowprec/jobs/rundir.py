"""The run directory: the files a training run writes, reading them, and the checks.

A run directory holds

* ``config.json`` (:data:`CONFIG`): ``{"train": TrainConfig, "recipe": Recipe, "model":
  ModelConfig, "torch": version}``, everything needed to rebuild the run;
* ``metrics.jsonl`` (:data:`METRICS`): one JSON object per training step, ``"step"`` the
  number of steps done (1-based);
* ``numerics.jsonl`` (:data:`NUMERICS`): :mod:`lowprec.analysis.tracking` records,
  ``"step"`` the 0-based step index;
* ``checkpoint.pt`` (:data:`CHECKPOINT`): ``{"step", "run", "rng"}``, written atomically;
* ``summary.json`` (:data:`SUMMARY`): :func:`summary_of` the metrics, at the end.

Every job (train, demo, report) reads and checks run directories through this module only;
a failed check raises :class:`RunError` (a ``ValueError``) with a message for the user.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHECKPOINT",
    "CONFIG",
    "METRICS",
    "NUMERICS",
    "SUMMARY",
    "RunError",
    "load_checkpoint",
    "make_new_dir",
    "read_config",
    "read_metrics",
    "read_run",
    "save_checkpoint",
    "summarize",
    "summary_cells",
    "summary_of",
    "truncate_jsonl",
]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
CONFIG = "config.json"
SUMMARY = "summary.json"
NUMERICS = "numerics.jsonl"


class RunError(ValueError):
    """A run cannot start or resume (bad directory, missing or corrupt checkpoint)."""


def make_new_dir(out: Path, advice: str) -> None:
    """Create ``out`` for a new run; :class:`RunError` ending in ``advice`` if it exists and
    is not an empty directory (nothing on disk is overwritten)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunError(f"output directory {out} already exists; {advice}")
    out.mkdir(parents=True, exist_ok=True)


def read_config(out: Path, context: str) -> dict[str, Any]:
    """The run's ``config.json``; :class:`RunError` prefixed ``context`` if there is none."""
    saved = out / CONFIG
    if not saved.is_file():
        raise RunError(f"{context}: {out} is not a run directory (no {CONFIG})")
    config: dict[str, Any] = json.loads(saved.read_text())
    return config


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    """The metrics records of run directory ``out``, in step order."""
    return _read_jsonl(Path(out) / METRICS)


def read_run(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(config, metrics, numerics)`` of a finished or running run directory (numerics
    empty if none were written); :class:`RunError` naming what is wrong if ``path`` is not
    a run directory with at least one recorded step."""
    p = Path(path)
    if not p.is_dir():
        raise RunError(f"{p} is not a directory (expected a run directory of `lowprec train`)")
    missing = [n for n in (CONFIG, METRICS) if not (p / n).is_file()]
    if missing:
        raise RunError(
            f"{p} is not a lowprec run directory: no {' or '.join(missing)} "
            "(make one with `lowprec train --out DIR` or `lowprec demo`)"
        )
    try:
        config = json.loads((p / CONFIG).read_text())
        metrics = read_metrics(p)
    except (json.JSONDecodeError, OSError) as e:
        raise RunError(f"{p}: unreadable run files ({e})") from None
    if not metrics:
        raise RunError(f"{p}: the run has no recorded steps yet ({METRICS} is empty)")
    numerics: list[dict[str, Any]] = []
    if (p / NUMERICS).is_file():
        try:
            numerics = _read_jsonl(p / NUMERICS)
        except json.JSONDecodeError as e:
            raise RunError(f"{p}: {NUMERICS} is corrupt or truncated ({e})") from None
    return config, metrics, numerics


def truncate_jsonl(path: Path, last: int) -> None:
    """Drop JSON lines whose ``step`` is after ``last`` (written after the checkpoint a run
    resumes from)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= last]
    path.write_text("".join(ln + "\n" for ln in keep))


def save_checkpoint(out: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``out/checkpoint.pt`` atomically (a temporary file, then a rename:
    a crash never leaves a half-written checkpoint)."""
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / CHECKPOINT)


def load_checkpoint(out: Path) -> dict[str, Any]:
    """The checkpoint of ``out`` (keys ``step``, ``run``, ``rng``); :class:`RunError` if it
    is missing, unreadable or lacks a key."""
    path = out / CHECKPOINT
    if not path.is_file():
        raise RunError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, weights_only=True)
        if not isinstance(state, dict) or not {"step", "run", "rng"} <= set(state):
            raise ValueError("missing keys")
    except Exception as e:  # any unpickling failure means the file is corrupt
        raise RunError(f"--resume: checkpoint {path} is corrupt or unreadable ({e})") from e
    return state


def summarize(out: str | Path) -> dict[str, Any]:
    """:func:`summary_of` the run directory ``out``."""
    return summary_of(read_metrics(out), json.loads((Path(out) / CONFIG).read_text()))


def summary_of(recs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Final numbers of a run from its metrics records and ``config.json``: the mean train
    loss of the last 10 steps, the last val loss and its bits per character (``/ ln 2``),
    skipped steps, the mean share of zero gradient values and of activation-gradient
    underflow, the median step time, and the first step with a non-finite loss."""
    vals = [r for r in recs if "val_loss" in r]
    tail = [r["loss"] for r in recs[-10:]]
    diverged = next((r["step"] for r in recs if not math.isfinite(r["loss"])), None)
    final_val = vals[-1]["val_loss"] if vals else math.nan
    return {
        "recipe": cfg["train"]["recipe"],
        "steps": recs[-1]["step"] if recs else 0,
        "train_loss": statistics.fmean(tail) if tail else math.nan,
        "val_loss": final_val,
        "val_bpc": final_val / math.log(2),
        "skipped_steps": sum(bool(r["skipped"]) for r in recs),
        "grad_zero_share": statistics.fmean(r["grad_zero_share"] for r in recs) if recs else 0,
        "act_grad_underflow": _mean(recs, "act_grad_underflow"),
        "act_grad_zero": _mean(recs, "act_grad_zero"),
        "step_time_ms": 1e3 * statistics.median(r["step_time"] for r in recs) if recs else 0,
        "diverged_at": diverged,
    }


def summary_cells(s: dict[str, Any]) -> dict[str, str]:
    """The table cells of a :func:`summary_of` result, by column name (losses to 4
    decimals, bpc to 3, shares in percent, step time in whole milliseconds)."""
    return {
        "recipe": s["recipe"],
        "steps": str(s["steps"]),
        "train loss": f"{s['train_loss']:.4f}",
        "val loss": f"{s['val_loss']:.4f}",
        "val bpc": f"{s['val_bpc']:.3f}",
        "skipped": str(s["skipped_steps"]),
        "act-grad underflow": f"{100 * s['act_grad_underflow']:.1f}%",
        "act-grad zeros": f"{100 * s['act_grad_zero']:.2f}%",
        "ms/step": f"{s['step_time_ms']:.0f}",
    }


def _mean(recs: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in recs if key in r]
    return statistics.fmean(vals) if vals else 0.0
