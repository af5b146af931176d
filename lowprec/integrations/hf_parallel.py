"""How :class:`~lowprec.integrations.transformers.LowprecTrainer` runs over several
processes: DDP, or FSDP2 sharded by lowprec itself.

Which one. :func:`parallel_mode` reads what ``accelerate launch`` (or ``torchrun`` with a
``TrainingArguments``) asks for: ``"fsdp"`` when FSDP is configured, by Accelerate's
launcher (``--use_fsdp --fsdp_version 2``, a config file: ``ACCELERATE_USE_FSDP`` and
``FSDP_VERSION`` in the environment) or by ``TrainingArguments(fsdp=True,
fsdp_config={"version": 2})``; else ``"ddp"`` with more than one process; ``None`` on one.
FSDP1, CPU offload, ``reshard_after_forward=False`` and FSDP activation checkpointing are
refused (``ValueError`` naming the setting): lowprec's FSDP2 would silently not do them.

FSDP2 is lowprec's own (:func:`lowprec.distributed.prepare` with ``"fsdp"``: the recipe's
technique, rank 0's converted model broadcast to every rank, then ``fully_shard`` on every
block and the root with the FP32 shards as the masters and the recipe's dtype as FSDP2's
``MixedPrecisionPolicy``, FP8 all-gather of float8 weights, u-μP's ``sqrt(N)`` gradient
divisor, the generator broadcast). The ``Trainer``'s Accelerator is built without its
FSDP plugin (:func:`accelerator_without_fsdp`) and the sharded model is marked as
prepared, so Accelerate neither wraps it in DDP nor runs its own FSDP2 preparation, which
would re-map the optimizer's parameters by their storage pointers (a float8 weight's FP8
all-gather subclass has none of its own) and save checkpoints with its own FSDP state
dicts. On the CPU Accelerate never enters its FSDP mode anyway; on GPUs it would.

The broadcast (``prepare(sync_module_states=True)``, as DDP does at construction and
Accelerate's ``sync_module_states``) makes every rank start from rank 0's model: under
``accelerate launch --use_fsdp`` HF's ``cpu_ram_efficient_loading`` (on by default) loads
pretrained weights on rank 0 only, and a u-μP conversion draws its init from each rank's
own generator. A model left on the meta device is refused (:func:`check_materialized`).

Checkpoints of a sharded run (:func:`save_sharded`, :func:`load_sharded`): a DCP directory
``lowprec_fsdp/`` in each checkpoint folder, written by every rank with
:func:`lowprec.distributed.checkpoint.save` (the parameter shards, the buffers such as
amax histories, the optimizer's sharded states and generator, the loss scaler, the
calibration progress, the recipe), and the scheduler's ``scheduler.pt``; the ``Trainer``
adds the scaler, the RNG states of every rank and its own state. The unsharded model is
gathered on every rank (:func:`lowprec.distributed.checkpoint.full_state_dict`) and written
by rank 0 with ``save_pretrained``, as ``trainer.save_model()`` writes it too.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from lowprec.recipes import Prepared

__all__ = [
    "FSDP_DIR",
    "accelerator_without_fsdp",
    "check_materialized",
    "check_sharded",
    "load_sharded",
    "parallel_mode",
    "save_sharded",
]

FSDP_DIR = "lowprec_fsdp"
"""The DCP directory of a sharded run inside each ``Trainer`` checkpoint folder."""
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own file name
_TRUE = ("1", "true", "yes", "on")


def _flag(value: Any) -> bool:
    return str(value).strip().lower() in _TRUE


def _fsdp_request(args: Any) -> tuple[str, int, bool, bool, bool] | None:
    """``(source, version, offload, reshard_after_forward, activation_checkpointing)`` of
    the FSDP that ``args`` or Accelerate's launcher asks for; ``None`` if none."""
    if getattr(args, "fsdp", None):
        plugin = dict(getattr(args, "fsdp_plugin_args", None) or {})
        return (
            "args.fsdp_config",
            int(plugin.get("fsdp_version", 2)),
            _flag(plugin.get("cpu_offload", False)),
            _flag(plugin.get("reshard_after_forward", True)),
            _flag(plugin.get("activation_checkpointing", False)),
        )
    env = os.environ
    if not _flag(env.get("ACCELERATE_USE_FSDP", "false")):
        return None
    try:
        version = int(env.get("FSDP_VERSION", "1"))
    except ValueError:
        raise ValueError(f"FSDP_VERSION: expected 1 or 2, got {env['FSDP_VERSION']!r}") from None
    return (
        "Accelerate's FSDP config (ACCELERATE_USE_FSDP, FSDP_*)",
        version,
        _flag(env.get("FSDP_OFFLOAD_PARAMS", "false")),
        version != 2 or _flag(env.get("FSDP_RESHARD_AFTER_FORWARD", "true")),
        _flag(env.get("FSDP_ACTIVATION_CHECKPOINTING", "false")),
    )


