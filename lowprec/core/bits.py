"""Rounding on bit patterns: the arithmetic that compiled kernels trace.

Everything here is elementwise integer and float arithmetic on the float32 (float64) bit
pattern, which inductor vectorises, where torch's own casts into the float8 dtypes are
scalar loops on the CPU. :mod:`lowprec.core.rounding` (the API: checks, torch's native
casts, the eager fast paths) and the compiled kernels of :mod:`lowprec.core.kernels`
both rest on it; it imports nothing of lowprec but the formats.

* :func:`round_bits`: round to nearest (ties to even) or stochastically into any format,
  the value kept in the input's float dtype: :func:`lowprec.core.rounding.quantize`'s
  rounding, bit-exact with ``ml_dtypes`` (its module docstring has the overflow, Inf,
  NaN and signed-zero table) and, for a format with a torch dtype, the values of its cast.
* :func:`encode` and :func:`decode`: the torch float8 formats' bytes in float32/int32
  arithmetic. They give the bits of torch's casts as lowprec uses them:

  - :func:`encode` is ``_cast_native(v, fmt, dtype, saturate)`` of
    :mod:`lowprec.core.rounding`: round to nearest, ties to even; finite overflow
    saturates to ``±max`` (``saturate=False``: NaN, or ``±Inf`` for ``ieee``); ``±Inf``
    becomes NaN (``fn``, ``fnuz``) or stays ``±Inf`` (``ieee``); NaN stays NaN with its
    sign, all mantissa bits set (``fnuz``: the one NaN code ``0x80``; ``fnuz`` has no
    ``-0``).
  - :func:`decode` is ``payload.to(float32)``.

  For a format with ``M`` mantissa bits and bias ``B`` and a float32 magnitude ``a``
  whose bits are ``b``, the code's magnitude is

  - ``a >= min_normal``: ``rne(b / 2^(23-M)) - (127 - B)·2^M``: the float32 exponent and
    mantissa fields are already the code's fields, rebiased; rounding the low ``23 - M``
    bits to nearest-even on the integer carries into the exponent exactly when the value
    rounds up to the next binade;
  - ``a < min_normal``: ``rne(a · 2^(B - 1 + M))``, the multiple of the smallest
    subnormal (an exact power-of-two scaling; the result ``2^M`` is ``min_normal``'s code).

* :func:`storage_dtype`: the torch dtype a rounded value of a format is stored in.
* :func:`draw_bits`: the random bits stochastic rounding consumes (drawn eagerly from a
  ``torch.Generator``; :func:`round_bits` takes them as a tensor, so a compiled kernel
  rounds with exactly the draws the eager path would take).
* :func:`counter_bits`: counter-based draws, a hash of a key and each element's index:
  elementwise integer arithmetic, so a kernel computes them in its loop instead of reading a
  serial generator's output.

``tests/core/test_kernels.py`` checks :func:`encode` and :func:`decode` against torch's
casts on every code, every rounding boundary and tie, the specials and random values,
eager and compiled, and :func:`round_bits` against torch's casts and the reference rounding.
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from lowprec.core.formats import _NATIVE, BF16, FP16, FP32, Format, Rounding, get_format

__all__ = [
    "BYTE_DTYPES",
    "BYTE_FORMATS",
    "counter_bits",
    "decode",
    "draw_bits",
    "encode",
    "round_bits",
    "storage_dtype",
    "with_sign",
]

# ---------------------------------------------------------------------------------------
# Rounding into any format
# ---------------------------------------------------------------------------------------


def _work_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, int]:
    """(float dtype, int dtype, mantissa bits) of the arithmetic used for inputs of ``dtype``."""
    if dtype == torch.float64:
        return torch.float64, torch.int64, 52
    return torch.float32, torch.int32, 23


def _scale_pow2(t: Tensor, k: int) -> Tensor:
    """``t · 2^k`` as two exact multiplications (2^149 itself overflows float32)."""
    a = k // 2
    return t * 2.0**a * 2.0 ** (k - a)


_SAME_SIZE_INT = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def with_sign(a: Tensor, x: Tensor) -> Tensor:
    """``copysign(a, x)`` for ``a`` without its sign bit set (a magnitude, NaN included)
    and ``x`` of ``a``'s dtype (float64, float32, float16 or bfloat16).

    On the CPU, ``a``'s bits or'ed with ``x``'s sign bit: inductor's CPU kernels call
    ``torch.copysign`` out of line (a vector function call per 16 elements, with every
    live register spilled around it); these two integer ops stay in the loop. Elsewhere
    ``torch.copysign`` (:func:`_sign_by_bits`)."""
    if not _sign_by_bits(a.device):
        return torch.copysign(a, x)
    idt = _SAME_SIZE_INT[a.dtype]
    sign = -(1 << (torch.finfo(a.dtype).bits - 1))
    return (a.view(idt) | (x.view(idt) & sign)).view(a.dtype)


def _sign_by_bits(device: torch.device) -> bool:
    """Whether :func:`with_sign` sets the sign on the bits (the CPU) rather than with
    ``torch.copysign``. Off the CPU nothing is gained, and traced for CUDA the integer
    views made AOTAutograd's partitioner save the FP8 payload of an input several linears
    share (attention's q/k/v input) instead of recomputing its cast from tensors backward
    keeps anyway: 1 GiB more than torchao on a 2.0B Llama (benchmarks/README.md)."""
    return device.type == "cpu"


def draw_bits(
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The draws of stochastic rounding for an input of ``shape`` and ``dtype``: one
    ``torch.randint(0, 2^23, shape)`` in int32 (``2^52``, int64, for a float64 input) from
    ``generator``, the only random numbers :func:`round_bits` consumes."""
    _, idt, ms = _work_dtypes(dtype)
    return torch.randint(0, 2**ms, tuple(shape), generator=generator, dtype=idt, device=device)


_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # the multiplier of a 32-bit integer hash (T. Mueller's, good avalanche)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash of ``x`` (int64 holding values in ``[0, 2^32)``): two rounds
    of xorshift-multiply. Every product stays below ``2^59``, so int64 never overflows."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def counter_bits(keys: Tensor, index: Tensor) -> Tensor:
    """Counter-based draws for stochastic rounding of float32 values: for each element
    index ``i`` (int64 tensor) and a key ``k = keys[0] + 2^32·keys[1]`` (int64 tensor of
    two values in ``[0, 2^32)``), the 23-bit draw

        h(i) = mix(mix((i mod 2^32) ⊕ keys[0]) ⊕ keys[1] ⊕ ⌊i / 2^32⌋) >> 9

    (int32; ``mix`` the 32-bit hash ``_mix32``). The draw of element ``i`` depends on the
    key and ``i`` alone: a kernel computes it inside its loop, and any slice of a tensor
    (a shard) draws what the same elements draw in the whole."""
    k0, k1 = keys[0], keys[1]
    h = _mix32(_mix32((index & _M32) ^ k0) ^ k1 ^ (index >> 32))
    return (h >> 9).to(torch.int32)


def _round_magnitude(a: Tensor, fmt: Format, rand: Tensor | None) -> Tensor:
    """Round the non-negative finite-or-inf magnitude ``a`` to ``fmt`` (no overflow handling):
    to nearest for ``rand=None``, else stochastically with the draws ``rand``
    (:func:`draw_bits`, ``a``'s shape)."""
    fdt, idt, ms = _work_dtypes(a.dtype)
    m = fmt.mantissa_bits
    d = ms - m
    bits = a.view(idt)
    if not fmt.signed:  # E8M0: round the bit pattern half up into the exponent field
        r = (((bits + (1 << (ms - 1))) >> ms) << ms).view(fdt)
        # At or below the smallest value 2^-bias the result is 2^-bias (as in torch and
        # ml_dtypes); the bit rule alone would round 2^-127, a float32 subnormal, up.
        return torch.where(a <= fmt.min_normal, fmt.min_normal, r)
    # Normal range: round the source mantissa to M bits on the bit pattern. A carry out
    # of the mantissa correctly moves the value to the next binade.
    # If the format's normal range reaches below float32's (bias >= 128), those values are
    # float32 subnormals: lift them into float32's normal range for the bit rounding.
    tiny_f = torch.finfo(fdt).tiny
    lift = fmt.min_normal < tiny_f
    if lift:
        bits = torch.where(a < tiny_f, a * 2.0**64, a).view(idt)
    if d == 0:
        rn = a
    elif rand is None:
        # Ties go to the even code. With M = 0 the last code bit is the exponent's, whose
        # parity is the source's (odd bias) flipped when the format's bias is even.
        flip = (fmt._bias + 1) & 1 if m == 0 else 0
        rn = (bits + ((1 << (d - 1)) - 1) + (((bits >> d) ^ flip) & 1)) & -(1 << d)
        rn = rn.view(fdt)
    else:
        rn = ((bits + (rand >> m)) & -(1 << d)).view(fdt)
    if lift:
        rn = torch.where(a < tiny_f, rn * 2.0**-64, rn)  # exact: a format value
    # Subnormal range of the target: round to a multiple of min_subnormal = 2^-k.
    k = fmt._bias - 1 + m
    if rand is None and ms - k >= math.frexp(tiny_f)[1] - 1:  # 2^(ms - k) normal
        # One addition rounds (to nearest, ties to even) to a multiple of ulp(2^(ms - k))
        # = 2^-k; the subtraction is exact (fewer vector ops than scaling to integers).
        c = 2.0 ** (ms - k)
        return torch.where(a < fmt.min_normal, (a + c) - c, rn)
    s = _scale_pow2(a, k)  # exact: a < min_normal so s < 2^M
    if rand is None:
        rs = torch.round(s)  # ties to even
    else:
        fl = torch.floor(s)
        u = rand.to(fdt) * 2.0**-ms
        rs = fl + (u < (s - fl)).to(fdt)
    rs = _scale_pow2(rs, -k)
    return torch.where(a < fmt.min_normal, rs, rn)


def round_bits(
    x: Tensor,
    fmt: Format,
    rounding: Rounding = "nearest",
    saturate: bool = False,
    generator: torch.Generator | None = None,
    rand: Tensor | None = None,
) -> Tensor:
    """:func:`lowprec.core.rounding.quantize` (arguments already checked) by arithmetic
    on the float32 (float64) bit pattern for every format, a torch dtype's included: the
    same values as its cast (NaN payloads aside), from elementwise integer and float ops
    that inductor vectorises, where its own float8 casts are scalar loops on the CPU.
    Stochastic rounding draws :func:`draw_bits` from ``generator``, or uses ``rand`` when
    given (the draws of ``x``'s shape; a kernel cannot draw from a generator)."""
    orig = x.dtype
    fdt, _, _ = _work_dtypes(orig)
    xf = x.to(fdt)
    a = xf.abs()
    if rounding == "stochastic" and rand is None:
        rand = draw_bits(a.shape, orig, generator, a.device)
    a = _round_magnitude(a, fmt, rand if rounding == "stochastic" else None)
    over = a > fmt.max
    if fmt.special == "finite":
        a = torch.where(over, fmt.max, a)
    else:
        overflow_value = math.inf if fmt.has_inf else math.nan
        if saturate:  # (|x| == inf, x != x: inductor vectorises these, not isinf/isnan)
            over_value = torch.where(xf.abs() == math.inf, overflow_value, fmt.max)
            a = torch.where(over, over_value, a)
        else:
            a = torch.where(over, overflow_value, a)
    if fmt.signed:
        r = with_sign(a, xf)
        if fmt.special == "fnuz":
            r = r + 0.0  # -0 + 0 = +0: fnuz has no negative zero
    else:
        r = torch.where(xf > 0, a, math.nan)
    r = torch.where(xf != xf, xf, r)
    return r.to(orig)


# ---------------------------------------------------------------------------------------
# The float8 bytes
# ---------------------------------------------------------------------------------------

# Formats whose storage is a 1-byte torch float dtype (the ones these functions handle).
BYTE_FORMATS: dict[Format, torch.dtype] = {
    f: dt for f, dt in _NATIVE.items() if dt.itemsize == 1 and dt.is_floating_point
}
# The format of each of those dtypes
BYTE_DTYPES: dict[torch.dtype, Format] = {dt: f for f, dt in BYTE_FORMATS.items()}


def _fields(fmt: Format) -> tuple[int, int, int]:
    """(mantissa bits, bias, largest finite code magnitude) of a 1-byte format."""
    if fmt not in BYTE_FORMATS:
        raise ValueError(f"fmt: {fmt.name} is not a 1-byte torch float8 format")
    m, bias = fmt.mantissa_bits, fmt._bias
    e_max = math.frexp(fmt.max)[1] - 1  # max = 2^e_max · (1 + mant / 2^M)
    mant = int((fmt.max / 2.0**e_max - 1.0) * 2**m)
    return m, bias, ((e_max + bias) << m) | mant


def encode(v: Tensor, fmt: Format, saturate: bool = True) -> Tensor:
    """``v`` (float32) rounded into the 1-byte ``fmt``, as that format's torch dtype
    (module docstring). ``saturate=False``: a finite value that rounds beyond ``±max``
    becomes NaN (``fn``, ``fnuz``) or ``±Inf`` (``ieee``), as torch's cast gives it.

    Integer arithmetic on ``|v|``'s bits ``b`` (few vector ops: the kernels that trace it
    are compute-bound on the CPU): saturating, ``b`` is first clamped to ``max``'s bits, so
    a finite overflow rounds to the largest code; the subnormal range is rounded by one
    float addition, ``|v| + 2^K`` with ``ulp(2^K)`` the format's smallest subnormal (its
    low bits are the code, rounded to nearest-even by the addition itself)."""
    m, bias, top = _fields(fmt)
    d = 23 - m
    b = v.view(torch.int32)
    ab = b & 0x7FFFFFFF
    special = ab >= 0x7F800000  # Inf or NaN (NaN: above)
    if saturate:
        abc = ab.clamp(max=_float_bits(fmt.max))
    else:
        abc = ab.clamp(max=0x7F800000)  # (keeps the sum below from wrapping)
    # Nearest-even on the low d bits; the rebias (127 - bias) << m, applied before the
    # shift as a multiple of 2^d, joins the rounding constant (floor shifts: exact).
    normal = (abc + (((1 << (d - 1)) - 1) - ((127 - bias) << 23)) + ((abc >> d) & 1)) >> d
    k = 23 - (bias - 1 + m)  # ulp(2^k) = 2^-(bias - 1 + m), the smallest subnormal
    sub = (v.abs() + 2.0**k).view(torch.int32) - ((127 + k) << 23)
    mag = torch.where(ab < ((127 + 1 - bias) << 23), sub, normal)
    inf = special
    if not saturate:  # overflow: as an Inf input (ieee: Inf; fn, fnuz: NaN)
        inf = inf | (mag > top)
    if fmt.special == "ieee":
        nan = ab > 0x7F800000
        mag = torch.where(inf, (1 << 7) - (1 << m), mag)  # all-ones exponent, mantissa 0
        mag = torch.where(nan, 0x7F, mag)  # torch's NaN code: every mantissa bit set
        code = ((b >> 24) & 0x80) | mag
    elif fmt.special == "fn":
        code = ((b >> 24) & 0x80) | torch.where(inf, 0x7F, mag)
    else:  # fnuz: one NaN code 0x80 (the negative zero's), no -0
        code = torch.where(inf, 0x80, torch.where(mag == 0, 0, ((b >> 24) & 0x80) | mag))
    return code.to(torch.uint8).view(BYTE_FORMATS[fmt])


def _float_bits(x: float) -> int:
    """The float32 bit pattern of ``x`` (a float32 value), as an int."""
    return int(struct.unpack("<i", struct.pack("<f", x))[0])


def decode(codes: Tensor, fmt: Format, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values of a 1-byte float ``codes`` tensor of ``fmt`` as ``dtype`` (float32 or
    bfloat16, which hold every value exactly): ``codes.to(dtype)``, NaN bits included
    (float32: torch's NaN payloads; bfloat16: the canonical quiet NaN)."""
    m, bias, _ = _fields(fmt)
    c = codes.view(torch.uint8).to(torch.int32)
    mag = c & 0x7F
    e, mant = mag >> m, mag & ((1 << m) - 1)
    normal = ((e + (127 - bias)) << 23) | (mant << (23 - m))
    sub = (mant.to(torch.float32) * 2.0 ** (1 - bias - m)).view(torch.int32)
    sign = (c >> 7) << 31
    bits = torch.where(e == 0, sub, normal)
    if fmt.special == "ieee":  # Inf: float32's all-ones exponent; NaN: quiet, payload kept
        top = (1 << 7) - (1 << m)
        bits = torch.where(mag == top, 0x7F800000, bits)
        bits = torch.where(mag > top, 0x7FC00000 | (mant << (23 - m)), bits)
        nan = mag > top
    elif fmt.special == "fn":  # NaN: all ones, payload kept as torch's cast keeps it
        nan = mag == 0x7F
        bits = torch.where(nan, 0x7F800000 | (mant << (23 - m)), bits)
    else:  # fnuz: the code 0x80 is NaN; torch gives it the bits 0x7F800001
        nan = c == 0x80
        sign = torch.where(nan, 0, sign)
        bits = torch.where(nan, 0x7F800001, bits)
    v = (bits | sign).view(torch.float32)
    if dtype == torch.float32:
        return v
    if dtype != torch.bfloat16:
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    b16 = v.to(dtype).view(torch.int16)
    return torch.where(nan, 0x7FC0, b16).to(torch.int16).view(dtype)  # torch's NaN


# ---------------------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------------------


def storage_dtype(fmt: str | Format) -> torch.dtype:
    """The torch dtype that holds every value of ``fmt`` exactly, using the fewest bytes:
    the format's own dtype when torch has one, else bf16, fp16 or fp32.

    Example:
        >>> storage_dtype("e4m3fn"), storage_dtype("e2m1"), storage_dtype("tf32")
        (torch.float8_e4m3fn, torch.bfloat16, torch.float32)
    """
    fmt = get_format(fmt, arg="fmt")
    if fmt.torch_dtype is not None:
        return fmt.torch_dtype
    for cand in (BF16, FP16, FP32):
        if (
            fmt.mantissa_bits <= cand.mantissa_bits
            and fmt.max <= cand.max
            and fmt.min_subnormal >= cand.min_subnormal
        ):
            dt = cand.torch_dtype
            assert dt is not None
            return dt
    return torch.float32
