"""The scaled matmul of two GEMM operands (:mod:`lowprec.float8.quant`): the hardware FP8
kernel or its emulation.

For ``A (M×K)`` contracted over dim 1 and ``B (K×N)`` over 0 it computes

    C = (A_data · B_data) ⊙ (s_A s_Bᵀ)                  (tensor / axis scales)
    C = Σ_blocks (A_data,blk · B_data,blk) · s_A,blk · s_B,blk   (block / MX scales)

It is the op ``lowprec::float8_mm``, whose ScaledTensor rule (registered with
:func:`lowprec.core.tensor.register_rule`) reads the payloads and scales: under
``torch.compile`` operands built inside the compiled region pass through it as
ScaledTensors and the rule is traced below Dynamo. The hardware kernel
(``torch._scaled_mm``) is used only on CUDA with compute capability 8.9 or newer; elsewhere
the *emulation* computes the same formula: the quantized values are real (rounded by
:func:`lowprec.core.rounding.to_format`), upcast exactly to float32, multiplied (products
of 8-bit values are exact in float32) and accumulated in float32. The CPU ``_scaled_mm``
kernel is never used: it is thousands of times slower than a bf16 matmul.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import Tensor

from lowprec.core.tensor import ScaledTensor, register_rule
from lowprec.core.upcast import upcast
from lowprec.core.warn import warn_once
from lowprec.float8.quant import dequantize

__all__ = [
    "autocast_off",
    "emulated_mm",
    "hardware_fp8_available",
    "matmul",
    "operand_kind",
    "payload_mm",
    "scaled_mm",
]

log = logging.getLogger(__name__)
_HW_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def payload_mm(
    av: Tensor, sa: Tensor, ka: str, bv: Tensor, sb: Tensor, kb: str, out_dtype: torch.dtype
) -> Tensor:
    """The hardware formula of a tensor- or axis-scaled FP8 GEMM, emulated: the product of
    the payloads' values ``av``, ``bv`` (in the emulation dtype: products of 8-bit values
    are exact) accumulated in it, then scaled, ``(a·b)·(s_a s_b)`` (one factor, as the
    hardware's alpha, when both are tensor-wise; else row then column scales), in
    ``out_dtype``. Computed in the emulation dtype whatever the caller's autocast (a
    compiled backward is traced under the forward's: an FP16 mm overflows on E5M2 × E4M3
    payload products, ``tests/float8/test_autocast_compile.py``)."""
    with autocast_off(av.device.type):
        raw = (av @ bv).float()
    if ka == kb == "tensor":
        out = raw.mul_((sa * sb).reshape(()))
    else:
        out = raw.mul_(sa).mul_(sb)
    return out.to(out_dtype)


def emulated_mm(da: Tensor, db: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The emulated GEMM of two dequantized operands (in the emulation dtype): their
    product, accumulated in that dtype (whatever the caller's autocast), in ``out_dtype``."""
    with autocast_off(da.device.type):
        return (da @ db).to(out_dtype)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager[object]:
    """Autocast off for ``device_type`` (nothing to do on ``meta``), entered whatever the
    flag reads: a backward traced by AOTAutograd applies the forward's autocast without
    setting it."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def hardware_fp8_available(device: torch.device) -> bool:
    """True on CUDA devices with compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def operand_kind(op: ScaledTensor, cd: int) -> str:
    """The scaling kind of an operand contracted over ``cd``: its recorded granularity's,
    else read off the scale shape (one scale: ``tensor``; one per index of the
    non-contracted dim: ``axis``; any other block-broadcast scale: ``block``)."""
    if op._granularity is not None:
        return op._granularity.split(":", 1)[0]
    s, d = op.scale, op.qdata
    if s.numel() == 1:
        return "tensor"
    free = 1 - cd
    if s.dim() == 2 and s.shape[cd] == 1 and s.shape[free] == d.shape[free]:
        return "axis"
    return "block"


def _hardware_ok(a: ScaledTensor, b: ScaledTensor, ka: str, kb: str) -> bool:
    if ka != kb or ka not in ("tensor", "axis"):
        return False
    if a.qdata.dtype not in _HW_FORMATS or b.qdata.dtype not in _HW_FORMATS:
        return False
    if a.qdata.dtype == b.qdata.dtype == torch.float8_e5m2:
        return False  # cuBLAS has no e5m2 x e5m2 FP8 GEMM
    (m, k), n = a.shape, b.shape[1]
    return m % 16 == 0 and k % 16 == 0 and n % 16 == 0 and hardware_fp8_available(a.device)


