"""An FP32 value as a BF16 value plus a 16-bit remainder, exactly.

A finite FP32 number ``x`` has the 32-bit pattern ``b`` (sign, 8 exponent bits, 23
mantissa bits). BF16 is the high half of that pattern, so ``x`` splits into

* ``hi = (b + 2^15) >> 16`` (arithmetic shift of the signed pattern): the BF16 pattern of
  ``x`` rounded to nearest, ties away from zero. Adding half a BF16 unit to the magnitude's
  pattern and truncating rounds the magnitude (the pattern of ``|x|`` is monotonic in
  ``|x|``, across binades and subnormals alike), and the sign bit rides along;
* ``lo = b - (hi << 16)``, a signed 16-bit integer in ``[-2^15, 2^15 - 1]`` whose two's
  complement bits are exactly the low 16 bits of ``b`` (``hi << 16`` has none).

Then ``b = (hi << 16) + lo`` in 32-bit integer arithmetic: :func:`join_fp32` rebuilds ``x``
bit for bit. Ties go away from zero, not to even: under ties-to-even ``p + ½ulp`` and
``p - ½ulp`` would both give ``p`` and the 16 low bits could not tell them apart. So
``hi`` differs from ``x.bfloat16()`` only on exact ties (low 16 bits ``0x8000``).

The model computes with ``hi`` (a BF16 parameter, 2 bytes) and the optimizer keeps ``lo``
(2 bytes): the FP32 master (4 bytes) at no extra cost. Limits: the BF16 view of a value
beyond BF16's largest finite value (``x ≥ (2 - 2^-8)·2^127``) is ``Inf`` while the pair
still rebuilds ``x``; NaN patterns do not round-trip (their payload may change).

Example:
    >>> import torch
    >>> x = torch.tensor([1.0 + 2**-20, -3.14159, 1e-40])
    >>> hi, lo = split_fp32(x)
    >>> hi.dtype, lo.dtype, bool((join_fp32(hi, lo) == x).all())
    (torch.bfloat16, torch.int16, True)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["join_fp32", "split_fp32"]


def split_fp32(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)``: ``x`` (float32) rounded to BF16 (nearest, ties away from zero) and the
    int16 remainder with ``join_fp32(hi, lo)`` bit-identical to ``x`` (module docstring)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"x must be a float32 tensor, got dtype {x.dtype}")
    b = x.contiguous().view(torch.int32)
    hi = torch.bitwise_right_shift(b + 0x8000, 16)
    lo = b - torch.bitwise_left_shift(hi, 16)
    return hi.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def join_fp32(hi: Tensor, lo: Tensor) -> Tensor:
    """The float32 tensor whose bit pattern is ``(hi << 16) + lo`` (``hi`` bfloat16, ``lo``
    int16 of the same shape): the inverse of :func:`split_fp32`."""
    if not isinstance(hi, Tensor) or hi.dtype != torch.bfloat16:
        raise TypeError(f"hi must be a bfloat16 tensor, got {getattr(hi, 'dtype', type(hi))}")
    if not isinstance(lo, Tensor) or lo.dtype != torch.int16:
        raise TypeError(f"lo must be an int16 tensor, got {getattr(lo, 'dtype', type(lo))}")
    if hi.shape != lo.shape:
        raise ValueError(f"lo: shape {tuple(lo.shape)}, hi's is {tuple(hi.shape)}")
    h = hi.contiguous().view(torch.int16).to(torch.int32)
    return (torch.bitwise_left_shift(h, 16) + lo.to(torch.int32)).view(torch.float32)
