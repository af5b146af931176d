"""The same float8 scaling state on every rank: ``MAX`` reduction of amax histories and
static calibration maxima.

Each rank records the ``amax`` of *its* activations and gradients in the delayed histories
(``<role>_amax_history``) and static calibration maxima (``<role>_static_amax``) of its
``Float8Linear`` layers (and the per-expert histories of ``Float8Experts``). Left alone,
the ranks' scales drift apart and every rank's checkpoint is different. Because

    amax(x_1 ∪ … ∪ x_R) = max_r amax(x_r),

an element-wise ``all_reduce(MAX)`` of the histories turns each rank's record of its own
shard into the record of the whole global batch, which is what one process would have
recorded for it (for tensor-parallel shards too: the ``amax`` of a tensor split over ranks
is the ``max`` of the shards' ``amax``). After the reduction all ranks hold identical state,
compute identical scales, and any rank's checkpoint is *the* checkpoint.

:func:`sync_scaling_state` does it now, with one ``all_reduce`` of all buffers of the model
concatenated; :func:`attach_scaling_sync` does it automatically at the end of every
backward pass (after the ``grad_output`` histories were updated), through autograd's
end-of-backward callback (the mechanism FSDP uses for its own post-backward work).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from lowprec.float8.experts import Float8Experts
from lowprec.float8.linear import Float8Linear

__all__ = ["attach_scaling_sync", "scaling_state", "sync_scaling_state"]


def scaling_state(model: nn.Module) -> dict[str, Tensor]:
    """The float8 scaling buffers of ``model`` by state-dict name (histories and static
    maxima of every ``Float8Linear``, per-expert histories of every ``Float8Experts``), as
    the tensors themselves (no copy)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    out: dict[str, Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, Float8Experts):  # (history_len, E) per weight and role
            for key in m.scaling_buffers():
                out[f"{name}.{key}" if name else key] = m.get_buffer(key)
        if not isinstance(m, Float8Linear):
            continue
        state = m.scaling_state()
        # Tensor parallelism replicates buffers as DTensors: keep the local tensors.
        local = {k: t.to_local() for k, t in state.items() if isinstance(t, DTensor)}
        if local:
            m.bind_scaling_state(local)
            state = m.scaling_state()
        for key, t in state.items():
            out[f"{name}.{key}" if name else key] = t
    return out


def sync_scaling_state(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """``all_reduce(MAX)`` of every float8 scaling buffer of ``model`` over ``group``
    (default: the whole world), in one collective; frozen calibrated static scales are
    recomputed from the reduced maxima. Returns the number of elements reduced.

    Call it on every rank (it is a collective). Outside ``torch.distributed`` (or on one
    rank) it is a no-op.
    """
    bufs = list(scaling_state(model).values())
    if not bufs or not dist.is_available() or not dist.is_initialized():
        return 0
    if dist.get_world_size(group) == 1:
        return 0
    flat = torch.cat([b.detach().reshape(-1).float() for b in bufs])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    with torch.no_grad():
        for b, part in zip(bufs, torch.split(flat, [b.numel() for b in bufs]), strict=True):
            b.copy_(part.view_as(b))
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.refresh_static_scales()  # the scales of the reduced maxima
    return int(flat.numel())


class _Sync:
    """Forward hook: queue one :func:`sync_scaling_state` for the end of the backward pass
    that the outputs of this forward start."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        self.model, self.group = model, group
        self.queued = False
        self.count = 0

    def _run(self) -> None:
        self.queued = False
        sync_scaling_state(self.model, self.group)
        self.count += 1

    def _on_grad(self, grad: Tensor) -> Tensor:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run)
        return grad

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in tree_leaves(output):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(self._on_grad)  # type: ignore[no-untyped-call]


def attach_scaling_sync(
    model: nn.Module, group: dist.ProcessGroup | None = None
) -> RemovableHandle:
    """Reduce ``model``'s float8 scaling state with ``MAX`` over ``group`` at the end of
    every backward pass (once per backward, one collective for all layers).

    Attach it to the model you call (before or after ``fully_shard`` / ``DDP``; with DDP
    attach it to the wrapped module). Calibration that runs no backward is reduced by an
    explicit :func:`sync_scaling_state` after :func:`lowprec.float8.calibrate`. Returns the
    hook's handle (``.remove()`` detaches it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    scaling_state(model)  # tensor-parallel DTensor buffers become plain local tensors now
    return model.register_forward_hook(_Sync(model, group))
