"""GEMM operands in a narrow format, and the scaled matmul (hardware kernel or emulation).

An :class:`Operand` is a 2-D matrix ``t ≈ data × scale`` quantized for one GEMM, with its
scale laid out relative to the *contracted* dimension ``cd`` (see :mod:`.recipe`).

The scaled matmul computes, for ``A (M×K)`` contracted over dim 1 and ``B (K×N)`` over 0,

    C = (A_data · B_data) ⊙ (s_A s_Bᵀ)                  (tensor / axis scales)
    C = Σ_blocks (A_data,blk · B_data,blk) · s_A,blk · s_B,blk   (block / MX scales)

The hardware kernel (``torch._scaled_mm``) is used only on CUDA with compute capability 8.9
or newer; elsewhere the *emulation* computes the same formula: the quantized values are
real (rounded by :func:`lowprec.core.rounding.to_format`), upcast exactly to float32, multiplied
(products of 8-bit values are exact in float32) and accumulated in float32. The CPU
``_scaled_mm`` kernel is never used: it is thousands of times slower than a bf16 matmul.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from lowprec.core.formats import get_format
from lowprec.core.granularity import Granularity, apply_scale, pad_to_blocks
from lowprec.core.rounding import quantize, to_format
from lowprec.core.scales import amax, compute_scale, mx_scale
from lowprec.core.tensor import ScaledTensor
from lowprec.core.warn import warn_once
from lowprec.float8.recipe import CastConfig

__all__ = ["Operand", "dequantize", "hardware_fp8_available", "quantize_operand", "scaled_mm"]

log = logging.getLogger(__name__)
_E4M3 = get_format("e4m3fn")
_HW_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class Operand:
    """``data × scale`` for one GEMM; ``shape`` is the unpadded shape of the matrix.

    ``data`` may be zero-padded (block kinds) to a multiple of the block; ``scale`` applies
    to the padded ``data`` with block-wise broadcasting
    (:func:`lowprec.core.granularity.apply_scale`).
    """

    data: Tensor
    scale: Tensor
    kind: str
    cd: int
    shape: tuple[int, int]


def quantize_operand(t: Tensor, cast: CastConfig, cd: int, scale: Tensor | None = None) -> Operand:
    """Quantize the 2-D ``t`` for a GEMM that contracts its dimension ``cd`` (0 or 1).

    ``scale`` (tensor granularity only) is a scale chosen elsewhere (delayed or static
    scaling); without it the scale comes from ``t`` itself. Values are divided by the scale
    in float32 and rounded to nearest with saturation.
    """
    if t.dim() != 2:
        raise ValueError(f"t: expected a 2-D matrix, got shape {tuple(t.shape)}")
    fmt = get_format(cast.fmt)
    g = cast.bound_granularity(cd)
    shape = (int(t.shape[0]), int(t.shape[1]))
    if g.kind == "tensor":
        s = scale if scale is not None else cast.scale_for(amax(t))
        # A 1-element (not 0-dim) float32 divisor makes the division itself run in float32
        # for bf16/fp16 ``t``: one pass, no upcast copy, one rounding.
        data = to_format(t / s.reshape(1, 1), fmt, saturate=True)
        return Operand(data, s, "tensor", cd, shape)
    if scale is not None:
        raise ValueError(f"scale: a given scale needs tensor granularity, not {g.kind!r}")
    x = t if t.dtype == torch.float64 else t.float()  # float64 is rounded once, directly
    if x.numel() == 0:  # e.g. an expert that got no tokens: nothing to scale
        return _empty_operand(x, cast, g, cd, shape)
    if g.kind == "axis":
        s = cast.scale_for(amax(x, g))
        return Operand(to_format(x / s, fmt, saturate=True), s, "axis", cd, shape)
    if cd == 0:  # block kinds: quantize the transpose (contracted dim last), transpose back
        op = quantize_operand(t.t(), cast, 1)
        return Operand(op.data.t(), op.scale.t(), op.kind, 0, shape)
    br, bc = g.block  # (along the rows, along the contracted columns)
    xp = pad_to_blocks(x, g)  # the core padding policy: explicit, cropped in dequantize
    a = amax(xp, g)
    if g.kind == "block":
        s = cast.scale_for(a)
    elif g.kind == "mx":  # E8M0: OCP's floor, or the power of two at or above amax/max
        s = mx_scale(a, fmt) if cast.mx_scale == "floor" else compute_scale(a, fmt, 0.0, True)
        # OCP MX: a block holding Inf/NaN gets the NaN scale, so the whole block reads NaN
        # (E2M1 has no Inf/NaN code: saturating would hide an overflow from loss scaling).
        s = torch.where(torch.isfinite(a), s, torch.nan)
    else:  # nv: E4M3 block scales under one float32 tensor scale
        fin = torch.where(torch.isfinite(a), a, 0.0)
        t_amax = fin.amax()  # finite amax -> fmt.max * 448: block scales fill E4M3's range
        s_t = torch.where(t_amax > 0, t_amax / (fmt.max * _E4M3.max), 1.0)
        s_b = quantize(fin / (fmt.max * s_t), _E4M3, saturate=True)
        s = torch.where(s_b > 0, s_b, _E4M3.min_subnormal) * s_t
        s = torch.where(torch.isfinite(a), s, torch.nan)  # as MX: Inf/NaN blocks read NaN
    # Round in the blocked 4-D layout, so no kernel indexes a scale by ``column // block``.
    rows, cols = xp.shape
    xb = xp.reshape(rows // br, br, cols // bc, bc) / s.reshape(rows // br, 1, cols // bc, 1)
    data = to_format(xb, fmt, saturate=True).reshape(rows, cols)
    return Operand(data, s, g.kind, cd, shape)


def _empty_operand(
    x: Tensor, cast: CastConfig, g: Granularity, cd: int, shape: tuple[int, int]
) -> Operand:
    """An operand of a matrix with no elements (scales of the right shape, all 1)."""
    fmt = get_format(cast.fmt)
    if g.kind == "axis":
        s_shape = (shape[0], 1) if cd == 1 else (1, shape[1])
        return Operand(to_format(x, fmt), x.new_ones(s_shape), "axis", cd, shape)
    br, bc = g.block if cd == 1 else (g.block[1], g.block[0])
    xp = pad_to_blocks(x, g)
    s = x.new_ones((xp.shape[0] // br, xp.shape[1] // bc))
    return Operand(to_format(xp, fmt), s, g.kind, cd, shape)


def dequantize(op: Operand, dtype: torch.dtype = torch.float32) -> Tensor:
    """``data × scale`` in ``dtype`` (computed in float32), padding removed."""
    x = apply_scale(op.data.float(), op.scale)
    x = x[: op.shape[0], : op.shape[1]]
    return x if dtype == torch.float32 else x.to(dtype)


def hardware_fp8_available(device: torch.device) -> bool:
    """True on CUDA devices with compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _hardware_ok(a: Operand, b: Operand) -> bool:
    if a.kind != b.kind or a.kind not in ("tensor", "axis"):
        return False
    if a.data.dtype not in _HW_FORMATS or b.data.dtype not in _HW_FORMATS:
        return False
    if a.data.dtype == b.data.dtype == torch.float8_e5m2:
        return False  # cuBLAS has no e5m2 x e5m2 FP8 GEMM
    (m, k), n = a.shape, b.shape[1]
    return m % 16 == 0 and k % 16 == 0 and n % 16 == 0 and hardware_fp8_available(a.data.device)


