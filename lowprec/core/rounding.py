"""Rounding into a number format (:mod:`lowprec.core.formats`): quantize, casts, bits.

:func:`quantize` rounds a tensor to the nearest representable value (ties to even) or
stochastically, bit-exact with ``ml_dtypes`` for inputs of 32 bits or fewer (a float64
input is rounded once, where ``ml_dtypes`` rounds it to float32 first). Out-of-range and
special inputs map as follows (``saturate`` only changes finite overflow):

================== ============ ============ ============ ===========================
input              ieee         fn           fnuz         finite (no Inf, no NaN)
================== ============ ============ ============ ===========================
finite overflow    ±Inf / ±max  NaN / ±max   NaN / ±max   ±max
±Inf               ±Inf         NaN          NaN          ±max
NaN                NaN          NaN          NaN          NaN (ml_dtypes gives ∓0)
-0 or tiny < 0     -0           -0           +0           -0
================== ============ ============ ============ ===========================

(``A / B`` is ``saturate=False`` / ``saturate=True``.) For formats without a NaN code the
result stays NaN: the value of a NaN is not a number in any format, and silently turning
it into zero, as ``ml_dtypes`` does, would hide a bug. E8M0 maps zero, negative numbers and
Inf to NaN, and rounds a value half-way between two powers of two *up* — following the
fp32 bit pattern as torch and ``ml_dtypes`` do (so a value in fp32's subnormal range
above ``2^-127`` rounds to ``2^-126``; ``2^-127`` itself is E8M0's smallest value).

The work happens on float32 bits (float64 bits for float64 inputs, so a float64 value is
rounded once, never twice): :func:`lowprec.core.bits.round_bits`, which this module checks
the arguments of and dispatches to. Where torch has a native dtype that rounds exactly like
this, the native cast is used (fp16, bf16, the four float8 dtypes), with shortcuts eager
on the CPU that the largest magnitude of the input picks (off inside
:func:`lowprec.core.layout.reference_paths`); a large CPU tensor is rounded by a compiled
kernel (:mod:`lowprec.core.kernels`). Every path gives the same bits.
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from lowprec.core import kernels
from lowprec.core.bits import (
    BYTE_FORMATS,
    counter_bits,
    draw_bits,
    encode,
    round_bits,
    storage_dtype,
    with_sign,
)
from lowprec.core.formats import _ELIDED, _NATIVE, Format, Rounding, get_format
from lowprec.core.layout import dense_view, fast_paths

# (storage_dtype, the dtype to_format returns, lives with the bit arithmetic in
# lowprec.core.bits and is named here too: it is part of to_format's contract)
__all__ = ["quantize", "snr_db", "storage_dtype", "to_format", "to_format_bounded"]

# ---------------------------------------------------------------------------------------
# Rounding
# ---------------------------------------------------------------------------------------

_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_input(x: object, arg: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(
            f"{arg} must be a floating-point tensor, got dtype {x.dtype} "
            "(integer, bool and complex tensors cannot be quantized)"
        )
    return x


def _check_saturate(saturate: object) -> None:
    """``saturate`` must be a bool: a truthy string such as ``"no"`` would silently clamp."""
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be a bool, got {type(saturate).__name__} {saturate!r}")


def _check_rounding(rounding: str, fmt: Format, dtype: torch.dtype) -> None:
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic":
        src = get_format(dtype) if dtype != torch.float64 else None
        narrower = src is None or (
            fmt.mantissa_bits < src.mantissa_bits
            and fmt.max <= src.max
            and fmt.min_subnormal >= src.min_subnormal
        )
        if not narrower:
            raise ValueError(
                f"rounding='stochastic': x's dtype {dtype} cannot carry stochastic rounding "
                f"into {fmt.name}; the input must have more mantissa bits than the format "
                f"({fmt.mantissa_bits}) and cover its range"
            )
        if not fmt.signed:
            raise ValueError(f"rounding='stochastic' is not defined for {fmt.name}")


def quantize(
    x: Tensor,
    fmt: str | Format,
    rounding: Rounding = "nearest",
    saturate: bool = False,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> Tensor:
    """Round ``x`` to the nearest value of ``fmt``; return it in ``x``'s dtype.

    ``rounding="nearest"`` rounds to nearest, ties to even, bit-exact with ``ml_dtypes``
    for inputs of 32 bits or fewer (float64 is rounded once, never via float32; see the
    module docstring for overflow, Inf, NaN and signed zero).
    ``rounding="stochastic"`` rounds ``|x|`` down or up to its two neighbours ``lo < |x| < hi``
    with ``P(hi) = (|x| - lo) / (hi - lo)``, so ``E[quantize(x)] = x`` (exactly in the normal
    range; in the subnormal range the probability is quantised to ``2^-23``, or ``2^-52``
    for float64 input). Pass a ``torch.Generator`` for reproducible draws (one
    ``torch.randint`` over ``x``'s shape: :func:`lowprec.core.bits.draw_bits`), or a ``seed``
    (an int in ``[0, 2^64)``) for counter-based draws: element ``i`` of ``x`` in row-major
    order draws :func:`lowprec.core.bits.counter_bits` of ``(seed, i)``, computed inside the
    rounding kernel (float32, float16 and bfloat16 inputs; the result is contiguous).
    ``saturate=True`` clamps finite values beyond ``±fmt.max`` to ``±fmt.max``.

    If ``fmt`` has values that ``x``'s dtype cannot hold (``quantize(bf16_tensor, "fp16")``),
    the rounded value is cast back to ``x.dtype`` with round-to-nearest-even.

    Example:
        >>> import torch
        >>> quantize(torch.tensor([1.0, 1.0625, 1.1875, 500.0]), "e4m3fn").tolist()
        [1.0, 1.0, 1.25, nan]
        >>> quantize(torch.tensor([500.0]), "e4m3fn", saturate=True).tolist()
        [448.0]
    """
    x = _check_input(x)
    fmt = get_format(fmt, arg="fmt")
    _check_rounding(rounding, fmt, x.dtype)
    _check_saturate(saturate)
    if seed is None:  # (with a seed: the counter path's own message)
        check_generator(generator, rounding)
    elif generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if seed is not None:
        return _quantize_counter(x, fmt, rounding, saturate, generator, seed)
    native = _native_for(x, fmt, rounding)
    if native is not None:
        return _quantize_native(x, fmt, native, saturate)
    if rounding == "nearest" and kernels.takes(x):
        y = kernels.run_quantize(x, fmt, saturate)  # the same function, compiled
        if y is not None:
            return y
    rand = None
    if rounding == "stochastic" and kernels.takes(x, threshold=kernels.MIN_NUMEL_SR):
        # the draws taken here, as round_bits would take them; the kernel rounds with them
        rand = draw_bits(x.shape, x.dtype, generator, x.device)
        if x.is_contiguous():
            y = kernels.run_quantize(x, fmt, saturate, rand)
            if y is not None:
                return y
    return round_bits(x, fmt, rounding, saturate, generator, rand)


def check_generator(generator: object, rounding: str) -> None:
    """``TypeError`` for a ``generator`` that is not a ``torch.Generator``; ``ValueError``
    for one given with ``rounding="nearest"``, which draws nothing (it would be ignored)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if rounding != "stochastic":
        raise ValueError(
            f"generator: rounding={rounding!r} draws nothing; a generator is for "
            "rounding='stochastic'"
        )


def _quantize_counter(
    x: Tensor, fmt: Format, rounding: str, saturate: bool, generator: object, seed: object
) -> Tensor:
    """:func:`quantize` with ``seed``: stochastic rounding with counter-based draws."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2^64), got {seed!r}")
    if rounding != "stochastic" or generator is not None:
        raise ValueError(
            "seed: counter-based draws are for rounding='stochastic' without a generator"
        )
    if x.dtype not in _FLOAT_INPUTS[:3]:
        raise ValueError(f"seed: counter-based draws take float32/16-bit inputs, not {x.dtype}")
    keys = torch.tensor([seed & 0xFFFFFFFF, seed >> 32], dtype=torch.int64, device=x.device)
    xf = x.float().contiguous()
    y = None
    if kernels.takes(xf, threshold=kernels.MIN_NUMEL_SR):
        y = kernels.run_quantize_counter(xf, fmt, saturate, keys)
    if y is None:
        idx = torch.arange(xf.numel(), dtype=torch.int64, device=x.device).view(xf.shape)
        y = round_bits(xf, fmt, "stochastic", saturate, rand=counter_bits(keys, idx))
    return y.to(x.dtype)


def _native_for(x: Tensor, fmt: Format, rounding: str) -> torch.dtype | None:
    """The torch dtype whose cast rounds ``x`` into ``fmt`` exactly, or None for the bit path.

    Under torch.compile fp16/bf16 use the bit path: inductor drops a cast round trip
    fp32 -> fp16/bf16 -> fp32 (unless emulate_precision_casts), which would skip the
    rounding. float8 round trips are kept (tests/test_formats.py checks both).
    """
    native = _NATIVE.get(fmt)
    if (
        rounding != "nearest"
        or native is None
        or x.dtype not in _FLOAT_INPUTS[:3]
        or (torch.compiler.is_compiling() and native in _ELIDED)
    ):
        return None
    return native


_ENCODES = (torch.float32, torch.float16, torch.bfloat16)  # (exact in float32)


def _cast_native(
    x: Tensor, fmt: Format, native: torch.dtype, saturate: bool, absmax: float | None = None
) -> Tensor:
    """Round ``x`` (fp32/fp16/bf16) into ``fmt`` with torch's cast; result in ``native``.

    Written for speed under ``torch.compile``: ``|x| == inf`` instead of ``isinf`` (which
    inductor does not vectorise on CPU) and no clamp where the cast saturates by itself.
    Eager on CPU, the largest magnitude of ``x`` (``absmax``, given by a caller that knows
    it, else read with one ``aminmax`` pass; :func:`_absmax_eager`) picks the shortest
    sequence of passes that gives the same bits as the general masked path.
    """
    if native == x.dtype:
        return x.clone()
    if (
        torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in _ENCODES
        and BYTE_FORMATS.get(fmt) == native
    ):
        # Traced for inductor's CPU code: the same bits on the bit pattern (encode's
        # contract), in fewer vector ops than torch's own float8 conversion.
        return encode(x.float(), fmt, saturate)
    if absmax is None:
        absmax = _absmax_eager(x)
    # the clamp bound in x's dtype (a wider format's max does not fit in, e.g., fp16)
    top = min(fmt.max, torch.finfo(x.dtype).max)
    if not _holds(x.dtype, top):  # (bf16 -> fp16: 65504 clamped in bf16 is 65536, Inf)
        x = x.float()  # exact; torch's cast to ``native`` goes through float32 anyway
    if absmax is not None and fast_paths():
        # Every |x| <= absmax: NaN compares False, so a NaN or Inf skips these shortcuts.
        if absmax <= fmt.max:
            return x.to(native)  # nothing to saturate or turn into NaN: one plain cast
        if absmax < math.inf and fmt.special == "fn":
            tie = fmt.max + 2.0 ** (fmt.max_exponent - fmt.mantissa_bits - 1)
            if (saturate and _cast_saturates(x.device)) or (not saturate and absmax <= tie):
                return x.to(native)  # finite: the general path's masks are all False
        if absmax < math.inf and fmt.special != "fn" and saturate:
            return x.clamp(-top, top).to(native)  # finite: no Inf to keep
    if fmt.special == "fn":
        # torch's fp32 -> float8_e4m3fn cast saturates on some versions and devices (2.13's
        # CPU cast, even Inf; not 2.11's: _cast_saturates); ml_dtypes gives NaN.
        # Above max + half an ulp (the tie rounds down to max's even mantissa) is overflow;
        # that test also catches ±Inf, and NaN compares False (it stays NaN, sign kept).
        if saturate:
            over = x.abs() == math.inf
            if not _cast_saturates(x.device):
                x = x.clamp(-top, top)
        else:
            tie = fmt.max + 2.0 ** (fmt.max_exponent - fmt.mantissa_bits - 1)
            over = x.abs() > tie
        nan = with_sign(torch.full_like(x, math.nan), x)  # signed, as ml_dtypes
        return torch.where(over, nan, x).to(native)
    if saturate:
        x = torch.where(x.abs() == math.inf, x, x.clamp(-top, top))
    return x.to(native)


def _absmax_eager(x: Tensor) -> float | None:
    """Eager CPU: the largest ``|x|`` (NaN if ``x`` holds a NaN) as a Python float, read in
    one ``aminmax`` pass without temporaries; ``None`` under ``torch.compile`` (a
    data-dependent branch), off the CPU (it would synchronise) and for an empty ``x``."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.numel() == 0:
        return None
    lo, hi = torch.aminmax(dense_view(x))
    return float(torch.maximum(hi, -lo))


def _probe_saturation(device: torch.device) -> bool:
    """Whether torch's float32 -> float8_e4m3fn cast on ``device`` turns 1e30 into 448."""
    x = torch.tensor([1e30], device=device)
    return float(x.to(torch.float8_e4m3fn).float().item()) == 448.0


# Per device type, whether that cast saturates finite overflow (torch 2.13's CPU cast does,
# 2.11's does not). The CPU's is probed at import, so that code torch.compile traces for the
# CPU reads it as a constant.
_SATURATES: dict[str, bool] = {"cpu": _probe_saturation(torch.device("cpu"))}


def _holds(dtype: torch.dtype, v: float) -> bool:
    """Whether ``dtype`` (float32, float16 or bfloat16) holds the finite float32 ``v``
    exactly (pure Python: a constant under ``torch.compile``)."""
    b: int = struct.unpack("<I", struct.pack("<f", v))[0]
    if dtype == torch.bfloat16:
        return b & 0xFFFF == 0
    if dtype == torch.float16:
        try:
            return float(struct.unpack("<e", struct.pack("<e", v))[0]) == v
        except OverflowError:
            return False
    return True


def _cast_saturates(device: torch.device) -> bool:
    """Whether torch's float32 -> float8_e4m3fn cast saturates finite overflow on
    ``device``'s type: each device type has its own cast kernel, so each is probed once,
    eagerly; under ``torch.compile``, on the meta device or where the probe cannot be read
    (fake tensors), an unprobed type counts as not saturating: the clamp is kept (traced,
    it fuses into the cast's kernel)."""
    known = _SATURATES.get(device.type)
    if known is not None:
        return known
    if torch.compiler.is_compiling() or device.type == "meta":
        return False
    try:
        known = _probe_saturation(device)
    except RuntimeError:  # a fake tensor's data cannot be read
        return False
    _SATURATES[device.type] = known
    return known


def _quantize_native(x: Tensor, fmt: Format, native: torch.dtype, saturate: bool) -> Tensor:
    absmax = _absmax_eager(x)
    y = _cast_native(x, fmt, native, saturate, absmax).to(x.dtype)
    if fast_paths() and absmax is not None and absmax == absmax:
        return y  # no NaN in x: nothing to restore
    # Keep an input NaN as it is (its sign too, as the bit path does): torch's casts
    # drop or set the sign of NaN depending on the dtype.
    return torch.where(torch.isnan(x), x, y)


def to_format_bounded(x: Tensor, fmt: Format, saturate: bool, absmax: float | None) -> Tensor:
    """:func:`to_format` (nearest) for a caller that knows ``absmax`` >= every ``|x|`` (NaN
    when ``x`` may hold a NaN; ``None``: unknown). Same bits as ``to_format``."""
    native = _native_for(x, fmt, "nearest")
    if native is not None:
        return _cast_native(x, fmt, native, saturate, absmax)
    return quantize(x, fmt, "nearest", saturate).to(storage_dtype(fmt))


def to_format(
    x: Tensor,
    fmt: str | Format,
    rounding: Rounding = "nearest",
    saturate: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Like :func:`quantize`, but return the result in :func:`storage_dtype` of ``fmt``
    (float8 for the float8 formats: one byte per value), in a single cast where torch can.

    Example:
        >>> import torch
        >>> to_format(torch.tensor([1.0, 1.0625]), "e4m3fn")
        tensor([1., 1.], dtype=torch.float8_e4m3fn)
    """
    x = _check_input(x)
    fmt = get_format(fmt, arg="fmt")
    _check_saturate(saturate)
    native = _native_for(x, fmt, rounding)
    if native is not None and native.itemsize == 1 and kernels.takes(x, fmt):
        q = kernels.run_scaled_encode(x, torch.ones((), device=x.device), fmt, saturate)
        if q is not None:  # the same bits in one vectorised pass
            return q
    if native is not None:
        return _cast_native(x, fmt, native, saturate)
    return quantize(x, fmt, rounding, saturate, generator).to(storage_dtype(fmt))


# ---------------------------------------------------------------------------------------
# Signal-to-noise ratio
# ---------------------------------------------------------------------------------------


def snr_db(x: Tensor, fmt: str | Format, saturate: bool = False) -> float:
    """Signal-to-noise ratio ``10·log10(Σx² / Σ(x - q(x))²)`` of rounding ``x`` into ``fmt``.

    Computed in float64. An element that overflows to Inf/NaN counts as lost (its error
    is ``x`` itself), so a fully overflowed tensor reads 0 dB and a fully underflowed one
    (``q(x) = 0``) also reads 0 dB. Returns ``inf`` when rounding is exact.
    """
    x64 = _check_input(x).double()
    q = quantize(x64, fmt, saturate=saturate)
    err = torch.where(torch.isfinite(q), x64 - q, x64)
    signal = float((x64**2).sum())
    noise = float((err**2).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)
