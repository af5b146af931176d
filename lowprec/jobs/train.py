"""The training job: train the reference model with a recipe, log, checkpoint, resume.

The run directory (:mod:`lowprec.jobs.rundir`) gets ``config.json``, one ``metrics.jsonl``
line per step (from :func:`lowprec.recipes.step.train_step`), ``numerics.jsonl`` at the
first and the last step, ``checkpoint.pt`` (model, optimizer, loss scaler, data position,
RNG states; every ``ckpt_every`` steps, at the end and on SIGINT/SIGTERM) and
``summary.json`` at the end. Every write is atomic or a whole-line append (see rundir).

A step is the unit of work: SIGINT/SIGTERM take effect between steps
(:mod:`lowprec.jobs.interrupts`), then the run checkpoints and raises
:class:`~lowprec.jobs.interrupts.Interrupted`. Batches depend only on the seed and the
step, and the checkpoint restores every piece of state, so ``--resume`` continues
bit-exactly: every step is logged once, with the losses of an uninterrupted run
(``tests/jobs/test_train.py``, ``tests/jobs/test_interrupts.py``).

A step with an Inf/NaN loss or gradient never changes the weights
(``train_step(skip_nonfinite=True)``). A loss-scaled recipe skips it, as its loss scaler
does; otherwise ``on_nonfinite`` decides: ``"stop"`` (log the step, raise
:class:`NonFiniteError`, keep the last checkpoint) or ``"skip"``. ``max_skips``
consecutive skipped steps stop any run. No checkpoint is ever written with non-finite
parameters or optimizer state.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from lowprec import _faults
from lowprec.amp import NoLossScaler
from lowprec.analysis.stats import GradMeter  # re-exported: the job's meter
from lowprec.analysis.tracking import Tracker
from lowprec.distributed import env
from lowprec.distributed.parallel import PARALLEL
from lowprec.distributed.parallel import prepare as dist_prepare
from lowprec.jobs import checkpoints
from lowprec.jobs import parallel as par
from lowprec.jobs.data import CharData
from lowprec.jobs.interrupts import Interrupted, StopSignals
from lowprec.jobs.model import ModelConfig, build_model, check_model_name
from lowprec.jobs.progress import Progress
from lowprec.jobs.rundir import (  # re-exported: the job's own names for its files
    CHECKPOINT,
    CONFIG,
    METRICS,
    NUMERICS,
    SUMMARY,
    NonFiniteError,
    RunError,
    append_jsonl,
    make_new_dir,
    read_config,
    read_metrics,
    summarize,
    summary_of,
    write_atomic,
)
from lowprec.recipes import Prepared, get_recipe, prepare
from lowprec.recipes.step import train_step

__all__ = [
    "CONFIG",
    "METRICS",
    "NUMERICS",
    "ON_NONFINITE",
    "SUMMARY",
    "TRACK_FORMATS",
    "GradMeter",
    "Interrupted",
    "NonFiniteError",
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
ON_NONFINITE = ("stop", "skip")  # what a step with an Inf/NaN loss or gradient does
_MEMORY_SHARE = 0.8  # refuse a configuration whose step needs more of the machine's memory


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
    model: str = "reference"  # lowprec.jobs.model.model_names(): reference, llama, gpt2, ...

    def __post_init__(self) -> None:
        get_recipe(self.recipe)  # unknown names list the valid ones
        check_model_name(self.model)
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


def build(
    cfg: TrainConfig, data: CharData | None = None, parallel: str | None = None
) -> tuple[Prepared, CharData]:
    """Model, optimizer, scaler and data for ``cfg``, initialised from ``cfg.seed``;
    ``parallel`` (``"fsdp"``/``"ddp"``, under ``torchrun``): sharded by
    :func:`lowprec.distributed.parallel.prepare`."""
    data = data or CharData(cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.model_config(data.vocab_size))
    gen = torch.Generator().manual_seed(cfg.seed + 1)

    def factory(ps: list[Any]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=cfg.lr)

    if parallel is not None:
        return dist_prepare(model, cfg.recipe, parallel, factory, gen), data  # type: ignore[arg-type]
    return prepare(model, cfg.recipe, factory, generator=gen), data


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


def check_size(cfg: TrainConfig) -> CharData:
    """The data of ``cfg``, after checking up front that the run fits: ``seq_len`` shorter
    than each split of the corpus, and one step's estimated memory (attention scores
    ``batch · heads · seq_len²`` and activations ``batch · seq_len · width``, per layer,
    FP32, kept for backward) within :data:`_MEMORY_SHARE` of the machine's memory.
    :class:`RunError` naming the option otherwise."""
    try:
        data = CharData(cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    except ValueError as e:
        raise RunError(f"--seq-len {cfg.seq_len} is too long for the corpus ({e})") from None
    b, t, w = cfg.batch_size, cfg.seq_len, cfg.width
    need = 4 * cfg.depth * (4 * b * cfg.heads * t * t + 24 * b * t * w) + t * t
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return data
    if need > _MEMORY_SHARE * have:
        raise RunError(
            f"--seq-len {t} / --batch-size {b} / --width {w}: one step needs about "
            f"{need / 2**30:.0f} GiB, more than this machine's {have / 2**30:.0f} GiB of memory"
        )
    return data


def _prepare_dir(out: Path, cfg: TrainConfig, resume: bool, parallel: str | None) -> None:
    if resume:
        saved = read_config(out, "--resume")
        old = TrainConfig.from_dict(saved["train"])
        if {**old.to_dict(), "steps": 0} != {**cfg.to_dict(), "steps": 0}:
            raise RunError(
                f"--resume: {out} was made with a different configuration; only --steps may change"
            )
        was = (saved.get("parallel") or {}).get("mode")
        if was != parallel:
            raise RunError(
                f"--resume: {out} was trained with --parallel {was or '(none)'}, not "
                f"{parallel or '(none)'}; the process count may change, the mode may not"
            )
        return
    if _never_trained(out):  # killed before anything was written: the same command restarts
        for f in out.iterdir():
            f.unlink()
    make_new_dir(out, "pass --resume or another --out")


def _never_trained(out: Path) -> bool:
    """Whether ``out`` is a run directory that a start killed before its first step was
    logged: nothing in it but ``config.json`` (or its temporary file, a kill during that
    write) and empty logs, no checkpoint. Starting it again loses nothing."""
    if not out.is_dir() or not any(out.iterdir()):
        return False
    own_tmp = {name + ".tmp" for name in (CONFIG, CHECKPOINT, SUMMARY, METRICS, NUMERICS)}
    for f in out.iterdir():
        if not f.is_file() or f.is_symlink():
            return False
        if f.name == CONFIG or f.name in own_tmp:
            continue
        if f.name in (METRICS, NUMERICS) and f.stat().st_size == 0:
            continue
        return False
    return True


def train(
    cfg: TrainConfig,
    out: str | Path,
    resume: bool = False,
    progress: bool = True,
    label: str | None = None,
    stop_after: int | None = None,
    on_nonfinite: str = "stop",
    max_skips: int = 25,
    parallel: str | None = None,
) -> dict[str, Any]:
    """Train the reference model per ``cfg``, writing the run directory ``out``.

    Returns the summary (also written to ``summary.json``). Raises :class:`RunError` for a
    non-empty ``out`` without ``resume``, a corrupt checkpoint or config with it, or a
    configuration too big for the corpus or the machine (checked before anything is
    written). ``resume`` on a directory stopped before its first checkpoint starts at step 0.

    SIGINT/SIGTERM: the current step finishes, a checkpoint is written, and
    :class:`~lowprec.jobs.interrupts.Interrupted` is raised. ``on_nonfinite``
    (``"stop"`` or ``"skip"``) and ``max_skips``: see the module docstring;
    :class:`NonFiniteError` when the run stops. ``stop_after=k`` stops after step ``k``
    as an interruption would (checkpoint written, resumable), without the final summary;
    it returns ``{"stopped_at": k}``.

    ``parallel`` (``"fsdp"`` or ``"ddp"``): every rank of a ``torchrun`` job calls
    ``train`` with the same arguments (:mod:`lowprec.jobs.parallel`: ``cfg.batch_size`` is
    the global batch, rank 0 writes the files and the progress bar, checkpoints are DCP
    directories, all ranks stop at the same step on a signal).
    """
    if parallel is not None and parallel not in PARALLEL:
        raise ValueError(f"parallel must be None or one of {list(PARALLEL)}, got {parallel!r}")
    if parallel is not None and not torch.distributed.is_initialized():
        raise RunError(
            "--parallel needs a process group: start with torchrun (or lowprec train "
            "--nproc-per-node N)"
        )
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    if isinstance(max_skips, bool) or not isinstance(max_skips, int) or max_skips < 1:
        raise ValueError(f"max_skips must be a positive int, got {max_skips!r}")
    out = Path(out)
    data = check_size(cfg)
    if parallel is not None and cfg.batch_size % env.world_size():
        raise RunError(
            f"--batch-size {cfg.batch_size} is the global batch: it must be divisible by the "
            f"number of processes ({env.world_size()})"
        )
    env.on_main(lambda: _prepare_dir(out, cfg, resume, parallel), RunError)
    prepared, data = build(cfg, data, parallel)
    start = checkpoints.restore(out, prepared, parallel) if resume else 0
    has_ckpt = env.on_main(
        lambda: (out / (CHECKPOINT if parallel is None else par.POINTER)).exists(), RunError
    )
    if not resume and env.is_main():
        config = {
            "train": cfg.to_dict(),
            "recipe": prepared.recipe.to_dict(),
            "model": cfg.model_config(data.vocab_size).to_dict(),
            "torch": torch.__version__,
            "parallel": None
            if parallel is None
            else {"mode": parallel, "world_size": env.world_size()},
        }
        write_atomic(out / CONFIG, json.dumps(config, indent=2))
    _faults.point("startup")
    end = cfg.steps if stop_after is None else min(stop_after, cfg.steps)
    loop = _Loop(cfg, out, prepared, data, on_nonfinite, max_skips, parallel)
    loop.last_ckpt = start if has_ckpt else None
    bar = Progress(cfg.steps, start, label or cfg.recipe, enabled=progress and env.is_main())
    step = start
    stops = StopSignals() if parallel is None else par.WorkerStopSignals()
    try:
        with stops as signals, bar:
            received = env.agreed_signal(signals.received)
            while step < end and received is None:
                rec = loop.step(step)
                step += 1
                if step % cfg.ckpt_every == 0 and step < cfg.steps:
                    with signals.protect():
                        checkpoints.save(out, prepared, step, parallel)
                    loop.last_ckpt = step
                bar.update(step, rec, prepared.scaler.skipped_steps)
                received = env.agreed_signal(signals.received)  # every rank stops here
            if received is not None and step < end:
                if loop.last_ckpt != step:
                    with signals.protect():
                        checkpoints.save(out, prepared, step, parallel)
                raise Interrupted(step, received, str(out))
    finally:
        loop.close()
    checkpoints.save(out, prepared, step, parallel)
    if step < cfg.steps:
        return {"stopped_at": step}
    summary = env.on_main(lambda: summarize(out), RunError)
    if env.is_main():
        write_atomic(out / SUMMARY, json.dumps(summary, indent=2))
    return summary


class _Loop:
    """One step of the job: train, track, evaluate, log; the non-finite policy."""

    def __init__(
        self,
        cfg: TrainConfig,
        out: Path,
        prepared: Prepared,
        data: CharData,
        on_nonfinite: str,
        max_skips: int,
        parallel: str | None = None,
    ) -> None:
        self.cfg, self.out, self.prepared, self.data = cfg, out, prepared, data
        self.parallel, self.main = parallel, env.is_main()
        self.on_nonfinite, self.max_skips = on_nonfinite, max_skips
        self.scaler_skips = not isinstance(prepared.scaler, NoLossScaler)
        self.meter = GradMeter(prepared.model)
        # Numerics of every tensor at the first and the last training step (0-based index).
        self.tracker = Tracker(prepared.model, TRACK_FORMATS, auto_step=False)
        self.tracked = {0, cfg.steps - 1}
        self.skips = 0  # consecutive skipped steps
        self.last_ckpt: int | None = None  # the step of the checkpoint on disk

    def close(self) -> None:
        self.tracker.remove()

    def step(self, step: int) -> dict[str, Any]:
        """Run step ``step`` (0-based) to its end, metrics line included; the record."""
        cfg, tracker = self.cfg, self.tracker
        # Every rank tracks (a statistic of a sharded tensor is a collective); rank 0 writes.
        tracker.step, tracker.enabled = step, step in self.tracked
        rec = _train_step(self.prepared, self.data, step, cfg, self.meter, self.parallel)
        tracker.enabled = False
        if self.main:  # rank 0 writes the run directory
            append_jsonl(self.out / NUMERICS, tracker.records)
        tracker.records.clear()
        done = step + 1
        rec["step"] = done
        self.skips = self.skips + 1 if rec["skipped"] else 0
        stop = None
        if rec["nonfinite"] is not None and not self.scaler_skips and self.on_nonfinite == "stop":
            stop = (
                f"step {done}: the {rec['nonfinite']} became NaN/Inf; the run stops "
                "(--on-nonfinite stop) and the step was not applied"
            )
        elif self.skips >= self.max_skips:
            stop = (
                f"step {done}: {self.skips} consecutive steps skipped "
                f"({rec['nonfinite'] or 'gradients'} NaN/Inf); the run stops (--max-skips "
                f"{self.max_skips})"
            )
        if stop is not None:
            rec["stopped"] = "nonfinite"
        elif done % cfg.eval_every == 0 or done == cfg.steps:
            rec["val_loss"] = evaluate(self.prepared, self.data, cfg.eval_batches)
        if self.main:
            _faults.point("metrics")
            append_jsonl(self.out / METRICS, [rec])
        if stop is not None:
            if self.main:
                write_atomic(self.out / SUMMARY, json.dumps(summarize(self.out), indent=2))
            kept = (
                "no checkpoint yet"
                if self.last_ckpt is None
                else (f"the last checkpoint (step {self.last_ckpt}) is kept")
            )
            raise NonFiniteError(
                f"{stop}; {kept}. Resume with --on-nonfinite skip, a lower --lr, or use a "
                "recipe with loss scaling",
                done,
            )
        return rec


def _train_step(
    prepared: Prepared,
    data: CharData,
    step: int,
    cfg: TrainConfig,
    meter: GradMeter,
    parallel: str | None = None,
) -> dict[str, Any]:
    x, y = data.batch("train", step)
    if parallel is not None:
        x, y = par.local_batch(x, y)  # this rank's share of the global batch
    meter.reset()
    t0 = time.perf_counter()
    r = train_step(prepared, x, y, cfg.lr_at(step), grad_stats=True, skip_nonfinite=True)
    dt = time.perf_counter() - t0
    stats = r.grad_stats
    assert stats is not None  # global: DDP's gradients are all-reduced, FSDP2's summed
    acts = meter.result()
    # Per-rank values of equal shares of the batch: their mean is the global batch's.
    loss, *shares = env.mean([float(r.loss.detach()), *acts.values()])
    return {
        "loss": loss,
        "loss_scale": r.loss_scale,
        "skipped": r.skipped,
        "nonfinite": r.nonfinite,
        "grad_norm": stats["grad_norm"] / r.loss_scale,
        "grad_zero_share": stats["grad_zero_share"],
        "grad_nonfinite_share": stats["grad_nonfinite_share"],
        "step_time": dt,
        "lr": cfg.lr_at(step),
        **dict(zip(acts, shares, strict=True)),
    }
