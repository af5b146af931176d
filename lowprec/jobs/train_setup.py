"""What a training run sets up before its first step (used by :mod:`lowprec.jobs.train`,
which re-exports :func:`build`): :func:`check_size`, whether the run fits the corpus and
the machine's memory; :func:`_prepare_dir`, the run directory, new or resumed with the same
configuration; :func:`build`, the model, optimizer, loss scaler and data of a
:class:`~lowprec.jobs.train_config.TrainConfig`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lowprec.distributed.parallel import prepare as dist_prepare
from lowprec.jobs import parallel as par
from lowprec.jobs.data import CharData
from lowprec.jobs.model import build_model
from lowprec.jobs.rundir import (
    CHECKPOINT,
    CONFIG,
    LOCK,
    METRICS,
    NUMERICS,
    SUMMARY,
    RunError,
    load_checkpoint,
    make_new_dir,
    read_config,
)
from lowprec.jobs.train_config import TrainConfig, saved_config
from lowprec.recipes import Prepared, prepare

__all__ = ["build", "check_memory", "check_size"]

_MEMORY_SHARE = 0.8  # refuse a configuration whose step needs more of the machine's memory


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
        prepared = dist_prepare(
            model,
            cfg.recipe,
            parallel,  # type: ignore[arg-type]
            factory,
            gen,
            grad_comm=cfg.grad_comm,  # type: ignore[arg-type]
        )
        return prepared, data
    return prepare(model, cfg.recipe, factory, generator=gen), data


def check_size(cfg: TrainConfig) -> CharData:
    """The data of ``cfg``, after checking up front that the run fits: ``seq_len`` shorter
    than each split of the corpus, and one step's memory within the machine's
    (:func:`check_memory`). :class:`RunError` naming the option otherwise."""
    try:
        data = CharData(cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    except ValueError as e:
        raise RunError(f"--seq-len {cfg.seq_len} is too long for the corpus ({e})") from None
    check_memory(cfg.batch_size, cfg.seq_len, cfg.width, cfg.depth, cfg.heads)
    return data


def check_memory(batch: int, seq_len: int, width: int, depth: int, heads: int) -> None:
    """:class:`RunError` naming ``--seq-len / --batch-size / --width / --depth`` unless one
    training step's estimated memory is within :data:`_MEMORY_SHARE` of the machine's:
    the attention scores ``batch · heads · seq_len²`` and the activations ``batch ·
    seq_len · width`` per layer, FP32, kept for backward; and the training state of the
    ``12·width²`` parameters of each layer at 20 bytes each (FP32 weight, gradient, FP32
    master and two Adam moments: the widest recipe's)."""
    b, t, w = batch, seq_len, width
    need = 4 * depth * (4 * b * heads * t * t + 24 * b * t * w) + t * t + 20 * 12 * depth * w * w
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > _MEMORY_SHARE * have:
        raise RunError(
            f"--seq-len {t} / --batch-size {b} / --width {w} / --depth {depth}: one step needs "
            f"about {need / 2**30:.0f} GiB, more than this machine's {have / 2**30:.0f} GiB of "
            "memory"
        )


def _prepare_dir(out: Path, cfg: TrainConfig, resume: bool, parallel: str | None) -> bool:
    """Check or make the run directory ``out`` before anything is written: with ``resume``
    the same configuration (but ``steps``), mode and steps left; whether the resumed run
    is already complete (:func:`_check_steps_left`). Else a new directory."""
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
        return _check_steps_left(out, cfg, parallel)
    if _never_trained(out):  # killed before anything was written: the same command restarts
        for f in out.iterdir():
            if f.name != LOCK:  # (held by this process: train's RunLock)
                f.unlink()
    make_new_dir(out, "pass --resume or another --out")
    return False


def _check_steps_left(out: Path, cfg: TrainConfig, parallel: str | None) -> bool:
    """Whether the resumed run ``out`` is complete: its checkpoint's step is ``cfg.steps``
    and ``summary.json`` is written (a resume then has nothing to do: ``train`` returns
    the summary and writes nothing, so resuming until done is idempotent).
    :class:`RunError` naming ``--steps`` if the checkpoint's step is above ``cfg.steps``
    (that resume used to exit 0 doing nothing and rewrite ``summary.json``). Read before
    anything is written. At ``cfg.steps`` without a summary (killed between the last
    checkpoint and the summary) the resume writes the summary."""
    if parallel is None:
        done = int(load_checkpoint(out, mmap=True)["step"]) if (out / CHECKPOINT).exists() else 0
    else:
        done = int(par._pointer(out)["step"]) if par.has_checkpoint(out) else 0
    if done > cfg.steps:
        raise RunError(
            f"--steps {cfg.steps} is not above the {done} steps {out} has done; give more "
            "steps to continue it"
        )
    return done == cfg.steps and (out / SUMMARY).is_file()


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
        if f.name in (CONFIG, LOCK) or f.name in own_tmp:
            continue
        if f.name in (METRICS, NUMERICS) and f.stat().st_size == 0:
            continue
        return False
    return True
