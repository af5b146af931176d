"""Codes of number formats: the integer code of each value, and the float8 bytes fast.

:func:`to_bits` and :func:`from_bits` map values of any format (:mod:`lowprec.core.formats`)
to their integer codes and back, exactly (int64/float64 arithmetic).

:func:`encode` and :func:`decode` are the torch float8 formats' bytes in float32/int32
arithmetic, for compiled kernels (:mod:`lowprec.core.kernels`): torch's own casts between
float32 and the float8 dtypes are scalar loops on the CPU, eager and under inductor alike,
while these functions are integer and float32 arithmetic that inductor vectorises. They give
the bits of torch's casts as lowprec uses them:

* :func:`encode` is ``_cast_native(v, fmt, dtype, saturate)`` of
  :mod:`lowprec.core.rounding`: round to nearest, ties to even; finite overflow saturates
  to ``±max`` (``saturate=False``: NaN, or ``±Inf`` for ``ieee``); ``±Inf`` becomes NaN
  (``fn``, ``fnuz``) or stays ``±Inf`` (``ieee``); NaN stays NaN with its sign, all
  mantissa bits set (``fnuz``: the one NaN code ``0x80``; ``fnuz`` has no ``-0``).
* :func:`decode` is ``payload.to(float32)``.

For a format with ``M`` mantissa bits and bias ``B`` and a float32 magnitude ``a`` whose
bits are ``b``, the code's magnitude is

* ``a >= min_normal``: ``rne(b / 2^(23-M)) - (127 - B)·2^M``: the float32 exponent and
  mantissa fields are already the code's fields, rebiased; rounding the low ``23 - M``
  bits to nearest-even on the integer carries into the exponent exactly when the value
  rounds up to the next binade;
* ``a < min_normal``: ``rne(a · 2^(B - 1 + M))``, the multiple of the smallest subnormal
  (an exact power-of-two scaling; the result ``2^M`` is ``min_normal``'s code).

``tests/core/test_kernels.py`` checks both against torch's casts on every code, every
rounding boundary and tie, the specials and random values, eager and compiled.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lowprec.core.formats import _NATIVE, Format, get_format
from lowprec.core.rounding import _check_input, quantize

__all__ = ["BYTE_FORMATS", "decode", "encode", "from_bits", "to_bits"]

# Formats whose storage is a 1-byte torch float dtype (the ones these functions handle).
BYTE_FORMATS: dict[Format, torch.dtype] = {
    f: dt for f, dt in _NATIVE.items() if dt.itemsize == 1 and dt.is_floating_point
}


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
    becomes NaN (``fn``, ``fnuz``) or ``±Inf`` (``ieee``), as torch's cast gives it."""
    m, bias, top = _fields(fmt)
    d = 23 - m
    a = v.abs()
    big = 2.0 * fmt.max  # any finite magnitude above max: saturates below
    ac = torch.where(a <= big, a, big)  # NaN and Inf compare False: fixed at the end
    b = ac.view(torch.int32)
    normal = ((b + ((1 << (d - 1)) - 1) + ((b >> d) & 1)) >> d) - ((127 - bias) << m)
    sub = torch.round(ac * 2.0 ** (bias - 1 + m)).to(torch.int32)
    mag = torch.where(ac < fmt.min_normal, sub, normal)
    sign = (v.view(torch.int32) >> 31) & 1
    inf = a == math.inf  # (isinf and isnan are not vectorised by inductor on the CPU)
    nan = a != a
    if not saturate:  # overflow: as an Inf input (ieee: Inf; fn, fnuz: NaN)
        inf = inf | (mag > top)
    mag = mag.clamp(max=top)
    if fmt.special == "ieee":
        mag = torch.where(inf, (1 << 7) - (1 << m), mag)  # all-ones exponent, mantissa 0
        mag = torch.where(nan, 0x7F, mag)  # torch's NaN code: every mantissa bit set
    elif fmt.special == "fn":
        mag = torch.where(inf | nan, 0x7F, mag)
    else:  # fnuz: one NaN code 0x80 (the negative zero's), no -0
        bad = inf | nan
        sign = torch.where(bad, 1, torch.where(mag == 0, 0, sign))
        mag = torch.where(bad, 0, mag)
    return ((sign << 7) | mag).to(torch.uint8).view(BYTE_FORMATS[fmt])


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