def _hardware_mm(a: Operand, b: Operand, out_dtype: torch.dtype) -> Tensor:
    # cuBLAS wants A row-major and B column-major; the scales are dequantization factors.
    ad = a.data.contiguous()
    bd = b.data.t().contiguous().t()
    sa, sb = a.scale.float(), b.scale.float()
    if a.kind == "tensor":
        return torch._scaled_mm(ad, bd, sa, sb, out_dtype=out_dtype)
    # Row-wise scaling: (M, 1) and (1, N) scales; cuBLAS/CUTLASS produce bf16 only.
    out = torch._scaled_mm(ad, bd, sa.reshape(-1, 1), sb.reshape(1, -1), out_dtype=torch.bfloat16)
    if out_dtype != torch.bfloat16:
        warn_once(
            log,
            f"float8:rowwise-out:{out_dtype}",
            "float8: row-wise FP8 GEMM outputs bf16, cast to %s",
            out_dtype,
        )
    return out.to(out_dtype)


def matmul(
    a: Operand,
    b: Operand,
    out_dtype: torch.dtype,
    emulation_dtype: torch.dtype = torch.float32,
    emulate: bool | None = None,
) -> Tensor:
    """``A · B`` of two operands (``a`` contracted over dim 1, ``b`` over dim 0)."""
    if a.cd != 1 or b.cd != 0:
        raise ValueError("matmul: a must be contracted over dim 1 and b over dim 0")
    if emulate is not True and _hardware_ok(a, b):
        return _hardware_mm(a, b, out_dtype)
    if emulate is False:
        warn_once(
            log,
            "float8:hw-missing",
            "float8: emulate=False but the hardware FP8 GEMM does not apply to these "
            "operands (needs CUDA sm89+, tensor/axis scales, E4M3/E5M2, dims % 16 == 0); "
            "emulating (reported once)",
        )
    ed = emulation_dtype
    if a.kind in ("tensor", "axis") and b.kind in ("tensor", "axis"):
        # The hardware formula: integer-like products of the narrow values, scaled after.
        raw = (a.data.to(ed) @ b.data.to(ed)).float()
        if a.kind == b.kind == "tensor":  # one factor, as the hardware's alpha = s_A s_B
            out = raw.mul_(a.scale * b.scale)
        else:
            out = raw.mul_(a.scale).mul_(b.scale)
    else:
        out = dequantize(a, ed) @ dequantize(b, ed)
    return out.to(out_dtype)


