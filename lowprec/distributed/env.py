"""The process group of a ``torchrun`` job, and the few agreements a training loop needs.

:func:`init` starts torch's default process group from the environment ``torchrun``
sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...): ``nccl`` when CUDA is available,
``gloo`` otherwise. The other helpers are thin wrappers of ``torch.distributed``
collectives that also work without a process group (one process: nothing to agree on):

* :func:`rank`, :func:`world_size`, :func:`is_main`;
* :func:`mean` of a few floats over the ranks (per-rank losses of equal batch shares:
  their mean is the loss of the global batch);
* :func:`agreed_signal`: the largest signal number any rank received, so that every
  rank stops at the same step boundary;
* :func:`on_main`: run a check on rank 0 and raise its error on every rank, so that no
  rank waits forever in a collective for a rank that gave up;
* :func:`shutdown`: end the process groups while the interpreter is fully alive.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "agreed_signal",
    "backend",
    "init",
    "is_main",
    "launched",
    "mean",
    "on_main",
    "rank",
    "shutdown",
    "world_size",
]

T = TypeVar("T")


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (``WORLD_SIZE`` is set)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def backend() -> str:
    """``"nccl"`` when CUDA is available, ``"gloo"`` on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init() -> None:
    """Start the default process group from ``torchrun``'s environment (idempotent).
    ``RuntimeError`` outside ``torchrun``. On CUDA, this rank's device becomes
    ``LOCAL_RANK``."""
    if dist.is_initialized():
        return
    if not launched():
        raise RuntimeError(
            "lowprec.distributed.init: RANK/WORLD_SIZE are not set; start the job with "
            "torchrun --nproc-per-node N ..."
        )
    b = backend()
    if b == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(b)


def shutdown() -> None:
    """Destroy every process group of this process, cleanly; nothing without one.

    Call it once per process when communication is over (``lowprec train`` does). It first
    collects unreachable objects, so that FSDP2 modules, device meshes and DTensors caught
    in reference cycles drop their process groups now, then calls
    ``torch.distributed.destroy_process_group()``, then collects again. A gloo process
    group that is only freed during interpreter finalisation can have its worker threads
    destroyed while still joinable, which aborts the process (``terminate called without
    an active exception``, SIGABRT) after its work is done.
    """
    if not _active():
        return
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if _active() else 1


def is_main() -> bool:
    """Whether this is rank 0 (the one that writes files and prints)."""
    return rank() == 0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mean(values: list[float]) -> list[float]:
    """The mean of each of ``values`` over the ranks (one all-reduce, in float64)."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return [v / world_size() for v in t.tolist()]


def agreed_signal(received: int | None) -> int | None:
    """The largest signal number received by any rank (``None``: no rank got one); one
    all-reduce, called by every rank at each step boundary."""
    if world_size() == 1:
        return received
    t = torch.tensor([received or 0], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) or None


def on_main(check: Callable[[], T], error: type[Exception] = ValueError) -> T:
    """Run ``check()`` on rank 0 only and return its result on every rank (broadcast: it
    must pickle); if it raises, every rank raises ``error`` with its message (rank 0
    re-raises the original), so that no rank waits for one that gave up."""
    if world_size() == 1:
        return check()
    failure: Exception | None = None
    box: list[object] = [None, None]
    if is_main():
        try:
            box[1] = check()
        except Exception as e:  # sent to the other ranks, then raised here
            failure = e
            box[0] = str(e)
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0] is not None:
        raise error(str(box[0]))
    return box[1]  # type: ignore[return-value]
