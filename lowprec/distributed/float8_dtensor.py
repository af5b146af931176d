"""``Float8Linear`` on DTensor parameters: tensor parallelism with local FP8 GEMMs.

:func:`dtensor_forward` is registered (:func:`lowprec.float8.linear.register_weight_forward`)
as the forward of every ``Float8Linear`` whose weight is a DTensor, when
:mod:`lowprec.distributed` is imported (``import lowprec`` imports it). It is a function of
the layer's public surface only — its GEMM (:meth:`~lowprec.float8.Float8Linear.gemm`, given
the amax reducer of the mesh) and its scaling state — so ``lowprec.float8`` knows nothing
of DTensor.

``ColwiseParallel`` / ``RowwiseParallel`` (``torch.distributed.tensor.parallel``) turn a
linear's weight (and bias) into DTensors sharded over a device mesh and hand the layer
DTensor inputs. The float8 GEMMs are not DTensor ops, so the layer computes on the local
shards and states the placement of its output, per mesh dimension:

==================  ==================  ==================  =============================
weight              input (redistributed to)  output        GEMM on the shards
==================  ==================  ==================  =============================
``Shard(0)`` (col)  ``Replicate``       ``Shard(-1)``       ``x · W_rᵀ`` = columns of y
``Shard(1)`` (row)  ``Shard(-1)``       ``Partial(sum)``    ``x_r · W_rᵀ``, summed later
``Replicate``       as given            as the input        ``x_r · Wᵀ``
==================  ==================  ==================  =============================

The local GEMMs' gradients are stated, not assumed (``to_local(grad_placements=...)``):
the input gradient ``g_r · W_r`` of a column-sharded weight is a partial sum over the ranks
(``Partial``; a plain replicated input is wrapped so that its gradient is summed too, and
an FP8-gathered :class:`~lowprec.core.tensor.ScaledTensor` input receives the partial sums,
which the gather's backward reduce-scatters); the weight gradient ``g_rᵀ · x_r`` of a
replicated weight whose input is sharded over a token dimension is a partial sum over that
mesh dimension. Every other local gradient is the shard of its tensor.

The bias is added as a DTensor (sharded with the columns, or replicated after the
partial sums), so DTensor adds it exactly once.

**Scales of sharded tensors.** A tensor-wise scale needs the ``amax`` of the whole tensor,
not of the local shard: the GEMM is given :class:`~lowprec.distributed.amax.MaxReducer`
over the mesh, which reduces the shard's ``amax`` with ``MAX`` (one ``all_reduce`` of one
number), and the role's scaler (dynamic, delayed or static) uses and records that ``amax``.
Then every shard is quantized exactly as one process quantizes the whole tensor, and the
output equals the one-process output up to the order of float32 summation. The module's
buffers, which ``distribute_module`` replicates as DTensors, are kept as plain local
tensors (:meth:`~lowprec.float8.Float8Linear.bind_scaling_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from lowprec.core.tensor import ScaledTensor
from lowprec.core.warn import warn_once
from lowprec.distributed.amax import MaxReducer
from lowprec.float8.config import Float8Config
from lowprec.float8.linear import Float8Linear, register_weight_forward

__all__ = ["cut_tiles", "dtensor_forward"]

_log = logging.getLogger(__name__)
_BLOCKED = ("block", "mx", "nv")
_GEMMS = ("forward", "input_grad", "weight_grad")


def cut_tiles(config: Float8Config, shape: Sequence[int], shards: Sequence[int]) -> str | None:
    """Why the shards of a ``shape = (out_features, in_features)`` weight split ``shards =
    (n_out, n_in)`` ways cut the scaling blocks of ``config`` (``None`` where they do not).

    A block scale (``block:1xB``, ``RxC`` tiles, MX and NVFP4 blocks) is exact under tensor
    parallelism only where every block lies inside one shard: then each rank quantizes its
    operands as one process does. A sharded dimension of length ``n`` split ``k`` ways gives
    shards of ``ceil(n / k)`` (the last may be shorter); a block of extent ``L`` along it is
    cut unless ``ceil(n / k)`` is a multiple of ``L``. Every operand of every GEMM of the
    layer contracts over, or is tiled along, both features (the weight's tiles, the input's
    blocks along ``in_features`` in forward, the output gradient's along ``out_features``
    in the input-gradient GEMM), so the largest block extent of any cast of any GEMM is the
    one checked."""
    if len(shape) != 2 or len(shards) != 2:
        raise ValueError(f"shape and shards must be pairs, got {tuple(shape)} and {tuple(shards)}")
    extent = 1
    for gemm in _GEMMS:
        sub = config.for_gemm(gemm)
        for cast in (sub.input, sub.weight, sub.grad_output):
            for cd in (0, 1):
                g = cast.bound_granularity(cd)
                if g.kind in _BLOCKED:
                    extent = max(extent, *g.block)
    if extent == 1:
        return None
    for name, n, k in zip(("out_features", "in_features"), shape, shards, strict=True):
        chunk = -(-int(n) // int(k))
        if k > 1 and chunk % extent:
            return (
                f"{name} = {n} split {k} ways gives shards of {chunk}, not whole "
                f"{extent}-wide scaling blocks"
            )
    return None


def _is_shard(p: Placement, dim: int, ndim: int) -> bool:
    return isinstance(p, Shard) and p.dim % ndim == dim


def _input_grad_placements(w_pl: Sequence[Placement], x_pl: Sequence[Placement]) -> list[Placement]:
    """The placements of the local GEMM's input gradient ``g_r · W_r``: where the weight is
    column-sharded (``Shard(0)``), each rank contracts only its own output columns, so the
    local gradient is a partial sum (``Partial``), summed over the ranks when the gradient
    is redistributed to the input's placement; elsewhere it is the input's own shard."""
    return [Partial() if _is_shard(wp, 0, 2) else xp for wp, xp in zip(w_pl, x_pl, strict=True)]


def _weight_grad_placements(
    w_pl: Sequence[Placement], x_pl: Sequence[Placement], nd: int
) -> list[Placement]:
    """The placements of the local weight gradient ``g_rᵀ · x_r``: where the weight is
    replicated and the input sharded over a token dimension (data parallel over that mesh
    dimension), each rank contracts only its own tokens, so the gradient is a partial sum
    (``Partial``); elsewhere it is the weight's own shard."""
    return [
        Partial()
        if isinstance(wp, Replicate) and isinstance(xp, Shard) and not _is_shard(xp, nd - 1, nd)
        else wp
        for wp, xp in zip(w_pl, x_pl, strict=True)
    ]