def _as_operand(x: ScaledTensor, cd: int, arg: str) -> Operand:
    if not isinstance(x, ScaledTensor):
        raise TypeError(
            f"{arg} must be a ScaledTensor (see quantize_scaled), got {type(x).__name__}"
        )
    if x.dim() != 2:
        raise ValueError(f"{arg}: expected a 2-D ScaledTensor, got shape {tuple(x.shape)}")
    d, s = x.qdata, x.scale
    shape = (int(d.shape[0]), int(d.shape[1]))
    if s.numel() == 1:
        return Operand(d, s.reshape(()), "tensor", cd, shape)
    free = 1 - cd  # the non-contracted dim
    if s.dim() == 2 and s.shape[cd] == 1 and s.shape[free] == d.shape[free]:
        return Operand(d, s, "axis", cd, shape)
    return Operand(d, s, "block", cd, shape)


def scaled_mm(
    a: ScaledTensor,
    b: ScaledTensor,
    out_dtype: torch.dtype = torch.float32,
    emulate: bool | None = None,
) -> Tensor:
    """``a · b`` of two 2-D :class:`~lowprec.ScaledTensor` matrices, in ``out_dtype``.

    Tensor-wise scales (one per matrix) and axis-wise scales constant along the contracted
    dimension (``a``: ``(M, 1)``, ``b``: ``(1, N)``) use the hardware FP8 GEMM on CUDA
    sm89+; any other block-broadcast scale is dequantized and multiplied (emulation).

    Example:
        >>> import torch
        >>> from lowprec import quantize_scaled
        >>> a = quantize_scaled(torch.randn(32, 64), "e4m3fn")
        >>> b = quantize_scaled(torch.randn(64, 16), "e4m3fn")
        >>> scaled_mm(a, b).shape
        torch.Size([32, 16])
    """
    oa, ob = _as_operand(a, 1, "a"), _as_operand(b, 0, "b")
    if oa.shape[1] != ob.shape[0]:
        raise ValueError(f"b: inner dimensions differ: a is {oa.shape}, b is {ob.shape}")
    return matmul(oa, ob, out_dtype, emulate=emulate)
