"""Codes of number formats: the integer code of each value.

:func:`to_bits` and :func:`from_bits` map values of any format (:mod:`lowprec.core.formats`)
to their integer codes and back, exactly (int64/float64 arithmetic). (The float8 bytes in
vectorisable float32/int32 arithmetic, for the compiled kernels, are
:func:`lowprec.core.bits.encode` and :func:`~lowprec.core.bits.decode`.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lowprec.core.formats import Format, get_format
from lowprec.core.rounding import _check_input, quantize

__all__ = ["from_bits", "to_bits"]


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