def parallel_mode(args: Any) -> Literal["ddp", "fsdp"] | None:
    """``"fsdp"``, ``"ddp"`` or ``None`` (one process) for the ``TrainingArguments``
    ``args`` under the current launcher (module docstring). ``ValueError`` for an FSDP
    setting lowprec does not honour, or FSDP on one process."""
    request = _fsdp_request(args)
    world = int(args.world_size)
    if request is None:
        return "ddp" if world > 1 else None
    source, version, offload, reshard, checkpointing = request
    if version != 2:
        raise ValueError(
            f"{source}: FSDP version {version}; lowprec recipes shard with FSDP2 only "
            "(accelerate launch --use_fsdp --fsdp_version 2, or "
            "TrainingArguments(fsdp=True, fsdp_config={'version': 2}))"
        )
    if offload:
        raise ValueError(
            f"{source}: CPU offload is not supported with lowprec recipes (the FP32 shards "
            "are the master weights, updated where the model runs)"
        )
    if not reshard:
        raise ValueError(
            f"{source}: reshard_after_forward=False is not supported; lowprec's FSDP2 "
            "reshards every block after its forward"
        )
    if checkpointing:
        raise ValueError(
            f"{source}: FSDP activation checkpointing is not supported with lowprec recipes"
        )
    if world < 2:
        raise ValueError(
            f"{source}: FSDP2 over {world} process has nothing to shard; launch 2 or more "
            "(accelerate launch --num_processes N, torchrun --nproc-per-node N) or drop the "
            "FSDP config"
        )
    return "fsdp"


@contextlib.contextmanager
def accelerator_without_fsdp(args: Any) -> Iterator[None]:
    """While the ``Trainer`` builds its Accelerator: no FSDP plugin (neither
    ``args.fsdp_plugin_args`` nor ``ACCELERATE_USE_FSDP``), so that Accelerate treats the
    model lowprec sharded as an already prepared multi-process model (module docstring).
    Both are restored afterwards."""
    env = os.environ.get("ACCELERATE_USE_FSDP")
    plugin = getattr(args, "fsdp_plugin_args", None)
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    args.fsdp_plugin_args = None
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("ACCELERATE_USE_FSDP", None)
        else:
            os.environ["ACCELERATE_USE_FSDP"] = env
        args.fsdp_plugin_args = plugin


def check_materialized(model: nn.Module) -> None:
    """``ValueError`` if a parameter or buffer of ``model`` is on the meta device (never
    loaded on this rank): the broadcast from rank 0 needs real tensors of the right shape."""
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if t.is_meta:
            raise ValueError(
                f"model: {name} is on the meta device on rank {dist.get_rank()}; create or "
                "load the model's tensors on every rank (rank 0's values replace them)"
            )


def save_sharded(
    prepared: Prepared, scheduler: LRScheduler | None, output_dir: str, should_save: bool
) -> None:
    """Every rank: ``prepared``'s sharded state into ``output_dir/lowprec_fsdp`` (DCP), and
    on the writing rank the scheduler's state into ``output_dir/scheduler.pt``."""
    from lowprec.distributed import checkpoint

    checkpoint.save(prepared, os.path.join(output_dir, FSDP_DIR))
    if should_save and scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def check_sharded(ckpt: str) -> str:
    """The ``lowprec_fsdp`` directory of the checkpoint folder ``ckpt``; ``ValueError`` if
    it has none (a DDP or one-process checkpoint)."""
    path = os.path.join(ckpt, FSDP_DIR)
    if not os.path.isdir(path):
        raise ValueError(
            f"resume_from_checkpoint: {ckpt} has no {FSDP_DIR}/ (not saved by a lowprec "
            "trainer under FSDP2); a DDP or one-process checkpoint resumes under DDP or on "
            "one process"
        )
    return path


def load_sharded(prepared: Prepared, scheduler: LRScheduler | None, ckpt: str) -> None:
    """Every rank: restore what :func:`save_sharded` wrote in the checkpoint folder
    ``ckpt``. ``ValueError`` if it holds no ``lowprec_fsdp`` (:func:`check_sharded`) or
    was saved with another recipe."""
    from lowprec.distributed import checkpoint

    checkpoint.load(prepared, check_sharded(ckpt))
    sched = os.path.join(ckpt, SCHEDULER_NAME)
    if scheduler is not None and os.path.isfile(sched):
        scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))
