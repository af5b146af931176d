"""The training job: train the reference model with a recipe, log, checkpoint, resume.

A run directory holds ``config.json`` (everything needed to rebuild the run),
``metrics.jsonl`` (one JSON object per step), ``checkpoint.pt`` (model, optimizer, loss
scaler, data position, RNG states; written atomically every ``ckpt_every`` steps, at the end
and on Ctrl-C) and ``summary.json`` at the end.

Batches depend only on the seed and the step, and the checkpoint restores every piece of
state, so ``--resume`` continues bit-exactly: N steps straight equal N/2 steps, resume,
N/2 steps (``tests/test_train.py``).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from lowprec.analysis.tracking import Tracker
from lowprec.core.tensor import ScaledTensor
from lowprec.jobs.model import CharData, CharGPT, ModelConfig
from lowprec.recipes import Prepared, get_recipe, prepare
from lowprec.recipes.step import train_step

__all__ = ["RunError", "TrainConfig", "evaluate", "train"]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
CONFIG = "config.json"
SUMMARY = "summary.json"
NUMERICS = "numerics.jsonl"
# Formats whose ranges the numerics records measure (lowprec.analysis.tracking).
TRACK_FORMATS = ("fp16", "bf16", "e4m3fn", "e5m2")


class RunError(ValueError):
    """A run cannot start or resume (bad directory, missing or corrupt checkpoint)."""


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
    state = {"step": step, "run": prepared.state_dict(), "rng": _rng_state()}
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / CHECKPOINT)  # atomic: a crash never leaves a half-written file


def _load_checkpoint(out: Path) -> dict[str, Any]:
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


def _prepare_dir(out: Path, cfg: TrainConfig, resume: bool) -> None:
    if resume:
        saved = out / CONFIG
        if not saved.is_file():
            raise RunError(f"--resume: {out} is not a run directory (no {CONFIG})")
        old = TrainConfig.from_dict(json.loads(saved.read_text())["train"])
        if {**old.to_dict(), "steps": 0} != {**cfg.to_dict(), "steps": 0}:
            raise RunError(
                f"--resume: {out} was made with a different configuration; only --steps may change"
            )
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunError(f"output directory {out} already exists; pass --resume or another --out")
    out.mkdir(parents=True, exist_ok=True)


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
        state = _load_checkpoint(out)
        prepared.load_state_dict(state["run"])
        _set_rng_state(state["rng"])
        start = int(state["step"])
        _truncate_jsonl(out / METRICS, start)  # metrics: "step" = steps done (1-based)
        _truncate_jsonl(out / NUMERICS, start - 1)  # numerics: 0-based step index
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


class GradMeter:
    """Underflow of activation gradients: the gradients flowing into the output of every
    ``nn.Linear`` in backward, in the compute dtype and after loss scaling.

    ``result()`` gives ``act_grad_underflow``, the share of values below the smallest
    normal number of their dtype (subnormal: precision lost, or zero), and
    ``act_grad_zero``, the share that are exactly zero (signal lost).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.counts = [0, 0, 0]  # values, below min normal, zero
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(self._on_forward)

    def _on_forward(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._on_grad)  # type: ignore[no-untyped-call]

    def _on_grad(self, grad: torch.Tensor) -> None:
        # A scalify gradient is ``qdata * scale``: what underflows is the stored payload,
        # in its storage dtype (the scale carries the range), not the dequantized value.
        data = grad.qdata if isinstance(grad, ScaledTensor) else grad
        tiny = torch.finfo(data.dtype).tiny
        a = data.detach().abs()
        if a.element_size() == 1:  # FP8 payloads: no comparison kernels (exact in FP32)
            a = a.float()
        self.counts[0] += a.numel()
        self.counts[1] += int((a < tiny).sum())
        self.counts[2] += int((a == 0).sum())

    def reset(self) -> None:
        self.counts = [0, 0, 0]

    def result(self) -> dict[str, float]:
        n = max(self.counts[0], 1)
        return {"act_grad_underflow": self.counts[1] / n, "act_grad_zero": self.counts[2] / n}


def _truncate_jsonl(path: Path, last: int) -> None:
    """Drop JSON lines whose ``step`` is after ``last`` (written after the checkpoint we
    resume from)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= last]
    path.write_text("".join(ln + "\n" for ln in keep))


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    path = Path(out) / METRICS
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]


def summarize(out: str | Path) -> dict[str, Any]:
    """Final numbers of a run directory: losses, bits per character, skipped steps, the
    mean share of zero gradient values, the median step time, and divergence."""
    return summary_of(read_metrics(out), json.loads((Path(out) / CONFIG).read_text()))


def summary_of(recs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """:func:`summarize` of metrics records and a run's ``config.json`` already read."""
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


def _mean(recs: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in recs if key in r]
    return statistics.fmean(vals) if vals else 0.0


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