def _hardware_mm(a: ScaledTensor, b: ScaledTensor, kind: str, out_dtype: torch.dtype) -> Tensor:
    # cuBLAS wants A row-major and B column-major; the scales are dequantization factors.
    ad = a.qdata.contiguous()
    bd = b.qdata.t().contiguous().t()
    sa, sb = a.scale.float(), b.scale.float()
    if kind == "tensor":
        return torch._scaled_mm(ad, bd, sa.reshape(()), sb.reshape(()), out_dtype=out_dtype)
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


@torch.library.custom_op("lowprec::float8_mm", mutates_args=())
def _float8_mm(
    a: Tensor, b: Tensor, out_dtype: torch.dtype, emulation_dtype: torch.dtype, emulate: int
) -> Tensor:
    """``A · B`` of two ScaledTensor operands: computed by the ScaledTensor rule below."""
    raise TypeError("lowprec::float8_mm: a and b must be ScaledTensors")


@_float8_mm.register_fake
def _(
    a: Tensor, b: Tensor, out_dtype: torch.dtype, emulation_dtype: torch.dtype, emulate: int
) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@register_rule(torch.ops.lowprec.float8_mm.default)
def _float8_mm_rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    a, b, out_dtype, ed, emulate = args
    if not isinstance(a, ScaledTensor) or not isinstance(b, ScaledTensor):
        raise TypeError("lowprec::float8_mm: a and b must be ScaledTensors")
    ka, kb = operand_kind(a, 1), operand_kind(b, 0)
    if emulate != 1 and _hardware_ok(a, b, ka, kb):
        return _hardware_mm(a, b, ka, out_dtype)
    if emulate == 0:
        warn_once(
            log,
            "float8:hw-missing",
            "float8: emulate=False but the hardware FP8 GEMM does not apply to these "
            "operands (needs CUDA sm89+, tensor/axis scales, E4M3/E5M2, dims % 16 == 0); "
            "emulating (reported once)",
        )
    # Below the autocast dispatch keys: these GEMMs run in ``ed`` whatever the caller's
    # autocast. (A plain mm in Float8Linear's backward, compiled under FP16 autocast, ran in
    # FP16 and overflowed on E5M2 x E4M3 payload products: tests/float8/test_autocast_compile.py)
    if ka in ("tensor", "axis") and kb in ("tensor", "axis"):
        # The hardware formula: integer-like products of the narrow values, scaled after.
        av, bv = upcast(a.qdata, ed), upcast(b.qdata, ed)
        return payload_mm(av, a.scale, ka, bv, b.scale, kb, out_dtype)
    return emulated_mm(dequantize(a, ed), dequantize(b, ed), out_dtype)


def _contracted_ok(op: ScaledTensor, cd: int) -> bool:
    """False when ``op``'s recorded granularity lays its scale along the other dim."""
    g = op.granularity
    if g is None or g.kind == "tensor" or g.relative:
        return True
    assert isinstance(g.axis, int)
    return g.axis % 2 == cd


def matmul(
    a: ScaledTensor,
    b: ScaledTensor,
    out_dtype: torch.dtype,
    emulation_dtype: torch.dtype = torch.float32,
    emulate: bool | None = None,
) -> Tensor:
    """``A · B`` of two operands (``a`` contracted over dim 1, ``b`` over dim 0)."""
    flag = -1 if emulate is None else int(emulate)
    out: Tensor = torch.ops.lowprec.float8_mm(a, b, out_dtype, emulation_dtype, flag)
    return out


def _check_operand(x: object, arg: str, cd: int) -> ScaledTensor:
    if not isinstance(x, ScaledTensor):
        raise TypeError(
            f"{arg} must be a ScaledTensor (see quantize_scaled), got {type(x).__name__}"
        )
    if x.dim() != 2:
        raise ValueError(f"{arg}: expected a 2-D ScaledTensor, got shape {tuple(x.shape)}")
    if not _contracted_ok(x, cd):
        raise ValueError(
            f"{arg}: quantized for contraction over dim {1 - cd}, but {arg} is contracted "
            f"over dim {cd}"
        )
    return x


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
    _check_operand(a, "a", 1)
    _check_operand(b, "b", 0)
    if a.unpadded_shape[1] != b.unpadded_shape[0]:
        raise ValueError(
            f"b: inner dimensions differ: a is {a.unpadded_shape}, b is {b.unpadded_shape}"
        )
    return matmul(a, b, out_dtype, emulate=emulate)
