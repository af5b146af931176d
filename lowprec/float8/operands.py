"""GEMM operands of :class:`~lowprec.float8.linear.Float8Linear`'s three GEMMs, and the
GEMM of two of them.

An operand is a :class:`~lowprec.core.tensor.ScaledTensor` built from
:func:`~lowprec.float8.quant.quantize_parts` (what ``torch.compile`` traces and the hardware
GEMM reads), or, where the GEMM is emulated anyway, what the emulation reads, without a
1-byte payload (the same bits): a block-scaled cast's dequantized values
(eager, one kernel), or a tensor- or axis-scaled cast's :class:`Payload` (eager, one kernel;
traced, bit arithmetic inductor fuses).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lowprec.core.tensor import ScaledTensor
from lowprec.core.upcast import upcast
from lowprec.float8.config import CastConfig, Float8Config
from lowprec.float8.mm import emulated_mm, hardware_fp8_available, matmul, operand_kind, payload_mm
from lowprec.float8.quant import (
    Parts,
    as_operand,
    dequantize,
    quantize_dequantize,
    quantize_parts,
    quantize_values,
)

__all__ = [
    "EMULATION_DTYPES",
    "Operand",
    "Payload",
    "cast_kind",
    "from_parts",
    "gemm",
    "operand",
    "surely_emulated",
    "transposed",
]

EMULATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # a recipe's emulation_dtype


def cast_kind(cast: CastConfig) -> str:
    """The granularity kind of a cast (``tensor``, ``axis``, ``block``, ``mx``, ``nv``)."""
    return cast.bound_granularity(1).kind


class Payload(NamedTuple):
    """A tensor- or axis-scaled GEMM operand as the emulated hardware GEMM reads it: its
    payload's values in the emulation dtype, its scale and its kind."""

    values: Tensor
    scale: Tensor
    kind: str


Operand = Tensor | Payload  # a ScaledTensor, dequantized values, or a Payload


def payload_roles(r: Float8Config) -> bool:
    """Every GEMM of ``r`` multiplies payloads (tensor or axis casts for all three roles)."""
    return all(cast_kind(c) in ("tensor", "axis") for c in (r.input, r.weight, r.grad_output))


def surely_emulated(t: Tensor, r: Float8Config) -> bool:
    """Every GEMM of ``r`` on ``t``'s device is emulated by the hardware formula on payloads
    (:func:`~lowprec.float8.mm.payload_mm`), whatever its operands: every role is
    tensor- or axis-scaled, and ``emulate=True`` or the device has no hardware FP8 GEMM."""
    if not payload_roles(r) or r.emulate is False:
        return False
    return r.emulate is True or not hardware_fp8_available(t.device)


def from_parts(
    parts: Parts, cast: CastConfig, cd: int, dtype: torch.dtype, r: Float8Config
) -> Operand:
    """The GEMM operand of :func:`~lowprec.float8.quant.quantize_parts`' result ``parts``
    (of a tensor of logical dtype ``dtype``): where :func:`surely_emulated`, a
    :class:`Payload` (the payload upcast once into the emulation dtype, which a transposed
    use shares; under ``torch.compile`` no ScaledTensor made in the graph is then read
    back); else the ScaledTensor (:func:`~lowprec.float8.quant.as_operand`)."""
    data, s, pad = parts
    if pad is None and surely_emulated(data, r):
        return Payload(upcast(data, EMULATION_DTYPES[r.emulation_dtype]), s, cast_kind(cast))
    return as_operand(parts, cast, cd, dtype)


def operand(
    t: Tensor,
    cast: CastConfig,
    cd: int,
    scale: Tensor | None,
    r: Float8Config,
    gen: torch.Generator | None = None,
) -> tuple[Operand, Tensor | None, Parts | None]:
    """``(operand, scale, parts)``: the GEMM operand of ``t`` contracted over ``cd``, its
    scale and the :func:`quantize_parts` it was built from (a ScaledTensor, whose own
    fields are not read back: under ``torch.compile`` it is traced). Where the GEMM is emulated
    anyway (``emulate`` not ``False``), what the emulation reads is built without a 1-byte
    payload, the same bits: eager on the CPU, for a block-scaled cast, the dequantized
    values from one kernel (:func:`~lowprec.float8.quant.quantize_dequantize`; scale
    ``None``); and when every role of ``r`` is tensor- or axis-scaled and the GEMM is
    surely emulated (``emulate=True``, or no hardware FP8 GEMM on ``t``'s device), a
    :class:`Payload` (:func:`~lowprec.float8.quant.quantize_values`: one kernel eager,
    bit arithmetic that inductor fuses when traced). :func:`gemm` takes any of them.
    A stochastic cast draws from ``gen`` (:func:`~lowprec.float8.quant.stochastic_parts`)."""
    if r.emulate is not False:
        ed = EMULATION_DTYPES[r.emulation_dtype]
        if scale is None:
            v = quantize_dequantize(t, cast, cd, ed)
            if v is not None:
                return v, None, None
        if surely_emulated(t, r):
            vs = quantize_values(t, cast, cd, ed, scale)
            if vs is not None:
                return Payload(vs[0], vs[1], cast_kind(cast)), vs[1], None
    parts = quantize_parts(t, cast, cd, scale, gen)
    return from_parts(parts, cast, cd, t.dtype, r), parts[1], parts


def gemm(a: Operand, b: Operand, out_dtype: torch.dtype, r: Float8Config) -> Tensor:
    """``a · b`` (``a`` contracted over dim 1, ``b`` over 0) of two :func:`operand`
    results: :func:`~lowprec.float8.mm.matmul` of two ScaledTensors, else the same
    emulation the ``lowprec::float8_mm`` rule runs: the hardware formula on payloads
    (:func:`~lowprec.float8.mm.payload_mm`) when either side is a :class:`Payload`
    (both sides are then tensor- or axis-scaled), else the product of dequantized values."""
    ed = EMULATION_DTYPES[r.emulation_dtype]
    if isinstance(a, ScaledTensor) and isinstance(b, ScaledTensor):
        return matmul(a, b, out_dtype, ed, r.emulate)
    if isinstance(a, Payload) or isinstance(b, Payload):
        pa = a if isinstance(a, Payload) else _as_payload(a, 1, ed)
        pb = b if isinstance(b, Payload) else _as_payload(b, 0, ed)
        return payload_mm(pa.values, pa.scale, pa.kind, pb.values, pb.scale, pb.kind, out_dtype)
    da = dequantize(a, ed) if isinstance(a, ScaledTensor) else a
    db = dequantize(b, ed) if isinstance(b, ScaledTensor) else b
    return emulated_mm(da, db, out_dtype)


def _as_payload(op: Tensor, cd: int, ed: torch.dtype) -> Payload:
    """A ScaledTensor operand (an FP8-gathered weight or input) as a :class:`Payload`."""
    assert isinstance(op, ScaledTensor)
    return Payload(upcast(op.qdata, ed), op.scale, operand_kind(op, cd))


def transposed(op: Operand, parts: Parts | None, cast: CastConfig, dtype: torch.dtype) -> Operand:
    """A tensor-wise :func:`operand` (one scale) used transposed: the same values and
    scale (a ScaledTensor's from its ``parts``)."""
    if isinstance(op, Payload):
        return Payload(op.values.t(), op.scale, op.kind)
    assert parts is not None
    return as_operand((parts[0].t(), parts[1], None), cast, 1, dtype)
