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
time (:class:`~lowprec.jobs.rundir.RunningSummary`).

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

import math
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from lowprec import _faults
from lowprec.amp import NoLossScaler
from lowprec.analysis.stats import GradMeter  # re-exported: the job's meter
from lowprec.distributed import env
from lowprec.distributed.parallel import PARALLEL
from lowprec.distributed.parallel import prepare as dist_prepare
from lowprec.jobs import checkpoints
from lowprec.jobs import parallel as par
from lowprec.jobs.data import CharData
from lowprec.jobs.interrupts import Interrupted, StopSignals
from lowprec.jobs.model import ModelConfig, build_model, check_model_name
from lowprec.jobs.progress import Progress
from lowprec.jobs.recorder import RunRecorder
from lowprec.jobs.rundir import (  # re-exported: the job's own names for its files
    CHECKPOINT,
    CONFIG,
    METRICS,
    NUMERICS,
    SUMMARY,
    NonFiniteError,
    RunError,
    RunningSummary,
    make_new_dir,
    read_config,
    read_metrics,
    summarize,
    summary_of,
)
from lowprec.recipes import Prepared, Recipe, get_recipe, prepare
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


_POSITIVE = (
    "steps",
    "batch_size",
    "seq_len",
    "width",
    "depth",
    "heads",
    "eval_every",
    "eval_batches",
    "ckpt_every",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run of the reference model.

    Every field is a flag of ``lowprec train`` (``--batch-size`` for ``batch_size``), with
    the field's ``metadata["help"]``. ``recipe``: a preset name or a
    :class:`~lowprec.Recipe` (``lowprec train --recipe FILE.json``); :meth:`to_dict` writes
    its name, ``config.json`` the whole recipe. Invalid values raise ``ValueError`` (or
    ``TypeError``) naming the field (:meth:`check_field`).
    """

    recipe: str | Recipe = field(
        default="fp32", metadata={"help": "training recipe: a preset name or a JSON file"}
    )
    steps: int = field(default=400, metadata={"help": "training steps"})
    batch_size: int = field(
        default=16, metadata={"help": "sequences per step (the global batch under --parallel)"}
    )
    seq_len: int = field(default=64, metadata={"help": "characters per sequence"})
    width: int = field(default=128, metadata={"help": "model width"})
    depth: int = field(default=2, metadata={"help": "transformer layers"})
    heads: int = field(default=4, metadata={"help": "attention heads (must divide --width)"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup: int = field(
        default=20, metadata={"help": "linear warm-up steps, then cosine decay to lr/10"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the initialisation and the data"})
    eval_every: int = field(
        default=50, metadata={"help": "evaluate every this many steps (and at the end)"}
    )
    eval_batches: int = field(default=8, metadata={"help": "validation batches per evaluation"})
    ckpt_every: int = field(default=100, metadata={"help": "checkpoint every this many steps"})
    model: str = field(
        default="reference", metadata={"help": "reference or an HF architecture (docs/models.md)"}
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            self.check_field(f.name, getattr(self, f.name))
        self.model_config()  # width divisible by heads

    @classmethod
    def check_field(cls, name: str, value: Any) -> None:
        """Check ``value`` for field ``name`` alone: ``ValueError`` (``TypeError`` for a
        recipe of the wrong type) whose message starts with the field's name."""
        if name == "recipe":
            get_recipe(value)  # unknown names list the valid ones
        elif name == "model":
            check_model_name(value)
        elif name in _POSITIVE:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        elif name == "lr":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and math.isfinite(value) and value > 0):
                raise ValueError(f"lr must be a positive finite number, got {value!r}")
        elif name in ("warmup", "seed"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        else:
            raise ValueError(f"name: TrainConfig has no field {name!r}")

    @property
    def recipe_name(self) -> str:
        return self.recipe.name if isinstance(self.recipe, Recipe) else self.recipe

    def recipe_dict(self) -> dict[str, Any]:
        """The recipe as ``Recipe.to_dict`` (what ``config.json`` stores)."""
        return get_recipe(self.recipe).to_dict()

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
        """The fields as JSON values, ``recipe`` by its name."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["recipe"] = self.recipe_name
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """From :meth:`to_dict` (unknown keys are ignored; ``recipe`` a preset name)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TrainConfig:
        """The configuration a run directory's ``config.json`` records: its ``"train"``
        entry, with the recipe rebuilt from its ``"recipe"`` dict (the preset name where
        the dict is that preset's). ``ValueError``/``TypeError`` if it is not valid."""
        train = dict(config["train"])
        saved = config.get("recipe")
        if isinstance(saved, dict) and saved:
            name = train.get("recipe")
            same = False
            try:
                same = isinstance(name, str) and get_recipe(name).to_dict() == saved
            except ValueError:
                pass  # not a preset: a recipe from a file
            train["recipe"] = name if same else Recipe.from_dict(saved)
        return cls.from_dict(train)

    def differences(self, other: TrainConfig) -> list[str]:
        """The names of the fields whose values differ between ``self`` and ``other``
        (recipes compared by their dicts, whether given by name or as a Recipe)."""
        out = []
        for f in fields(self):
            if f.name == "recipe":
                if self.recipe_dict() != other.recipe_dict():
                    out.append(f.name)
            elif getattr(self, f.name) != getattr(other, f.name):
                out.append(f.name)
        return out


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
        old = saved_config(out, saved)
        diff = [name for name in old.differences(cfg) if name != "steps"]
        if diff:
            what = "; ".join(
                f"{name} {_shown(old, name)} in the run, {_shown(cfg, name)} now" for name in diff
            )
            raise RunError(
                f"--resume: {out} was made with a different configuration ({what}); only "
                "--steps may change"
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


def saved_config(out: Path, saved: dict[str, Any] | None = None) -> TrainConfig:
    """The :class:`TrainConfig` that run directory ``out`` records (``saved``: its
    ``config.json``, if already read); :class:`RunError` if there is none or it is not
    valid."""
    saved = read_config(out, "--resume") if saved is None else saved
    try:
        return TrainConfig.from_config(saved)
    except (ValueError, TypeError, KeyError) as e:
        raise RunError(f"--resume: {out / CONFIG} is corrupt ({e})") from None


def _shown(cfg: TrainConfig, name: str) -> str:
    return cfg.recipe_name if name == "recipe" else repr(getattr(cfg, name))


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
        loop = _Loop(cfg, prepared, data, recorder, on_nonfinite, max_skips, parallel)
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
                        checkpoints.save(out, prepared, step, parallel)
                    loop.last_ckpt = step
                running.add(rec["loss"], rec["step_time"])
                shown = {"loss": running.train_loss, "step_time": running.step_time_ms / 1e3}
                bar.update(step, shown, prepared.scaler.skipped_steps)
                received = env.agreed_signal(signals.received)  # every rank stops here
            if received is not None and step < end:
                if loop.last_ckpt != step:
                    with signals.protect():
                        checkpoints.save(out, prepared, step, parallel)
                raise Interrupted(step, received, str(out))
    finally:
        recorder.close(summary=False)  # the hooks removed; the summary only at the end
    checkpoints.save(out, prepared, step, parallel)
    if step < cfg.steps:
        return {"stopped_at": step}
    summary: dict[str, Any] = env.on_main(recorder.write_summary, RunError)
    return summary


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
    ) -> None:
        self.cfg, self.prepared, self.data, self.recorder = cfg, prepared, data, recorder
        self.parallel = parallel
        self.on_nonfinite, self.max_skips = on_nonfinite, max_skips
        self.scaler_skips = not isinstance(prepared.scaler, NoLossScaler)
        self.meter = GradMeter(prepared.model)
        self.skips = 0  # consecutive skipped steps
        self.last_ckpt: int | None = None  # the step of the checkpoint on disk

    def step(self, step: int) -> dict[str, Any]:
        """Run step ``step`` (0-based) to its end, its records written; the metrics record."""
        cfg = self.cfg
        rec = _train_step(self.prepared, self.data, step, cfg, self.meter, self.parallel)
        done = step + 1
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
        rec = self.recorder.log(done, **rec)  # the step's numerics, then its metrics line
        if stop is not None:
            self.recorder.write_summary()  # rank 0 writes
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