@cache
def _reducer(mesh: DeviceMesh) -> MaxReducer:
    """One reducer per mesh (the GEMM's spec holds it: the same object on every call)."""
    return MaxReducer(mesh)


def _localize_buffers(layer: Float8Linear) -> None:
    """``distribute_module`` replicates buffers as DTensors: keep the scaling state plain
    (each rank's own record, reduced by the scaling sync) and rebind the scalers."""
    local = {n: b.to_local() for n, b in layer.scaling_state().items() if isinstance(b, DTensor)}
    if local:
        layer.bind_scaling_state(local)


def dtensor_forward(layer: Float8Linear, x: Tensor, w: Tensor) -> Tensor:
    """The forward of ``layer`` whose GEMM weight ``w`` is a DTensor (see the module
    docstring). ``x``: a DTensor, or a local tensor that is the same on every rank (a
    :class:`~lowprec.core.tensor.ScaledTensor` gathered in FP8 included)."""
    if not isinstance(w, DTensor):
        raise TypeError(f"w must be a DTensor, got {type(w).__name__}")
    _localize_buffers(layer)
    mesh, nd = w.device_mesh, x.dim()
    for p in w.placements:
        if not (isinstance(p, Replicate) or _is_shard(p, 0, 2) or _is_shard(p, 1, 2)):
            raise ValueError(
                f"weight: placement {p} is not supported (Shard(0), Shard(1) or Replicate)"
            )
    if isinstance(x, DTensor):
        need: list[Placement] = []
        for wp, xp in zip(w.placements, x.placements, strict=True):
            if _is_shard(wp, 0, 2):
                need.append(Replicate())
            elif _is_shard(wp, 1, 2):
                need.append(Shard(nd - 1))
            elif isinstance(xp, Partial) or _is_shard(xp, nd - 1, nd):
                need.append(Replicate())
            else:
                need.append(xp)
        if tuple(need) != tuple(x.placements):
            x = x.redistribute(mesh, need)
        x_pl, x_shape = need, x.shape
        x_local = x.to_local(grad_placements=_input_grad_placements(w.placements, need))
    else:
        if any(_is_shard(p, 1, 2) for p in w.placements):
            raise ValueError(
                "x: a weight sharded over in_features (RowwiseParallel) needs a DTensor input "
                "sharded on its last dim"
            )
        x_pl, x_shape, x_local = [Replicate()] * mesh.ndim, x.shape, x
        if not isinstance(x, ScaledTensor) and any(_is_shard(p, 0, 2) for p in w.placements):
            # A plain replicated input: its gradient's partial sums are summed over the
            # ranks (the backward of from_local to Replicate), as for a DTensor input.
            whole = DTensor.from_local(x, mesh, x_pl, run_check=False)
            x_local = whole.to_local(grad_placements=_input_grad_placements(w.placements, x_pl))
    y_pl: list[Placement] = []
    for wp, xp in zip(w.placements, x_pl, strict=True):
        if _is_shard(wp, 0, 2):
            y_pl.append(Shard(nd - 1))
        elif _is_shard(wp, 1, 2):
            y_pl.append(Partial())
        else:
            y_pl.append(xp)
    sharded = "".join(
        role
        for role, pls in (("x", x_pl), ("w", w.placements), ("g", y_pl))
        if any(isinstance(p, Shard) for p in pls)
    )
    _warn_cut_tiles(layer, w)
    w_local = w.to_local(grad_placements=_weight_grad_placements(w.placements, x_pl, nd))
    y_local = layer.gemm(x_local, w_local, _reducer(mesh), sharded)
    shape = torch.Size((*x_shape[:-1], w.shape[0]))
    y = DTensor.from_local(
        y_local, mesh, y_pl, run_check=False, shape=shape, stride=_contiguous(shape)
    )
    b: Tensor | None = layer.bias
    if b is None:
        return y
    if not isinstance(b, DTensor):
        b = DTensor.from_local(b, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return y + b.to(y.dtype)


def _warn_cut_tiles(layer: Float8Linear, w: DTensor) -> None:
    """Warn once per layer shape where the weight's shards cut the recipe's scaling blocks
    (:func:`cut_tiles`): each rank then scales its part of a block by its own ``amax``, a
    rounding that differs from one process's."""
    shards = [1, 1]
    for size, p in zip(w.device_mesh.shape, w.placements, strict=True):
        for d in (0, 1):
            if _is_shard(p, d, 2):
                shards[d] *= size
    if shards == [1, 1]:
        return
    why = cut_tiles(layer.recipe, w.shape, shards)
    if why is not None:
        warn_once(
            _log,
            f"float8-tp-tiles:{layer.recipe.name}:{tuple(w.shape)}:{tuple(shards)}",
            "tensor parallelism: a %dx%d %s weight's %s; each rank scales its part of a cut "
            "block by its own amax, so the run differs from one process by a rounding",
            w.shape[0],
            w.shape[1],
            layer.recipe.name,
            why,
        )


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(strides))


register_weight_forward(DTensor, dtensor_forward)
