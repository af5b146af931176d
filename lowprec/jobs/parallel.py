"""``lowprec train --parallel fsdp|ddp`` under ``torchrun``: the job's side of data parallelism.

* The global batch: ``--batch-size B`` is the batch of one step over all ranks; rank ``r``
  of ``N`` trains on rows ``[r·B/N, (r+1)·B/N)`` of the batch a single process would draw
  (:func:`local_batch`), so N processes see the same data as one.
* Checkpoints are DCP directories (:mod:`lowprec.distributed.checkpoint`) under
  ``checkpoints/step-<k>/``; ``checkpoint.json`` (:data:`POINTER`) names the current one.
  The run directory stays atomic: every rank writes the new directory, and only after DCP
  has written its metadata (the directory is complete) does rank 0 replace the pointer
  with :func:`~lowprec.jobs.rundir.write_atomic` and delete the older directories. A kill
  at any moment leaves the pointer on a complete checkpoint (or no pointer yet).
* Signals: :class:`WorkerStopSignals` (Ctrl-C arrives twice at a worker: from the terminal
  and from ``torchrun``), and the ranks agree at each step boundary on whether any of
  them received one (:func:`lowprec.distributed.env.agreed_signal`).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from lowprec._json import dumps, loads
from lowprec.distributed import checkpoint as dcp_state
from lowprec.distributed import env
from lowprec.jobs.interrupts import StopSignals
from lowprec.jobs.rundir import RunError, write_atomic
from lowprec.recipes import Prepared

__all__ = [
    "CHECKPOINTS",
    "POINTER",
    "WorkerStopSignals",
    "has_checkpoint",
    "load_checkpoint",
    "local_batch",
    "save_checkpoint",
]

POINTER = "checkpoint.json"  # {"step", "dir", "world_size", "parallel"}: the current checkpoint
CHECKPOINTS = "checkpoints"  # the DCP directories, one per step


def local_batch(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's rows of the global batch ``(x, y)`` (all of it on one process)."""
    n, r = env.world_size(), env.rank()
    if x.shape[0] % n:
        raise RunError(
            f"--batch-size {x.shape[0]} is the global batch: it must be divisible by the "
            f"number of processes ({n})"
        )
    k = x.shape[0] // n
    return x[r * k : (r + 1) * k], y[r * k : (r + 1) * k]


def has_checkpoint(out: Path) -> bool:
    return (out / POINTER).is_file()


def _pointer(out: Path) -> dict[str, Any]:
    try:
        ptr = loads((out / POINTER).read_text(encoding="utf-8"))
        if not isinstance(ptr, dict) or not isinstance(ptr.get("step"), int):
            raise ValueError("no step")
        if not isinstance(ptr.get("dir"), str) or not re.fullmatch(
            rf"{CHECKPOINTS}/step-\d+", ptr["dir"]
        ):  # only the run's own checkpoints: never a directory elsewhere
            raise ValueError(f"'dir' must be {CHECKPOINTS}/step-<k>, got {ptr.get('dir')!r}")
        if not (out / ptr["dir"] / ".metadata").is_file():
            raise ValueError(f"no complete DCP directory {ptr.get('dir')!r}")
    except (OSError, ValueError) as e:
        raise RunError(f"--resume: checkpoint pointer {out / POINTER} is corrupt ({e})") from None
    return ptr


def save_checkpoint(out: Path, prepared: Prepared, step: int, parallel: str) -> None:
    """Write the checkpoint of ``step`` (every rank; see the module docstring)."""
    name = f"{CHECKPOINTS}/step-{step:08d}"
    target = out / name

    def clear() -> None:  # a stale, incomplete directory of a killed run's same step
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)

    env.on_main(clear, RunError)
    rng = {"torch": torch.get_rng_state()}
    dcp_state.save(prepared, target, {"step": step, "rng": rng})

    def publish() -> None:
        ptr = {"step": step, "dir": name, "world_size": env.world_size(), "parallel": parallel}
        write_atomic(out / POINTER, dumps(ptr))  # strict JSON (lowprec._json)
        for old in (out / CHECKPOINTS).iterdir():
            if old.name != target.name and re.fullmatch(r"step-\d+", old.name):
                shutil.rmtree(old, ignore_errors=True)

    env.on_main(publish, RunError)


def load_checkpoint(out: Path, prepared: Prepared, parallel: str) -> int:
    """Restore the current checkpoint of ``out`` into ``prepared`` (every rank), with the
    RNG state; the step it was written at. :class:`RunError` if it does not fit."""
    ptr = env.on_main(lambda: _pointer(out), RunError)
    if ptr.get("parallel") != parallel:
        raise RunError(
            f"--resume: {out} was trained with --parallel {ptr.get('parallel')}, not {parallel}"
        )
    try:
        extra = dcp_state.load(prepared, out / ptr["dir"])
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        raise RunError(f"--resume: checkpoint {out / ptr['dir']} does not fit ({e})") from None
    torch.set_rng_state(extra["rng"]["torch"])
    return int(extra["step"])


class WorkerStopSignals(StopSignals):
    """:class:`~lowprec.jobs.interrupts.StopSignals` for a worker of ``torchrun``.

    Ctrl-C in a terminal reaches every process of the foreground group: a worker gets
    SIGINT from the terminal *and* once more from ``torchrun``, which forwards the signal
    it received to its workers. The same signal again within ``window`` seconds of the
    first is that copy, not a second Ctrl-C, and does not abort the checkpoint.
    """

    def __init__(self, window: float = 2.0) -> None:
        super().__init__()
        self.window = window
        self._first_at = 0.0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.received is None:
            self._first_at = now
        elif signum == self.received and now - self._first_at < self.window:
            return  # the launcher's copy of the first signal
        super()._handle(signum, frame)
