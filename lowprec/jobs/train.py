"""The training job: train the reference model with a recipe, log, checkpoint, resume.

The run directory (:mod:`lowprec.jobs.rundir`) gets ``config.json``, one ``metrics.jsonl``
line per step (from :func:`lowprec.recipes.step.train_step`), ``numerics.jsonl`` at the
first and the last step, ``checkpoint.pt`` (model, optimizer, loss scaler, data position,
RNG states; every ``ckpt_every`` steps, at the end and on SIGINT/SIGTERM) and
``summary.json`` at the end. Every write is atomic or a whole-line append (see rundir).
The records (config, metrics, numerics, summary) are written through
:class:`~lowprec.jobs.recorder.RunRecorder`, the one writer of run directories, which
``lowprec train`` shares with hand-written loops; checkpoints through
:mod:`lowprec.jobs.checkpoints`.

The progress bar shows the train loss and the step time as the final table (and
``summary.json``) measure them: the mean loss of the last 10 steps and the median step
time (:class:`~lowprec.jobs.run_summary.RunningSummary`).

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

import logging
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lowprec import _faults
from lowprec.amp import NoLossScaler
from lowprec.amp.footprint import training_state_bytes
from lowprec.analysis.stats import GradMeter  # re-exported: the job's meter
from lowprec.autopilot.guard import Guard
from lowprec.core.warn import warn_once
from lowprec.distributed import env
from lowprec.distributed.parallel import PARALLEL
from lowprec.jobs import checkpoints
from lowprec.jobs import parallel as par
from lowprec.jobs.data import CharData
from lowprec.jobs.interrupts import Interrupted, StopSignals
from lowprec.jobs.progress import Progress
from lowprec.jobs.recorder import RunRecorder
from lowprec.jobs.run_summary import RunningSummary, summary_of
from lowprec.jobs.rundir import (  # re-exported: the job's own names for its files
    CHECKPOINT,
    CONFIG,
    GUARD,
    METRICS,
    NUMERICS,
    SUMMARY,
    NonFiniteError,
    RunError,
    RunLock,
    RunNote,
    read_metrics,
    summarize,
)
from lowprec.jobs.train_config import TrainConfig
from lowprec.jobs.train_config import saved_config as saved_config  # re-exported
from lowprec.jobs.train_setup import _prepare_dir, build
from lowprec.jobs.train_setup import check_size as check_size  # re-exported
from lowprec.recipes import Prepared
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

log = logging.getLogger(__name__)
# What a step redone after --resume must reproduce exactly (_Loop._check_redo).
_REDO_KEYS = ("loss", "loss_scale", "skipped", "val_loss")
# Formats whose ranges the numerics records measure (lowprec.analysis.tracking).
TRACK_FORMATS = ("fp16", "bf16", "e4m3fn", "e5m2")
ON_NONFINITE = ("stop", "skip")  # what a step with an Inf/NaN loss or gradient does


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
    written). ``resume`` on a directory stopped before its first checkpoint starts at step 0;
    with ``cfg.steps`` below the steps the run has done, :class:`RunError` naming
    ``--steps`` (nothing written); on a complete run (its ``cfg.steps`` done, its summary
    written) it returns that summary, writes nothing and warns (:class:`RunNote`).

    SIGINT/SIGTERM: the current step finishes, a checkpoint is written, and
    :class:`~lowprec.jobs.interrupts.Interrupted` is raised. ``on_nonfinite``
    (``"stop"`` or ``"skip"``) and ``max_skips``: see the module docstring;
    :class:`NonFiniteError` when the run stops. ``stop_after=k`` stops after step ``k``
    as an interruption would (checkpoint written, resumable), without the final summary;
    it returns ``{"stopped_at": k}``. One process at a time trains ``out``: another one
    (a ``--resume`` started while the run still trains) gets a :class:`RunError` before
    anything is read (:class:`~lowprec.jobs.rundir.RunLock`).

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
    if cfg.grad_comm != "fp32" and parallel is None:
        raise RunError(
            f"--grad-comm {cfg.grad_comm} reduces gradients across processes: needs --parallel"
        )
    if cfg.guard and parallel is not None:
        raise RunError("--guard runs on one process; it is not supported with --parallel")
    lock = RunLock(out)  # one process trains a run (rank 0 holds it for all)
    try:
        return _train_locked(
            cfg, out, resume, data, parallel, lock, progress, label, stop_after, on_nonfinite,
            max_skips,
        )  # fmt: skip
    finally:
        lock.release()


def _train_locked(
    cfg: TrainConfig,
    out: Path,
    resume: bool,
    data: CharData,
    parallel: str | None,
    lock: RunLock,
    progress: bool,
    label: str | None,
    stop_after: int | None,
    on_nonfinite: str,
    max_skips: int,
) -> dict[str, Any]:
    """:func:`train` from the run directory on, ``lock`` taken before it is read (an
    existing directory) or once it is made (a new one)."""

    def prepare_dir() -> bool:
        if (out / CONFIG).is_file():  # a run directory (never another folder of the user's)
            lock.acquire()
        complete = _prepare_dir(out, cfg, resume, parallel)
        lock.acquire()  # (a new run's directory, made now)
        return complete

    if env.on_main(prepare_dir, RunError):
        return _complete(out, cfg)
    prepared, data = build(cfg, data, parallel)
    guard = Guard(prepared.model) if cfg.guard else None
    if not resume and env.is_main():
        _warn_idle_settings(cfg, guard)
    logged = _logged(out) if resume and env.is_main() else []  # read before restore cuts them
    start = checkpoints.restore(out, prepared, parallel, guard) if resume else 0
    has_ckpt = env.on_main(
        lambda: (out / (CHECKPOINT if parallel is None else par.POINTER)).exists(), RunError
    )
    extra = {
        "model": cfg.model_config(data.vocab_size).to_dict(),
        "parallel": None
        if parallel is None
        else {"mode": parallel, "world_size": env.world_size()},
    }
    # Rank 0 writes; every rank tracks (a statistic of a sharded tensor is a collective).
    recorder = RunRecorder(
        out,
        prepared.model,
        recipe=prepared.recipe,
        config=cfg.to_dict(),
        steps=cfg.steps,
        numerics_every=cfg.steps,  # step indices 0 and steps - 1
        gemms_every=cfg.gemms_every,
        formats=TRACK_FORMATS,
        resume=resume,
        resume_from=start if resume else None,
        count_grads=False,  # train_step measures the gradients (all ranks' under --parallel)
        extra=extra,
        writer=env.is_main(),
    )
    try:
        _faults.point("startup")
        end = cfg.steps if stop_after is None else min(stop_after, cfg.steps)
        loop = _Loop(cfg, prepared, data, recorder, on_nonfinite, max_skips, parallel, guard)
        loop.redo = {r["step"]: r for r in logged if r["step"] > start}
        loop.last_ckpt = start if has_ckpt else None
        show = progress and env.is_main()
        bar = Progress(cfg.steps, start, label or cfg.recipe_name, enabled=show)
        running = RunningSummary(recorder.records() if show and resume else ())
        step = start
        stops = StopSignals() if parallel is None else par.WorkerStopSignals()
        with stops as signals, bar:
            received = env.agreed_signal(signals.received)
            while step < end and received is None:
                rec = loop.step(step)
                step += 1
                if step % cfg.ckpt_every == 0 and step < cfg.steps:
                    with signals.protect():
                        checkpoints.save(out, prepared, step, parallel, guard)
                    loop.last_ckpt = step
                running.add(rec["loss"], rec["step_time"])
                shown = {"loss": running.train_loss, "step_time": running.step_time_ms / 1e3}
                bar.update(step, shown, prepared.scaler.skipped_steps)
                received = env.agreed_signal(signals.received)  # every rank stops here
            if received is not None and step < end:
                if loop.last_ckpt != step:
                    with signals.protect():
                        checkpoints.save(out, prepared, step, parallel, guard)
                raise Interrupted(step, received, str(out))
    finally:
        recorder.close(summary=False)  # the hooks removed; the summary only at the end
    checkpoints.save(out, prepared, step, parallel, guard)
    if step < cfg.steps:
        return {"stopped_at": step}
    summary: dict[str, Any] = env.on_main(recorder.write_summary, RunError)
    return summary


def _complete(out: Path, cfg: TrainConfig) -> dict[str, Any]:
    """The summary of the complete run ``out`` (:func:`summarize`, what its
    ``summary.json`` holds), resumed with nothing to do (nothing is written; a
    :class:`RunNote` says so)."""
    summary: dict[str, Any] = env.on_main(lambda: summarize(out), RunError)
    warnings.warn(
        f"--resume: {out} is complete (all its {cfg.steps} steps are done): nothing to do; "
        f"give --steps above {cfg.steps} to continue it",
        RunNote,
        stacklevel=3,
    )
    return summary


def _warn_idle_settings(cfg: TrainConfig, guard: Guard | None) -> None:
    """Warn where a setting cannot act as asked: a warm-up as long as the run (the learning
    rate never reaches ``--lr``), a guard over a model with no float8 layer to move."""
    if cfg.warmup >= cfg.steps:
        log.warning(
            "--warmup %d is not below --steps %d: the learning rate rises for the "
            "whole run and never reaches --lr %g",
            cfg.warmup,
            cfg.steps,
            cfg.lr,
        )
    if guard is not None and not guard.watched():
        log.warning(
            "--guard: recipe %s has no float8 layer to move; the guard does nothing",
            cfg.recipe_name,
        )


class _Loop:
    """One step of the job: train, evaluate, record; the non-finite policy."""

    def __init__(
        self,
        cfg: TrainConfig,
        prepared: Prepared,
        data: CharData,
        recorder: RunRecorder,
        on_nonfinite: str,
        max_skips: int,
        parallel: str | None = None,
        guard: Guard | None = None,
    ) -> None:
        self.cfg, self.prepared, self.data, self.recorder = cfg, prepared, data, recorder
        self.guard = guard
        self.parallel = parallel
        self.on_nonfinite, self.max_skips = on_nonfinite, max_skips
        self.scaler_skips = not isinstance(prepared.scaler, NoLossScaler)
        self.meter = GradMeter(prepared.model)
        self.skips = 0  # consecutive skipped steps
        self.last_ckpt: int | None = None  # the step of the checkpoint on disk
        # after --resume: the records an interrupted process logged past the checkpoint
        self.redo: dict[int, dict[str, Any]] = {}

    def _check_redo(self, done: int, rec: dict[str, Any]) -> None:
        """A step redone after ``--resume`` must log what the interrupted process logged for
        it (the same state, batch and arithmetic): if its loss, loss scale, skip or
        validation loss differs, mark the record (``resume_mismatch``, with the earlier
        ``resume_loss_before``) and warn once. A step whose learning rate differs (a run
        extended: its cosine schedule spans the new ``--steps``) is another computation,
        not compared. A restored state that differs from the
        checkpoint's is checked on its own (:func:`lowprec.jobs.checkpoints.restore`), so
        a mismatch here, after an exact restore, means this machine computed the same step
        differently the second time."""
        old = self.redo.pop(done, None)
        if old is None or old.get("lr") != rec.get("lr"):
            return  # not logged, or another step: a run extended runs a new LR schedule
        # a value logged by one process only (a validation loss of a step that the first
        # process stopped at, --on-nonfinite stop) is no difference of the numbers
        keys = [k for k in _REDO_KEYS if k in old and k in rec]
        if all(_same(old.get(k), rec.get(k)) for k in keys):
            return
        rec["resume_mismatch"] = True
        rec["resume_loss_before"] = old.get("loss")
        warn_once(
            log,
            "train:redo",
            "lowprec train --resume: step %d, redone from the checkpoint, logged loss %r where "
            "the interrupted process logged %r; from here the run is not bit-exact "
            "(metrics.jsonl marks such steps resume_mismatch)",
            done,
            rec.get("loss"),
            old.get("loss"),
        )

    def step(self, step: int) -> dict[str, Any]:
        """Run step ``step`` (0-based) to its end, its records written; the metrics record."""
        cfg = self.cfg
        rec = _train_step(self.prepared, self.data, step, cfg, self.meter, self.parallel)
        done = step + 1
        self.skips = self.skips + 1 if rec["skipped"] else 0
        stop = None
        advice = "Resume with --on-nonfinite skip, a lower --lr, or use a recipe with loss scaling"
        cause = rec["nonfinite"] or "gradients"  # what became NaN/Inf, for the summary
        # A NaN loss from finite inputs: did the last update leave NaN/Inf weights? Then no
        # skipped step can recover (checked only on such a step: one pass over the state).
        bad = checkpoints.nonfinite_state(self.prepared) if "loss" in cause else None
        if bad is not None:
            cause = "weights"
            stop = (
                f"step {done}: {bad} holds Inf/NaN after the previous update; skipped steps "
                "cannot recover it, the run stops"
            )
            advice = (
                "Lower --lr (the updates carry the weights past their format's range)"
                if self.prepared.recipe.policy.master_weights
                else "Lower --lr, or use a recipe with FP32 master weights"
            )
        elif rec["nonfinite"] is not None and not self.scaler_skips and self.on_nonfinite == "stop":
            stop = (
                f"step {done}: the {rec['nonfinite']} became NaN/Inf; the run stops "
                "(--on-nonfinite stop) and the step was not applied"
            )
            if "loss" in cause:  # every weight finite (checked above): the forward's doing
                advice = (
                    "The loss itself is NaN/Inf with every weight finite (the forward "
                    "overflowed), which no loss scale cures: lower --lr, or use a BF16 or "
                    "unit-scaled recipe; or resume with --on-nonfinite skip"
                )
        elif self.skips >= self.max_skips:
            stop = (
                f"step {done}: {self.skips} consecutive steps skipped "
                f"({cause} NaN/Inf); the run stops (--max-skips {self.max_skips})"
            )
            if self.scaler_skips and cause == "gradients":
                advice = (
                    "The loss is finite and the scaled gradients overflow: lower the loss "
                    "scale, or use dynamic loss scaling"
                )
            elif self.scaler_skips:  # the loss itself: no loss scale cures the forward
                advice = (
                    "The loss itself is NaN/Inf (the forward overflows), which no loss scale "
                    "cures: lower --lr, or use a BF16 or unit-scaled recipe"
                )
        if stop is None and self.guard is not None and not rec["skipped"]:
            moves = self.guard.check(done, self.recorder.gemm_records, rec["loss"])
            if moves:  # written before the step's metrics line: a resume cuts both
                self.recorder.append(GUARD, [m.to_dict() for m in moves])
                rec["guard_moves"] = len(moves)
        if stop is not None:
            rec["stopped"] = "nonfinite"
            rec["stop_cause"] = cause
        elif done % cfg.eval_every == 0 or done == cfg.steps:
            rec["val_loss"] = evaluate(self.prepared, self.data, cfg.eval_batches)
        self._check_redo(done, rec)
        rec = self.recorder.log(done, **rec)  # the step's numerics, then its metrics line
        if stop is not None:
            self.recorder.write_summary()  # rank 0 writes
            kept = (
                "no checkpoint yet"
                if self.last_ckpt is None
                else (f"the last checkpoint (step {self.last_ckpt}) is kept")
            )
            raise NonFiniteError(f"{stop}; {kept}. {advice}", done)
        return rec


def _same(a: Any, b: Any) -> bool:
    """Equal logged values, a NaN equal to a NaN (a redone step that was NaN both times is
    the same step)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _logged(out: Path) -> list[dict[str, Any]]:
    """The metrics records of ``out`` before a resume cuts them (``[]`` where there are
    none or they cannot be read: the restore then reports what is wrong)."""
    try:
        return read_metrics(out) if (out / METRICS).is_file() else []
    except (RunError, OSError, ValueError):
        return []


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
    # one process: parameters + masters + optimizer states by storage (a sharded DTensor
    # parameter's storage is not a plain one: not counted under --parallel)
    state = (
        None if parallel is not None else training_state_bytes(prepared.model, prepared.optimizer)
    )
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
        **({} if state is None else {"state_bytes_per_param": state["per_param"]}),
    }
