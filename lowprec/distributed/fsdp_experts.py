"""FP8 all-gather of the 3-D expert weights of :class:`~lowprec.float8.Float8Experts`.

The helper of :mod:`lowprec.distributed.float8_fsdp` for MoE experts modules (as
:mod:`~lowprec.distributed.fsdp_blocks` is for block layouts). An experts module holds
``w (E, N, K)`` (``gate_up_proj``, ``down_proj``; ``(E, K, N)`` when transposed) and its
grouped GEMMs quantize expert ``e``'s matrix with its own tensor-wise scale

    s_e = amax(W_e) · 2^margin / fmt.max      (dynamic; delayed: from the history of amax(W_e))

FSDP2 shards the parameter on dim 0, the experts: rank ``r`` holds experts
``[r·c, (r+1)·c)`` with ``c = ⌈E/R⌉`` (the last ranks fewer, or none). Each ``amax(W_e)``
is then local to one rank; the global vector is the element-wise ``max`` over the ranks of
each rank's vector (its own experts' ``amax``, zeros elsewhere), so the scales join the one
``all_reduce(MAX)`` of :mod:`~lowprec.distributed.float8_fsdp` (a parameter sharded on
another dim gives each rank a partial ``amax`` of every expert: the same ``max`` is the
whole one). The all-gather moves ``Q(W_r / s)`` (1 byte per element, ``s`` broadcast over
each expert's rows) and the post-all-gather hands the experts module
``ScaledTensor(Q(W / s), s)`` with ``s`` of shape ``(E, 1, 1)``. Because the scale is that
of one process and rounding is element-wise, the gathered payload is the one a single
process computes. ``Float8Experts`` takes ``s`` as its weight scales; the emulated grouped
GEMM quantizes the values ``Q(W_e / s_e) · s_e`` with ``s_e`` again, which gives back
``Q(W_e / s_e)`` exactly (their relative error, at most ``2⁻⁸`` in BF16, is far below half a
step of the format), so no second rounding occurs.

Eligible (:func:`experts_reason` is ``None``): the grouped config's weight cast is
tensor-wise with dynamic or delayed scaling, and the forward and input-gradient GEMMs
(the two that read the weight) are in FP8 with that cast. Row-wise, block, MX and NVFP4
weights (whose scales are not one per expert), static casts and GEMMs with their own
weight cast or in high precision are gathered in ``param_dtype`` (one WARNING names them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lowprec.core.formats import get_format
from lowprec.core.rounding import storage_dtype, to_format
from lowprec.core.tensor import ScaledTensor, register_rule
from lowprec.float8.experts import Float8Experts

__all__ = ["expert_weight_names", "experts_reason", "local_amax", "post_gather", "pre_gather"]

aten = torch.ops.aten
DOMAIN = "float8_fsdp_experts"


def expert_weight_names(m: Float8Experts) -> list[str]:
    """The names of ``m``'s 3-D expert weights (``gate_up_proj``/``up_proj``, ``down_proj``)."""
    return [n for n, p in m._parameters.items() if isinstance(p, Tensor) and p.dim() == 3]


def experts_reason(m: Float8Experts) -> str | None:
    """Why ``m``'s weights cannot be all-gathered in FP8 (module docstring), ``None`` when
    they can."""
    r = m.grouped_recipe
    c = r.cast("weight")
    if c.bound_granularity(0).kind != "tensor" or c.scaling not in ("dynamic", "delayed"):
        return f"weight {c.describe()}: not one dynamic or delayed scale per expert"
    for gemm in ("forward", "input_grad"):
        if gemm in r.high_precision_gemms:
            return f"{gemm} GEMM in high precision"
        if r.own_cast(gemm, "weight"):
            return f"{gemm} GEMM quantizes the weight with its own cast"
    return None


def _rows(n: int, mesh: DeviceMesh) -> int:
    """The experts of every (padded) shard: ``⌈n / R⌉``."""
    return -(-n // mesh.size())


def local_amax(hp: Tensor, experts: int, dim0_sharded: bool, mesh: DeviceMesh) -> Tensor:
    """This rank's contribution ``(experts,)`` float32 to the per-expert ``amax``: its
    experts' ``amax`` at their global index (``dim0_sharded``), else the ``amax`` of its
    part of every expert; zeros elsewhere (module docstring)."""
    out = torch.zeros(experts, dtype=torch.float32, device=hp.device)
    if hp.numel() == 0:
        return out
    a = hp.detach().abs().amax(dim=(1, 2)).float()
    lo = mesh.get_local_rank() * _rows(experts, mesh) if dim0_sharded else 0
    out[lo : lo + a.shape[0]] = a
    return out


def pre_gather(
    hp: Tensor, scale: Tensor, fmt: str, mesh: DeviceMesh, outer_size: torch.Size
) -> tuple[tuple[Tensor, ...], Any]:
    """The all-gather input of the local experts ``hp`` (already in ``param_dtype``):
    ``Q(W_r / s)`` as ``uint8``, padded to the padded shard's experts; metadata: the
    scales of all experts and the format."""
    e = int(outer_size[0])
    rows = _rows(e, mesh)
    lo = mesh.get_local_rank() * rows
    s = scale[lo : lo + hp.shape[0]].reshape(-1, 1, 1)
    data = to_format(hp / s, fmt, saturate=True) if hp.numel() else hp.to(storage_dtype(fmt))
    if hp.shape[0] != rows:  # FSDP2 pads every shard to the same size
        padded = data.new_zeros((rows, *hp.shape[1:]))
        padded[: hp.shape[0]] = data
        data = padded
    return (data.view(torch.uint8),), ("experts", scale, fmt)


def post_gather(
    outputs: tuple[Tensor, ...], meta: Any, param_dtype: torch.dtype, out: Tensor | None
) -> tuple[Tensor, tuple[Tensor, ...]] | None:
    """The gathered experts as ``ScaledTensor(Q(W / s), s)``, ``s`` of shape ``(E', 1, 1)``
    for the ``E'`` gathered (padded) experts, padded with ones; FSDP2 then views it at the
    unpadded size (:func:`_as_strided`). A re-gather into ``out`` refreshes its scale."""
    (raw,) = outputs
    _, scale, fmt = meta
    if out is not None:
        assert isinstance(out, ScaledTensor)
        out.scale.copy_(scale[: out.scale.shape[0]].reshape(out.scale.shape))
        return None
    data = raw.view(storage_dtype(fmt))
    s = scale.new_ones(data.shape[0])
    s[: scale.numel()] = scale
    st = ScaledTensor._wrap(data, s.reshape(-1, 1, 1), param_dtype, get_format(fmt).name, DOMAIN)
    return st, (data,)


@register_rule(aten.as_strided.default, domain=DOMAIN)
def _as_strided(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    """FSDP2 views the gathered experts at their unpadded size (the leading experts): the
    data is viewed and the per-expert scales cut to those experts."""
    x: ScaledTensor = args[0]
    data = func(x.qdata, *args[1:], **kwargs)
    if data.dim() != 3 or data.shape[0] > x.shape[0] or data.shape[1:] != x.shape[1:]:
        raise NotImplementedError(f"as_strided of gathered experts to {tuple(data.shape)}")
    return ScaledTensor._wrap(data, x.scale[: data.shape[0]], *x._meta())
