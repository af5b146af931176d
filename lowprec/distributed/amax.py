"""``amax`` across processes: the reducers the core scalers take
(:data:`lowprec.core.scalers.AmaxReducer`).

The ``amax`` of a tensor split over processes is the ``max`` of the pieces' ``amax``:

    amax(x_1 ∪ … ∪ x_R) = max_r amax(x_r),

so one element-wise ``all_reduce(MAX)`` of the local ``amax`` (a number for a tensor-wise
scale, a vector for row-wise ones) gives every process the ``amax`` one process would have
computed on the whole tensor. :class:`MaxReducer` is that reduction over a device mesh (its
every dimension, as tensor parallelism shards a tensor over them) or over a process group;
:func:`mesh_amax` is the ``amax`` of a sharded tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

__all__ = ["MaxReducer", "mesh_amax"]


class MaxReducer:
    """An :data:`~lowprec.core.scalers.AmaxReducer`: ``all_reduce(MAX)`` of a local
    ``amax`` over every dimension of ``mesh``, or over ``group`` (a process group; ``None``
    with no mesh: the whole world). Outside ``torch.distributed`` it returns its input.

    Example: ``DelayedScaler("e4m3fn", reducer=MaxReducer(group=None))`` keeps one amax
    history for a data-parallel activation, the same on every rank.
    """

    def __init__(
        self, mesh: DeviceMesh | None = None, *, group: dist.ProcessGroup | None = None
    ) -> None:
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
        if mesh is not None and group is not None:
            raise ValueError("give mesh or group, not both")
        self.mesh = mesh
        self.group = group

    def __call__(self, a: Tensor) -> Tensor:
        if not isinstance(a, Tensor):
            raise TypeError(f"amax must be a tensor, got {type(a).__name__}")
        a = a.detach().float()
        if self.mesh is not None:
            whole = DTensor.from_local(
                a, self.mesh, [Partial("max")] * self.mesh.ndim, run_check=False
            )
            return whole.full_tensor()
        if not dist.is_available() or not dist.is_initialized():
            return a
        out = a.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    def __repr__(self) -> str:
        where = f"mesh={self.mesh}" if self.mesh is not None else f"group={self.group}"
        return f"MaxReducer({where})"


def mesh_amax(t: Tensor, mesh: DeviceMesh) -> Tensor:
    """``max |t|`` over the whole tensor whose local shard on this rank is ``t``: the local
    ``amax`` reduced with ``MAX`` over every dimension of ``mesh`` (float32, 0-dim)."""
    local = t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
    return MaxReducer(mesh)(local)
