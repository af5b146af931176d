"""The training job: train the reference model with a recipe, log, checkpoint, resume.

The run directory (:mod:`lowprec.jobs.rundir`) gets ``config.json``, one ``metrics.jsonl``
line per step (from :func:`lowprec.recipes.step.train_step`), ``numerics.jsonl`` at the
first and the last step, ``checkpoint.pt`` (model, optimizer, loss scaler, data position,
RNG states; every ``ckpt_every`` steps, at the end and on Ctrl-C) and ``summary.json`` at
the end.

Batches depend only on the seed and the step, and the checkpoint restores every piece of
state, so ``--resume`` continues bit-exactly: N steps straight equal N/2 steps, resume,
N/2 steps (``tests/test_train.py``).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from lowprec.analysis.stats import GradMeter  # re-exported: the job's meter
from lowprec.analysis.tracking import Tracker
from lowprec.jobs.data import CharData
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.jobs.rundir import (  # re-exported: the job's own names for its files
    CONFIG,
    METRICS,
    NUMERICS,
    SUMMARY,
    RunError,
    load_checkpoint,
    make_new_dir,
    read_config,
    read_metrics,
    save_checkpoint,
    summarize,
    summary_of,
    truncate_jsonl,
)
from lowprec.recipes import Prepared, get_recipe, prepare
from lowprec.recipes.step import train_step

__all__ = [
    "CONFIG",
    "METRICS",
    "NUMERICS",
    "SUMMARY",
    "TRACK_FORMATS",
    "GradMeter",
    "RunError",
    "TrainConfig",
    "build",
    "evaluate",
    "read_metrics",
    "summarize",
    "summary_of",
    "train",
]

# Formats whose ranges the numerics records measure (lowprec.analysis.tracking).
TRACK_FORMATS = ("fp16", "bf16", "e4m3fn", "e5m2")


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run of the reference model."""

    recipe: str = "fp32"
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 64
    width: int = 128
    depth: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    ckpt_every: int = 100

    def __post_init__(self) -> None:
        get_recipe(self.recipe)  # unknown names list the valid ones
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "width",
            "depth",
            "heads",
            "eval_every",
            "eval_batches",
            "ckpt_every",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be a non-negative int, got {self.warmup!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        self.model_config()  # width divisible by heads

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based): linear warm-up over ``warmup`` steps,
        then cosine decay to ``lr / 10`` at the last step. A pure function of the step, so
        resuming needs no scheduler state."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(self.steps - 1 - self.warmup, 1)
        t = min((step - self.warmup) / span, 1.0)
        return self.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * t)))

    def model_config(self, vocab_size: int = 65) -> ModelConfig:
        return ModelConfig(vocab_size, self.width, self.depth, self.heads, self.seq_len)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def build(cfg: TrainConfig) -> tuple[Prepared, CharData]:
    """Model, optimizer, scaler and data for ``cfg``, initialised from ``cfg.seed``."""
    data = CharData(cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = CharGPT(cfg.model_config(data.vocab_size))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prepared = prepare(
        model, cfg.recipe, lambda ps: torch.optim.AdamW(ps, lr=cfg.lr), generator=gen
    )
    return prepared, data


@torch.no_grad()
def evaluate(prepared: Prepared, data: CharData, batches: int) -> float:
    """Mean validation loss (nats per character) over the first ``batches`` val batches."""
    prepared.model.eval()
    total = 0.0
    with prepared.compute():
        for i in range(batches):
            _, loss = prepared.model(*data.batch("val", i))
            assert loss is not None
            total += float(loss)
    prepared.model.train()
    return total / batches


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def _save_checkpoint(out: Path, prepared: Prepared, step: int) -> None:
    save_checkpoint(out, {"step": step, "run": prepared.state_dict(), "rng": _rng_state()})


def _prepare_dir(out: Path, cfg: TrainConfig, resume: bool) -> None:
    if resume:
        old = TrainConfig.from_dict(read_config(out, "--resume")["train"])
        if {**old.to_dict(), "steps": 0} != {**cfg.to_dict(), "steps": 0}:
            raise RunError(
                f"--resume: {out} was made with a different configuration; only --steps may change"
            )
        return
    make_new_dir(out, "pass --resume or another --out")


def train(
    cfg: TrainConfig,
    out: str | Path,
    resume: bool = False,
    progress: bool = True,
    label: str | None = None,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train the reference model per ``cfg``, writing the run directory ``out``.

    Returns the summary (also written to ``summary.json``). Raises :class:`RunError` for a
    non-empty ``out`` without ``resume``, or a missing/corrupt checkpoint with it.
    Ctrl-C writes a checkpoint at the last completed step and re-raises.
    ``stop_after=k`` stops after step ``k`` as an interruption would (checkpoint written,
    resumable), without the final summary; it returns ``{"stopped_at": k}``.
    """
    out = Path(out)
    _prepare_dir(out, cfg, resume)
    prepared, data = build(cfg)
    start = 0
    if resume:
        state = load_checkpoint(out)
        prepared.load_state_dict(state["run"])
        _set_rng_state(state["rng"])
        start = int(state["step"])
        truncate_jsonl(out / METRICS, start)  # metrics: "step" = steps done (1-based)
        truncate_jsonl(out / NUMERICS, start - 1)  # numerics: 0-based step index
    else:
        (out / CONFIG).write_text(
            json.dumps(
                {
                    "train": cfg.to_dict(),
                    "recipe": prepared.recipe.to_dict(),
                    "model": cfg.model_config(data.vocab_size).to_dict(),
                    "torch": torch.__version__,
                },
                indent=2,
            )
        )
    step = start
    meter = GradMeter(prepared.model)
    # Numerics of every tensor at the first and the last training step (0-based index).
    tracker = Tracker(prepared.model, TRACK_FORMATS, auto_step=False)
    tracked = {0, cfg.steps - 1}
    bar = _Progress(cfg.steps, start, label or cfg.recipe, enabled=progress)
    try:
        with open(out / METRICS, "a") as log, bar:
            while step < (cfg.steps if stop_after is None else min(stop_after, cfg.steps)):
                tracker.step, tracker.enabled = step, step in tracked
                rec = _train_step(prepared, data, step, cfg, meter)
                tracker.enabled = False
                if tracker.records:
                    tracker.save(out / NUMERICS)
                    tracker.records.clear()
                step += 1
                rec["step"] = step
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    rec["val_loss"] = evaluate(prepared, data, cfg.eval_batches)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                if step % cfg.ckpt_every == 0 and step < cfg.steps:
                    _save_checkpoint(out, prepared, step)
                bar.update(step, rec, prepared.scaler.skipped_steps)
    except KeyboardInterrupt:
        _save_checkpoint(out, prepared, step)
        raise
    finally:
        tracker.remove()
    _save_checkpoint(out, prepared, step)
    if step < cfg.steps:
        return {"stopped_at": step}
    summary = summarize(out)
    (out / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def _train_step(
    prepared: Prepared, data: CharData, step: int, cfg: TrainConfig, meter: GradMeter
) -> dict[str, Any]:
    x, y = data.batch("train", step)
    meter.reset()
    t0 = time.perf_counter()
    r = train_step(prepared, x, y, cfg.lr_at(step), grad_stats=True)
    dt = time.perf_counter() - t0
    stats = r.grad_stats
    assert stats is not None
    return {
        "loss": float(r.loss.detach()),
        "loss_scale": r.loss_scale,
        "skipped": r.skipped,
        "grad_norm": stats["grad_norm"] / r.loss_scale,
        "grad_zero_share": stats["grad_zero_share"],
        "grad_nonfinite_share": stats["grad_nonfinite_share"],
        "step_time": dt,
        "lr": cfg.lr_at(step),
        **meter.result(),
    }


class _Progress:
    """A rich progress bar with loss, step time and skipped steps (no-op when disabled)."""

    def __init__(self, total: int, start: int, label: str, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[ms]} ms/step"),
            TextColumn("skipped {task.fields[skipped]}"),
            TimeRemainingColumn(),
        )
        self.task = self.progress.add_task(
            label, total=total, completed=start, loss="-", ms="-", skipped=0
        )

    def __enter__(self) -> _Progress:
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.progress.stop()

    def update(self, step: int, rec: dict[str, Any], skipped: int) -> None:
        if self.enabled:
            self.progress.update(
                self.task,
                completed=step,
                loss=f"{rec['loss']:.4f}",
                ms=f"{1e3 * rec['step_time']:.0f}",
                skipped=skipped,
            )
