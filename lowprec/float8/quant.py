"""GEMM operands in a narrow format: quantized, read back, or built as the values an
emulated GEMM reads.

A GEMM operand is a 2-D :class:`~lowprec.core.tensor.ScaledTensor` ``t ≈ data × scale``
quantized for one GEMM: its ``granularity`` is the cast's granularity (relative to the
contracted dimension ``K``, see :mod:`.recipe`) bound to the operand's contracted dim ``cd``,
and block kinds that do not divide the matrix are zero-padded to whole blocks with the
unpadded shape recorded (the core padding policy). The scaled matmul of two operands is
:mod:`lowprec.float8.mm`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lowprec.core import kernels
from lowprec.core.bits import BYTE_DTYPES, BYTE_FORMATS, round_bits
from lowprec.core.formats import Format, get_format
from lowprec.core.granularity import Granularity, apply_scale, pad_to_blocks
from lowprec.core.hadamard import generator, stream_seed
from lowprec.core.rounding import quantize, storage_dtype, to_format, to_format_bounded
from lowprec.core.scales import amax, group_scale
from lowprec.core.tensor import ScaledTensor
from lowprec.core.upcast import upcast
from lowprec.float8.config import CastConfig

__all__ = [
    "dequantize",
    "quantize_dequantize",
    "quantize_operand",
    "quantize_values",
    "stochastic_parts",
]

Parts = tuple[Tensor, Tensor, "tuple[int, int] | None"]


def quantize_parts(
    t: Tensor,
    cast: CastConfig,
    cd: int,
    scale: Tensor | None = None,
    gen: torch.Generator | None = None,
) -> Parts:
    """``(data, scale, unpadded_shape)`` of :func:`quantize_operand`, as plain tensors
    (``unpadded_shape`` is ``None`` when nothing was padded). A stochastic cast
    (``cast.rounding``) draws from ``gen`` (:func:`stochastic_parts`)."""
    if t.dim() != 2:
        raise ValueError(f"t: expected a 2-D matrix, got shape {tuple(t.shape)}")
    fmt = get_format(cast.fmt)
    g = cast.bound_granularity(cd)
    if cast.rounding == "stochastic" and t.numel():
        return stochastic_parts(t, cast, cd, scale, gen)
    if g.kind == "tensor":
        a = _tensor_amax(t) if scale is None else None
        s = cast.scale_for(a) if a is not None else scale
        assert s is not None
        # A 1-element (not 0-dim) float32 divisor makes the division itself run in float32
        # for bf16/fp16 ``t``: one pass, no upcast copy, one rounding.
        s2 = s.reshape(1, 1)
        q = _encode(t, s2, fmt)
        if q is None:
            q = to_format_bounded(t / s2, fmt, True, _quotient_max(a, s2, t))
        return q, s, None
    if scale is not None:
        raise ValueError(f"scale: a given scale needs tensor granularity, not {g.kind!r}")
    if g.kind == "nv" and torch.compiler.is_compiling():
        return _nv_eager(t, cast, cd)
    if g.kind == "block" and _traced_transpose(t):
        data, s, pad = quantize_parts(t.t(), cast, 1 - cd)  # the same blocks, transposed
        return data.t(), s.t(), None if pad is None else (pad[1], pad[0])
    # float64 is rounded once, directly. Off the CPU no float32 copy is made: the division
    # by the float32 scale promotes, giving the same quotients, and the CUDA kernels take
    # 16-bit inputs (the CPU's are keyed and tuned on float32).
    x = t if t.dtype == torch.float64 or t.device.type != "cpu" else t.float()
    if g.kind == "axis":
        if x.numel() == 0:  # e.g. an expert that got no tokens: nothing to scale
            return to_format(x, fmt), x.new_ones(g.scale_shape(x.shape)), None
        xp, pad = x, None
    else:
        xp = pad_to_blocks(x, g)  # the core padding policy: explicit, recorded, cropped
        pad = None if xp is x else (int(t.shape[0]), int(t.shape[1]))
        if x.numel() == 0:
            return to_format(xp, fmt), xp.new_ones(g.scale_shape(xp.shape)), pad
    if kernels.takes(xp, fmt, devices=kernels.quantize_devices()):  # amax, scale, encode fused
        fused = kernels.run_group_quantize(
            xp, g.scale_shape(xp.shape), fmt, lambda a: _group_scale(a, cast, g, fmt), cast
        )
        if fused is not None:
            return fused[0], fused[1], pad
    a = amax(xp, g)
    s = _group_scale(a, cast, g, fmt)
    q = _encode(xp, s, fmt)
    if q is None:
        bound = _quotient_max(a, s, xp)
        q = to_format_bounded(apply_scale(xp, s, op="div"), fmt, True, bound)
    return q, s, pad


def stochastic_parts(
    t: Tensor, cast: CastConfig, cd: int, scale: Tensor | None, gen: torch.Generator | None
) -> Parts:
    """:func:`quantize_parts` of a stochastic cast: the scales of the nearest cast (the
    same ``amax``, group scale and padding), then ``v = (t / s)`` (float32; float64 for a
    float64 ``t``) rounded by :func:`lowprec.core.rounding.quantize` with
    ``rounding="stochastic"``, ``saturate=True`` and draws from ``gen``: one key
    ``torch.randint(0, 2^62, (1,))``, then the counter-based draws of that key
    (``quantize(..., seed=key)``: :func:`lowprec.core.bits.counter_bits` of each element's
    row-major index in ``v``); a float64 ``t``: one ``torch.randint(0, 2^52, v.shape)``.
    So ``E[data·s] = t`` below saturation. ``gen=None``: a generator seeded with
    :func:`~lowprec.core.hadamard.stream_seed` ``(0)`` (reproducible; a layer passes the
    stream of its GEMM and role). Eager ops only (``torch.compile`` runs stochastic GEMMs
    outside its graph)."""
    if gen is None:
        gen = generator(stream_seed(0), t.device)
    fmt = get_format(cast.fmt)
    g = cast.bound_granularity(cd)
    x = t if t.dtype == torch.float64 else t.float()
    pad = None
    if g.kind == "tensor":
        s = cast.scale_for(amax(t)) if scale is None else scale
        v = x / s.reshape(1, 1)
    else:
        if scale is not None:
            raise ValueError(f"scale: a given scale needs tensor granularity, not {g.kind!r}")
        xp = x if g.kind == "axis" else pad_to_blocks(x, g)
        pad = None if xp is x else (int(t.shape[0]), int(t.shape[1]))
        s = _group_scale(amax(xp, g), cast, g, fmt)
        v = apply_scale(xp, s, op="div")
    if v.dtype == torch.float64:
        q = quantize(v, fmt, "stochastic", saturate=True, generator=gen)
    else:  # one key from gen, then counter-based draws inside the rounding kernel
        key = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device).item())
        q = quantize(v, fmt, "stochastic", saturate=True, seed=key)
    return q.to(storage_dtype(fmt)), s, pad


_BLOCK_KINDS = ("block", "mx", "nv")


def _fused_target(
    t: Tensor,
    cast: CastConfig,
    cd: int,
    dtype: torch.dtype,
    kinds: tuple[str, ...],
    eager: bool = True,
) -> tuple[Granularity, Format] | None:
    """``(granularity, format)`` of the 2-D ``t``'s cast for a fused operand (an eager
    kernel of :func:`quantize_dequantize` or :func:`quantize_values`; ``eager=False``: the
    traced formula of :func:`quantize_values`), or ``None`` where one does not apply: a
    granularity kind not in ``kinds``, a result ``dtype`` other than float32 or bfloat16,
    a float64 or empty ``t``, and for an eager kernel a traced, autograd-recorded or small
    ``t`` or kernels off."""
    if t.dim() != 2:
        raise ValueError(f"t: expected a 2-D matrix, got shape {tuple(t.shape)}")
    g = cast.bound_granularity(cd)
    fmt = get_format(cast.fmt)
    if g.kind not in kinds or dtype not in (torch.float32, torch.bfloat16):
        return None
    if cast.rounding != "nearest":  # the kernels round to nearest
        return None
    if t.dtype == torch.float64 or not t.numel() or (eager and not kernels.takes(t, fmt)):
        return None
    return g, fmt


def quantize_dequantize(t: Tensor, cast: CastConfig, cd: int, dtype: torch.dtype) -> Tensor | None:
    """``dequantize(quantize_operand(t, cast, cd), dtype)``, the same bits, by one fused
    kernel that never stores the payload (:func:`lowprec.core.kernels.run_group_round_trip`):
    the values an emulated GEMM multiplies for a block granularity (block, MX, NVFP4) with
    a dynamic scale, eager on the CPU. ``None`` where that does not apply (another
    granularity, a traced or autograd-recorded ``t``, a small or float64 one, kernels
    off): the caller quantizes and dequantizes."""
    target = _fused_target(t, cast, cd, dtype, _BLOCK_KINDS)
    if target is None:
        return None
    g, fmt = target
    xp = pad_to_blocks(t.float(), g)
    out = kernels.run_group_round_trip(
        xp, g.scale_shape(xp.shape), fmt, lambda a: _group_scale(a, cast, g, fmt), cast, dtype
    )
    if out is None or xp.shape == t.shape:
        return None if out is None else out[0]
    return out[0][: t.shape[0], : t.shape[1]]


def quantize_values(
    t: Tensor, cast: CastConfig, cd: int, dtype: torch.dtype, scale: Tensor | None = None
) -> tuple[Tensor, Tensor] | None:
    """``(upcast(data, dtype), s)`` for ``(data, s, _) = quantize_parts(t, cast, cd,
    scale)``, the same bits, without the 1-byte payload: what the emulated hardware GEMM
    (:func:`payload_mm`) reads of a tensor- or axis-scaled operand in a float8 format.
    Eager on the CPU, one kernel; traced (``torch.compile``), the rounding written as
    float32 bit arithmetic (:func:`~lowprec.core.bits.round_bits`), which inductor
    vectorises and fuses with the scale's division, instead of the float8 cast and the
    cast back. ``None`` where that does not apply (another granularity or format, an
    autograd-recorded, small, empty or float64 ``t``, kernels off when eager): the caller
    quantizes. The caller decides that the GEMM is emulated: a traced operand given here
    never reaches the hardware GEMM."""
    if torch.compiler.is_compiling():
        return _traced_values(t, cast, cd, dtype, scale)
    target = _fused_target(t, cast, cd, dtype, ("tensor", "axis"))
    if target is None or target[1] not in BYTE_FORMATS:
        return None
    g, fmt = target
    if g.kind == "tensor":
        s = cast.scale_for(amax(t)) if scale is None else scale
        v = kernels.run_round_trip(t, s.reshape(1, 1).float(), fmt, False, dtype)
        return None if v is None else (v, s)
    if scale is not None:
        raise ValueError(f"scale: a given scale needs tensor granularity, not {g.kind!r}")
    return kernels.run_group_round_trip(
        t.float(),
        g.scale_shape(t.shape),
        fmt,
        lambda a: _group_scale(a, cast, g, fmt),
        cast,
        dtype,
        multiply=False,
    )


def _traced_values(
    t: Tensor, cast: CastConfig, cd: int, dtype: torch.dtype, scale: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """:func:`quantize_values` under ``torch.compile``: :func:`quantize_parts`' scale, and
    its payload's values rounded by ``round_bits`` (saturating, nearest: the values of the
    cast ``quantize_parts`` traces, Inf and NaN included) in ``dtype``."""
    target = _fused_target(t, cast, cd, dtype, ("tensor", "axis"), eager=False)
    if target is None or target[1] not in BYTE_FORMATS:
        return None
    g, fmt = target
    if g.kind == "tensor":
        s = cast.scale_for(_tensor_amax(t)) if scale is None else scale
        q = t / s.reshape(1, 1)  # float32 for 16-bit t, as quantize_parts divides
    else:
        if scale is not None:
            raise ValueError(f"scale: a given scale needs tensor granularity, not {g.kind!r}")
        x = t.float()
        s = _group_scale(amax(x, g), cast, g, fmt)
        q = apply_scale(x, s, op="div")
    return round_bits(q, fmt, "nearest", True).to(dtype), s


def _tensor_amax(t: Tensor) -> Tensor:
    """``amax(t)`` of a whole tensor (float32, 0-dim; the same value). Under
    ``torch.compile`` written ``t.abs().amax()``: ops that AOTAutograd's partitioner may
    recompute in backward, fused by inductor into one read. The eager ``aminmax`` of
    :func:`~lowprec.core.scales.amax` (through a ``detach``) is outside its allow-list,
    which bans recomputing every later use of ``t``, the quantization included: the
    partitioner then saved each layer's FP8 payload, even where backward keeps the tensors
    it is computed from anyway (a norm's input and statistics; ``benchmarks/README.md``,
    Llama section: 5 GiB at 1.1B parameters)."""
    if torch.compiler.is_compiling() and t.numel() and t.dtype != torch.float64:
        return t.abs().amax().float()  # NaN propagates, as in amax
    return amax(t)


def _nv_parts(t: Tensor, cast: CastConfig, cd: int) -> Parts:
    """NVFP4 operands are quantized outside ``torch.compile``'s graph (a graph break; the
    eager kernels run): inductor's CPU code generation fails on the NVFP4 graph
    (``AssertionError`` in ``try_loop_split``, torch 2.13)."""
    return quantize_parts(t, cast, cd)


_nv_eager: Callable[[Tensor, CastConfig, int], Parts] = torch.compiler.disable(_nv_parts)  # type: ignore[no-untyped-call]


def _group_scale(a: Tensor, cast: CastConfig, g: Granularity, fmt: Format) -> Tensor:
    """The scales of a non-tensor granularity ``g`` from the groups' maxima ``a``
    (elementwise, except NVFP4's tensor-level factor; traceable by ``torch.compile``):
    :func:`~lowprec.core.scales.group_scale` with the cast's ``margin``, ``power_of_two``
    and MX rounding (``mx_scale``)."""
    return group_scale(a, fmt, g, cast.margin, cast.power_of_two, mx_rounding=cast.mx_scale)


def _encode(t: Tensor, s: Tensor, fmt: Format) -> Tensor | None:
    """``to_format(apply_scale(t, s, "div"), fmt, saturate=True)`` by a compiled kernel,
    or ``None`` where it does not apply (the caller runs the eager ops)."""
    if not kernels.takes(t, fmt, devices=kernels.quantize_devices()):
        return None
    return kernels.run_scaled_encode(t, s, fmt)


def _quotient_max(a: Tensor | None, s: Tensor, x: Tensor) -> float | None:
    """The largest ``|x / s|`` over all groups, from the groups' maxima ``a`` alone (eager
    CPU; ``None`` where unknown or under ``torch.compile``; NaN if a group holds NaN).

    Division by a positive scale is monotonic in every rounding, so the group maximum
    ``a`` divided by its scale, in the same dtypes, *is* the group's largest quotient.
    """
    if a is None or torch.compiler.is_compiling() or x.device.type != "cpu" or not a.numel():
        return None
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    q = a.to(x.dtype) / s  # promotes like ``x / s`` (a: exact, x's own maximum)
    return float(q.max() if bool((s > 0).all()) else math.nan)


def _traced_transpose(t: Tensor) -> bool:
    """``t`` is traced and the transpose of a contiguous matrix (a weight ``W.t()``, a
    gradient ``g.t()``). Block scaling commutes with transposition, so a block-scaled cast
    of ``t`` is computed on ``t.t()`` and transposed back: block views of ``t`` itself
    (reshapes) make inductor write its result transposed, one store per element at a
    stride of a row."""
    return (
        torch.compiler.is_compiling()
        and t.dim() == 2
        and not t.is_contiguous()
        and t.t().is_contiguous()
    )


def as_operand(parts: Parts, cast: CastConfig, cd: int, dtype: torch.dtype) -> ScaledTensor:
    """The :class:`~lowprec.core.tensor.ScaledTensor` of :func:`quantize_parts`' result
    (logical dtype ``dtype``, granularity ``cast.bound_granularity(cd)``)."""
    data, s, pad = parts
    g = cast.bound_granularity(cd)
    return ScaledTensor._wrap(data, s, dtype, cast.fmt, None, g, pad)


def quantize_operand(
    t: Tensor,
    cast: CastConfig,
    cd: int,
    scale: Tensor | None = None,
    gen: torch.Generator | None = None,
) -> ScaledTensor:
    """Quantize the 2-D ``t`` for a GEMM that contracts its dimension ``cd`` (0 or 1).

    Returns a :class:`~lowprec.core.tensor.ScaledTensor` whose ``granularity`` is the cast's
    granularity bound to ``cd``; block kinds zero-pad ``t`` to whole blocks and record
    ``unpadded_shape``. ``scale`` (tensor granularity only) is a scale chosen elsewhere
    (delayed or static scaling); without it the scale comes from ``t`` itself. Values are
    divided by the scale in float32 and rounded with saturation: to nearest, or
    stochastically with the draws of ``gen`` (``cast.rounding``).
    """
    return as_operand(quantize_parts(t, cast, cd, scale, gen), cast, cd, t.dtype)


def dequantize_parts(
    data: Tensor, scale: Tensor, unpadded: tuple[int, ...] | None, dtype: torch.dtype
) -> Tensor:
    """``data × scale`` in ``dtype`` (computed in float32), cropped to ``unpadded``."""
    if scale.dim() == 2 and _traced_transpose(data):
        crop = None if unpadded is None else (unpadded[1], unpadded[0])
        return dequantize_parts(data.t(), scale.t(), crop, dtype).t()
    fmt = BYTE_DTYPES.get(data.dtype)  # None: a float payload that holds its values
    fast = kernels.takes(data, fmt)
    if fast and scale.dtype == torch.float32:
        y = kernels.run_decode(data, fmt, dtype, scale)
        if y is not None:
            return y if unpadded is None else y[tuple(slice(0, n) for n in unpadded)]
    x = apply_scale(upcast(data, torch.float32), scale)
    if unpadded is not None:
        x = x[tuple(slice(0, n) for n in unpadded)]
    return x if dtype == torch.float32 else x.to(dtype)


def dequantize(op: ScaledTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``data × scale`` of an operand in ``dtype`` (computed in float32), padding removed."""
    return dequantize_parts(op.qdata, op.scale, op._unpadded, dtype)