def to_bits(x: Tensor, fmt: str | Format, saturate: bool = False) -> Tensor:
    """Integer codes (``int64``, in ``[0, 2^total_bits)``) of ``x`` rounded into ``fmt``.

    ``x`` is first rounded with :func:`~lowprec.core.rounding.quantize` (nearest, ties to
    even). NaN becomes the format's NaN code with the sign of the input where the format has
    a signed NaN (``fn``: all ones; ``ieee``: all-ones exponent and the top mantissa bit, a
    quiet NaN; ``fnuz``: ``0b1000...``). A NaN in a format without NaN (``finite``) raises
    ``ValueError``.

    Example:
        >>> import torch
        >>> to_bits(torch.tensor([1.0, -2.0, 448.0]), "e4m3fn").tolist()
        [56, 192, 126]
    """
    x = _check_input(x)
    fmt = get_format(fmt, arg="fmt")
    q = quantize(
        x.to(torch.float64) if x.dtype == torch.float64 else x.float(), fmt, saturate=saturate
    ).double()
    nan = torch.isnan(q)
    if not fmt.has_nan and bool(nan.any()):
        raise ValueError(f"x: contains NaN, which format {fmt.name} cannot encode")
    a = q.abs()
    m, bias = fmt.mantissa_bits, fmt._bias
    # Exponent and mantissa fields, from float64 bits (every float32 value is normal there).
    b = torch.where(nan | torch.isinf(a) | (a == 0), 1.0, a).view(torch.int64)
    e = ((b >> 52) & 0x7FF) - 1023
    mant = (b >> (52 - m)) & ((1 << m) - 1)
    efield = e + bias
    sub = efield <= 0 if fmt.signed else torch.zeros_like(nan)
    sub_mant = torch.round(a / fmt.min_subnormal).to(torch.int64)
    mag = torch.where(sub, sub_mant, (efield << m) | mant)
    mag = torch.where(a == 0, 0, mag)
    sign_bit = 1 << (fmt.exponent_bits + m)
    if fmt.special == "ieee":
        top = ((1 << fmt.exponent_bits) - 1) << m
        mag = torch.where(torch.isinf(a), top, mag)
        nan_mag = top | (1 << (m - 1)) if m > 0 else top
    elif fmt.special == "fnuz":
        nan_mag = 0
    else:
        nan_mag = (1 << (fmt.exponent_bits + m)) - 1
    mag = torch.where(nan, nan_mag, mag)
    if not fmt.signed:
        return mag
    negative = torch.signbit(q) if fmt.special != "fnuz" else (q < 0)
    if fmt.special == "fnuz":
        negative = negative | nan
    return torch.where(negative, mag | sign_bit, mag)


def from_bits(codes: Tensor, fmt: str | Format, dtype: torch.dtype = torch.float32) -> Tensor:
    """Values of the integer ``codes`` of ``fmt``, as ``dtype`` (default float32, which holds
    every format exactly). Codes must be in ``[0, 2^total_bits)``.

    Example:
        >>> import torch
        >>> from_bits(torch.tensor([56, 192, 126, 127]), "e4m3fn").tolist()
        [1.0, -2.0, 448.0, nan]
    """
    if not isinstance(codes, Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got dtype {codes.dtype}")
    fmt = get_format(fmt, arg="fmt")
    c = codes.to(torch.int64)
    if c.numel() and (bool((c < 0).any()) or bool((c >= fmt.num_codes).any())):
        raise ValueError(f"codes must lie in [0, {fmt.num_codes}) for format {fmt.name}")
    m, eb = fmt.mantissa_bits, fmt.exponent_bits
    mant = (c & ((1 << m) - 1)).double()
    efield = (c >> m) & ((1 << eb) - 1)
    if fmt.signed:
        normal = torch.ldexp(1.0 + mant * 2.0**-m, (efield - fmt._bias).double())
        sub = mant * fmt.min_subnormal
        mag = torch.where(efield == 0, sub, normal)
    else:
        mag = torch.ldexp(torch.ones_like(mant), (efield - fmt._bias).double())
    top_e = efield == (1 << eb) - 1
    if fmt.special == "ieee":
        mag = torch.where(top_e & (mant == 0), math.inf, mag)
        mag = torch.where(top_e & (mant != 0), math.nan, mag)
    elif fmt.special == "fn":
        mag = torch.where(top_e & (mant == (1 << m) - 1), math.nan, mag)
    sign = (c >> (eb + m)) & 1 if fmt.signed else torch.zeros_like(c)
    val = torch.where(sign == 1, -mag, mag)
    if fmt.special == "fnuz":
        val = torch.where(c == (1 << (eb + m)), math.nan, val)
    return val.to(dtype)
