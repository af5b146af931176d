"""Quantization of grouped operands: the rows of a matrix in groups (the tokens of each
expert, or the rows of each expert's weight), each group quantized as its own matrix.

:func:`quantize_grouped` gives, row for row, what
``dequantize_parts(*quantize_parts(t[group], cast, cd), dtype)`` gives each group
(:mod:`lowprec.float8.quant`, the quantization of :class:`~lowprec.float8.Float8Linear`'s
operands), for all groups in one pass: the per-group ``amax`` of tensor-wise scales (and of
the column scales of groups contracted over their rows) are segment maxima, and a block
along the rows never straddles two groups, each group being padded with zero rows to
whole blocks (the core padding policy) before the whole matrix is quantized; NVFP4's
tensor-level scale is one per group (:func:`lowprec.core.scales.nv_scale`'s
``tensor_amax``). :mod:`lowprec.float8.grouped` multiplies the results.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowprec.core import kernels
from lowprec.core.bits import BYTE_FORMATS
from lowprec.core.formats import get_format
from lowprec.core.granularity import apply_scale, pad_to_blocks
from lowprec.core.rounding import to_format
from lowprec.core.scales import amax, nonfinite_scale, nv_scale
from lowprec.float8.config import CastConfig
from lowprec.float8.quant import dequantize_parts, quantize_parts

__all__ = ["group_amax", "quantize_grouped"]


def _groups(offs: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(gid, counts, starts)``: the group of each of the ``m`` rows, the rows per group
    and each group's first row, from the cumulative row ends ``offs``."""
    o = offs.long()
    counts = torch.diff(o, prepend=o.new_zeros(1))
    gid = torch.repeat_interleave(torch.arange(o.numel(), device=o.device), counts, output_size=m)
    return gid, counts, o - counts


def _segment_amax(v: Tensor, gid: Tensor, n: int) -> Tensor:
    """The maximum of the rows of ``v`` (``≥ 0``) per group, ``(n, *v.shape[1:])``; 0 for an
    empty group, NaN where a group holds NaN."""
    out = v.new_zeros((n, *v.shape[1:]))
    idx = gid.reshape(-1, *([1] * (v.dim() - 1))).expand_as(v)
    return out.scatter_reduce(0, idx, v, "amax")


def quantize_grouped(
    t: Tensor,
    offs: Tensor,
    cast: CastConfig,
    cd: int,
    dtype: torch.dtype = torch.float32,
    scale: Tensor | None = None,
) -> Tensor:
    """The dequantized values, in ``dtype``, of the 2-D ``t`` whose rows are grouped by
    ``offs`` (cumulative row ends), each group quantized as its own matrix contracted over
    its dim ``cd`` (0: the rows, 1: the columns): row for row what
    ``dequantize_parts(*quantize_parts(t[group], cast, cd), dtype)`` gives, for all groups
    in one pass. ``scale`` (tensor granularity): given scales, one for every group (one
    element) or one per group (``(E,)``: delayed scaling per expert)."""
    if t.dim() != 2:
        raise ValueError(f"t: expected a 2-D matrix, got shape {tuple(t.shape)}")
    if cd not in (0, 1):
        raise ValueError(f"cd must be 0 or 1, got {cd!r}")
    g = cast.bound_granularity(cd)
    fmt = get_format(cast.fmt)
    m, n = t.shape
    e = offs.numel()
    if scale is not None and g.kind != "tensor":
        raise ValueError(f"scale: a given scale needs tensor granularity, not {g.kind!r}")
    if g.kind == "axis" and cd == 1:  # one scale per row: the groups do not matter
        data, s, pad = quantize_parts(t, cast, 1)
        return dequantize_parts(data, s, pad, dtype)
    gid, counts, starts = _groups(offs, m)
    x = t if t.dtype == torch.float64 else t.float()
    if g.kind in ("tensor", "axis"):
        if scale is not None:
            sv = scale.reshape(-1).float().to(x.device)
            if sv.numel() not in (1, e):
                raise ValueError(f"scale: expected 1 or {e} scales, got shape {tuple(scale.shape)}")
            s = sv.expand(e)[gid].unsqueeze(1)
        elif g.kind == "tensor":  # one scale per group: amax of its rows
            row = x.abs().amax(1) if n else x.new_zeros(m)
            s = cast.scale_for(_segment_amax(row, gid, e))[gid].unsqueeze(1)
        else:  # contracted over the rows: one scale per column of each group
            s = cast.scale_for(_segment_amax(x.abs(), gid, e))[gid]
        fast = dtype in (torch.float32, torch.bfloat16) and x.dtype != torch.float64
        if fast and fmt in BYTE_FORMATS and kernels.takes(x, fmt):
            v = kernels.run_round_trip(x, s.float(), fmt, True, dtype)  # one pass, same bits
            if v is not None:
                return v
        q = to_format(x / s, fmt, saturate=True)
        return (q.float() * s).to(dtype)
    # Blocks: a block along the rows never straddles two groups: each group is padded
    # with zero rows to whole blocks (the core padding policy), so that blocks tile it as
    # quantize_parts tiles the group alone; the columns are padded by quantize_parts.
    p = g.padded_shape((1, 1))[0]
    dest: Tensor | None = None
    xp, gp = t, gid
    if p > 1:
        pc = (counts + p - 1) // p * p
        pstarts = torch.cumsum(pc, 0) - pc
        mp = int(pc.sum())
        dest = torch.arange(m, device=t.device) - starts[gid] + pstarts[gid]
        xp = t.new_zeros(mp, n).index_copy_(0, dest, t)
        gp = torch.repeat_interleave(torch.arange(e, device=t.device), pc, output_size=mp)
    if g.kind != "nv":
        data, s, pad = quantize_parts(xp, cast, cd)
        v = dequantize_parts(data, s, pad, dtype)
    else:  # NVFP4: the tensor-level scale is one per group
        xb = pad_to_blocks(xp if xp.dtype == torch.float64 else xp.float(), g)
        a = amax(xb, g)
        fin = torch.where(torch.isfinite(a), a, 0.0)
        rows_per = xb.shape[0] // max(a.shape[0], 1)
        ga = gp[:: max(rows_per, 1)][: a.shape[0]] if a.shape[0] else gp[:0]
        t_amax = _segment_amax(fin.amax(1), ga, e)[ga].unsqueeze(1) if a.numel() else None
        s = nonfinite_scale(nv_scale(a, fmt, t_amax, cast.margin), a, fmt, "nv")
        q = to_format(apply_scale(xb, s, op="div"), fmt, saturate=True)
        v = apply_scale(q.float(), s)[: xp.shape[0], :n].to(dtype)
    return v if dest is None else v[dest]


def group_amax(t: Tensor, offs: Tensor) -> Tensor:
    """``amax`` of each group of rows of the 2-D ``t`` (``offs``: cumulative row ends),
    ``(E,)`` float32; 0 for an empty group, NaN where a group holds NaN."""
    gid, _, _ = _groups(offs, t.shape[0])
    row = t.abs().amax(1).float() if t.shape[1] else t.new_zeros(t.shape[0], dtype=torch.float32)
    return _segment_amax(row, gid, offs.numel())
