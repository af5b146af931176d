"""Scales: turning statistics of a tensor into the scale that fits it into a format.

Convention (shared by every technique): a tensor ``x`` is stored as ``data × scale`` with
``data = x / scale`` in a narrow format. For a block whose largest magnitude is ``amax``,
the format's largest finite value ``fmt.max`` and a margin of ``m`` binades of headroom,

    scale = amax · 2^m / fmt.max        so that  |data| <= fmt.max · 2^-m.

With ``power_of_two=True`` the scale is rounded *up* to a power of two (:func:`round_pow2`,
the one power-of-two rounding of the package), which keeps ``|data| <= fmt.max · 2^-m``
and makes the division exact. The scale is clamped to
``[2^-126, 2^127]`` so it is always a normal float32 number.

Special statistics (no division by zero, never a NaN scale):

* ``amax == 0`` (an all-zero block): scale ``1``;
* ``amax`` is Inf or NaN (the block holds Inf/NaN): scale ``1`` — finite values are rounded
  as if unscaled and the Inf/NaN values themselves stay visible in the data. Stateful
  scalers count such an ``amax`` (``nonfinite_count``) and do not record it: a delayed
  scaler's history repeats its newest entry in its place and the block keeps the
  history's scale; a calibrating static scaler records 0 for it and the block gets the
  scale of the maximum so far (:mod:`lowprec.core.scalers`).

A *scaled cast* (:func:`lowprec.core.tensor.quantize_scaled`, the float8 operands) never
turns a non-finite value into a finite one: :func:`nonfinite_scale` gives a block whose
``amax`` is not finite the NaN scale, so that the whole block reads NaN, where the block
cannot carry the value itself: an MX or NVFP4 block (the OCP MX rule) and any block of a
format without Inf and NaN codes (E2M1, E3M2, E2M3, which would otherwise clamp ±Inf to
``±max``). Elsewhere the scale stays 1 and the value stays as the cast gives it: ±Inf in
formats with Inf (E5M2, FP16, BF16), NaN in those without (E4M3FN, E4M3FNUZ). So an
overflow upstream, a gradient's above all, stays visible to loss scaling
(``docs/formats.md``).

Scales are float32, so a scale covers ``[2^-126, 2^127]`` (times ``fmt.max``). float64
inputs beyond that (the only way to get them: float32 has no such values) are refused or
reported, never silently changed:

* a finite float64 ``amax`` (or a float64 tensor's largest magnitude) above float32's
  largest finite value raises ``ValueError``: no float32 scale could hold it, and
  rounding would saturate it to ``fmt.max`` (``1e300 → 448``);
* a non-zero float64 magnitude below float32's smallest normal ``2^-126``: a float64
  ``amax`` given to :func:`compute_scale` / :func:`mx_scale` is used in float64 and the
  scale clamped to its smallest value, as usual; :func:`amax` of such a tensor
  underflows (to a subnormal or 0, an all-zero block's scale 1). Either way the data
  rounds to 0 as ``1e-45`` does in float32 (``1e-300 → 0``), and :func:`amax` logs it
  once at WARNING (:func:`~lowprec.core.warn.warn_once`), as the values are lost.
"""

from __future__ import annotations

import logging
import math
from typing import Literal, overload

import torch
from torch import Tensor

from lowprec.core import kernels
from lowprec.core.formats import E8M0, Format, get_format
from lowprec.core.granularity import Granularity, _block_views, as_granularity
from lowprec.core.layout import dense_view
from lowprec.core.rounding import quantize
from lowprec.core.warn import warn_once

__all__ = [
    "Pow2Mode",
    "ScaleOverflowError",
    "amax",
    "check_margin",
    "check_scaled_cast",
    "compute_scale",
    "group_scale",
    "mx_scale",
    "nv_scale",
    "round_pow2",
]


class ScaleOverflowError(ValueError):
    """A scale computed from others left float32 (Inf, NaN or negative): the values it
    stands for are beyond float32's range, as FP32 arithmetic would overflow there. A
    training step treats it as a non-finite step (:func:`lowprec.recipes.step.train_step`
    with ``skip_nonfinite``)."""


_MIN_SCALE = 2.0**-126
_MAX_SCALE = 2.0**127
_F32_MAX = float(torch.finfo(torch.float32).max)
_LOG = logging.getLogger(__name__)


def _check_f64_range(a: Tensor, name: str) -> None:
    """``ValueError`` if float64 ``a`` holds a finite magnitude above float32's range;
    a WARNING (once) if it holds a non-zero one below float32's normal range."""
    if a.dtype != torch.float64 or not a.numel():
        return
    m = a.detach().abs()
    fin = torch.where(torch.isfinite(m), m, 0.0)
    big = float(fin.max())
    if big > _F32_MAX:
        raise ValueError(
            f"{name}: finite float64 magnitude {big:.4g} lies beyond float32's range "
            f"({_F32_MAX:.4g}), in which scales are computed; rescale it into range first"
        )
    tiny = torch.where(fin > 0, fin, math.inf).min()
    if float(tiny) < _MIN_SCALE:
        warn_once(
            _LOG,
            "scales:f64-underflow",
            "%s: float64 magnitudes down to %.4g lie below float32's normal range (2^-126): "
            "the scale is clamped to 2^-126 and such values round to 0",
            name,
            float(tiny),
        )


# ---------------------------------------------------------------------------------------
# Statistics -> scale
# ---------------------------------------------------------------------------------------


def amax(x: Tensor, granularity: str | Granularity = "tensor") -> Tensor:
    """Largest magnitude per scaling group, as float32 of shape ``granularity.scale_shape``.

    NaN propagates (a group holding a NaN has amax NaN); Inf gives Inf; an empty group
    (a zero-size dim) has amax 0. A float64 ``x``
    is checked against float32's range (module docstring): ``ValueError`` above it, a
    WARNING below its normal range (such an amax underflows to 0 or a subnormal).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    g = as_granularity(granularity)
    shape = g.scale_shape(x.shape)
    _check_f64_range(x, "x")
    if g.kind == "tensor":
        if not x.numel():
            return torch.zeros((), device=x.device)
        # aminmax reads x once without an |x| temporary (10x faster eager on CPU than
        # x.abs().amax()); maximum() propagates NaN.
        # (dense_view: a transposed matrix is read in storage order, 10x faster again.)
        lo, hi = torch.aminmax(dense_view(x.detach()))
        return torch.maximum(hi, -lo).float()
    if not x.numel():  # every group empty: amax 0 (an all-zero group's scale is 1)
        return torch.zeros(shape, device=x.device)
    if kernels.takes(x.detach()):  # (float32/16, bf16 on the CPU, large, fast paths on)
        out = kernels.run_block_amax(x.detach(), tuple(shape))  # one fused pass
        if out is not None:
            return out
    a = x.detach().abs()
    dview, sview, _ = _block_views(tuple(x.shape), shape)
    red = tuple(i for i, s in enumerate(sview) if s == 1)
    return a.reshape(dview).amax(dim=red, keepdim=True).reshape(shape).float()


_MAX_MARGIN = 256.0  # float32 scales span 2^-126..2^127: a larger margin means nothing


def check_margin(margin: float) -> float:
    """``margin`` as a float; ``ValueError`` unless finite with ``|margin| <= 256`` (the
    whole float32 scale range is 253 binades: a larger margin saturates or flushes
    every value)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be a number of binades, got {type(margin).__name__}")
    if not (math.isfinite(margin) and abs(margin) <= _MAX_MARGIN):
        raise ValueError(f"margin must be finite with |margin| <= {_MAX_MARGIN:g}, got {margin}")
    return float(margin)


def check_scaled_cast(fmt: Format, kind: str, power_of_two: bool) -> None:
    """``ValueError`` for a scaled cast of signed values (``x / scale`` into ``fmt``, the
    scale of a granularity of kind ``kind``) that would compute something else than it
    says: an unsigned element format (E8M0 is a scale format: every negative value would
    be NaN), ``"nv"`` with another element format than E2M1, ``power_of_two`` with ``"mx"``
    (its scales are powers of two already) or ``"nv"`` (its block scales are E4M3 values)."""
    if not fmt.signed:
        raise ValueError(
            f"fmt {fmt.name!r} is unsigned (a scale format): a scaled cast needs a signed "
            "element format (every negative value would be NaN)"
        )
    if kind == "nv" and fmt.name != "e2m1":
        raise ValueError(f"granularity 'nv' (NVFP4) needs fmt 'e2m1', got {fmt.name!r}")
    if kind in ("mx", "nv") and power_of_two:
        why = (
            "MX scales are powers of two by definition (mx_scale='ceil' rounds "
            "amax / fmt.max up to one)"
            if kind == "mx"
            else "NVFP4 block scales are E4M3 values, not powers of two"
        )
        raise ValueError(f"power_of_two=True does not apply to granularity {kind!r}: {why}")


def _amax_arg(amax: Tensor) -> Tensor:
    """``amax`` checked (a floating tensor; float64 within float32's range) in float64
    when it is float64 (so a tiny value clamps instead of flushing to 0), else float32."""
    if not isinstance(amax, Tensor):
        raise TypeError(f"amax must be a torch.Tensor, got {type(amax).__name__}")
    if not amax.dtype.is_floating_point:
        raise TypeError(f"amax must be a floating-point tensor, got dtype {amax.dtype}")
    _check_f64_range(amax, "amax")
    return amax.detach() if amax.dtype == torch.float64 else amax.float()


Pow2Mode = Literal["none", "down", "up"]
_POW2_MODES = ("none", "down", "up")


@overload
def round_pow2(s: Tensor, mode: Pow2Mode = "up") -> Tensor: ...
@overload
def round_pow2(s: float, mode: Pow2Mode = "up") -> float: ...
def round_pow2(s: Tensor | float, mode: Pow2Mode = "up") -> Tensor | float:
    """Round ``s`` to a power of two: ``"up"`` gives ``2^⌈log2 s⌉``, ``"down"`` ``2^⌊log2 s⌋``,
    ``"none"`` returns ``s`` unchanged.

    Contract: exact (computed on the binary exponent, never through ``log2``, so no value
    is pushed across a power of two by a rounded logarithm), including subnormals; a
    power of two is returned unchanged. Entries that are not positive and finite (zero,
    negative, Inf, NaN) are returned unchanged. ``"up"`` of a value above the dtype's
    largest power of two overflows to Inf. A tensor keeps its dtype and shape; a Python
    ``float`` or ``int`` gives a ``float``.

    Example:
        >>> import torch
        >>> round_pow2(torch.tensor([3.0, 0.75, 4.0, 0.0, -3.0]), "up").tolist()
        [4.0, 1.0, 4.0, 0.0, -3.0]
        >>> round_pow2(3.0, "down"), round_pow2(float("inf"), "up")
        (2.0, inf)
    """
    if mode not in _POW2_MODES:
        raise ValueError(f"mode must be 'none', 'down' or 'up', got {mode!r}")
    if isinstance(s, Tensor):
        if not s.dtype.is_floating_point:
            raise TypeError(f"s must be a floating-point tensor, got dtype {s.dtype}")
        if mode == "none":
            return s
        return _round_pow2_tensor(s, mode == "up")
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"s must be a float or a tensor, got {type(s).__name__}")
    s = float(s)
    if mode == "none" or not (math.isfinite(s) and s > 0):
        return s
    m, e = math.frexp(s)  # s = m · 2^e, 0.5 <= m < 1
    if m == 0.5:
        return s
    return math.ldexp(1.0, e if mode == "up" else e - 1)


def _round_pow2_tensor(s: Tensor, up: bool) -> Tensor:
    ok = torch.isfinite(s) & (s > 0)
    if s.dtype == torch.float64:
        m, e = torch.frexp(s)
        r = torch.ldexp(torch.ones_like(s), (e if up else e - 1).to(s.dtype))
        r = torch.where(m == 0.5, s, r)
        return torch.where(ok, r, s)
    # float32 (float16/bfloat16 are exact in float32): round on the bit pattern, with
    # subnormals first lifted by 2^64 (exact) so every input is a normal float32.
    x = s.float()
    tiny = x < _MIN_SCALE
    x = torch.where(tiny, x * 2.0**64, x)
    bits = x.view(torch.int32)
    if up:  # next exponent unless the mantissa is zero; Inf stays Inf
        bits = bits + ((1 << 23) - 1)
    r = (bits & -(1 << 23)).view(torch.float32)
    r = torch.where(tiny, r * 2.0**-64, r)
    return torch.where(ok, r.to(s.dtype), s)


def _div_const(x: Tensor, c: float) -> Tensor:
    """``x / c`` for a float32 (or float64) ``x`` and a Python float ``c`` with at most 24
    significant bits (a format's max times a power of two), correctly rounded on every
    device, eager or compiled.

    On the CPU, eager (ATen divides) and compiled (inductor's C++ divides, unless its
    ``cpp.enable_unsafe_math_opt_flag`` lets the compiler multiply by a reciprocal), it is
    one float32 division: a float64 quotient traced into a compiled loop costs two
    conversions and a float64 division per element wherever inductor recomputes a scale in
    its consumer's loop (a row-wise scale, per output element). Eager CUDA and inductor's
    GPU code divide by a constant as a product with its rounded
    reciprocal, off by an ulp now and then. So the quotient is formed in float64 and
    rounded once to float32: where float64's quotient is itself correctly rounded, the
    double rounding is innocuous (53 >= 2·24 + 2 bits); where it is the reciprocal's
    product, its relative error is below 2^-52, while ``x / c`` lies at least 2^-48
    (relative) from every float32 rounding midpoint, never on one (a midpoint times ``c``
    has 25 or more significant bits, ``x`` has 24): the same float32 either way
    (``tests/core/test_scaling.py`` checks both on random and boundary values).
    """
    if x.dtype == torch.float64 or x.device.type == "cpu":
        return x / c
    return (x.double() / c).to(x.dtype)


def compute_scale(
    amax: Tensor, fmt: str | Format, margin: float = 0.0, power_of_two: bool = False
) -> Tensor:
    """``scale = amax · 2^margin / fmt.max`` (float32), optionally rounded up to a power of 2.

    Zero, Inf and NaN ``amax`` give scale 1 (see the module docstring), and so does a
    negative value, which no ``amax`` is (checking would cost a host sync); the scale is
    clamped to ``[2^-126, 2^127]``. ``margin``: finite, ``|margin| <= 256`` (else
    ``ValueError``). A float64 ``amax`` is used in float64 (a finite value beyond float32's
    range raises ``ValueError``; module docstring). The division is correctly rounded on
    every device for an integer ``margin``; a fractional one gives the divisor 53
    significant bits, and off the CPU the scale may then be one float32 ulp from it.

    Example:
        >>> import torch
        >>> compute_scale(torch.tensor(896.0), "e4m3fn").item()
        2.0
        >>> compute_scale(torch.tensor([0.0, float("nan"), 3.0]), "e4m3fn", power_of_two=True)
        tensor([1.0000, 1.0000, 0.0078])
    """
    fmt = get_format(fmt, arg="fmt")
    margin = check_margin(margin)
    a = _amax_arg(amax)
    ok = torch.isfinite(a) & (a > 0)
    # One correctly rounded division (fmt.max · 2^-margin is exact: a power-of-two multiple,
    # applied as two ldexp steps so that 2^±256 never overflows a float).
    div = math.ldexp(fmt.max, -int(margin)) * 2.0 ** -(margin - int(margin))
    s = _div_const(torch.where(ok, a, 1.0), div).clamp(_MIN_SCALE, _MAX_SCALE).float()
    if power_of_two:
        s = round_pow2(s, "up").clamp(max=_MAX_SCALE)
    return torch.where(ok, s, 1.0)


def mx_scale(amax: Tensor, fmt: str | Format, margin: float = 0) -> Tensor:
    """OCP MX shared scale ``2^(floor(log2 amax) - emax_elem + margin)``, clamped to E8M0's
    range.

    ``emax_elem`` is the exponent of ``fmt.max`` (e4m3fn: 8, e5m2: 15, e2m1: 2). Returned as
    float32 values that are exactly representable in E8M0. Zero/Inf/NaN amax give 1. A
    float64 ``amax`` beyond float32's range raises ``ValueError``; a tiny one gets E8M0's
    smallest scale (module docstring). ``margin``: binades of headroom, an integer shift
    of the E8M0 exponent (``ValueError`` unless a whole number with ``|margin| <= 256``,
    ``TypeError`` unless a number): the OCP scale times ``2^margin`` where that stays in
    E8M0's range.

    Example:
        >>> import torch
        >>> mx_scale(torch.tensor([448.0, 3.0]), "e4m3fn").tolist()
        [1.0, 0.0078125]
        >>> mx_scale(torch.tensor([448.0, 3.0]), "e4m3fn", margin=2).tolist()
        [4.0, 0.03125]
    """
    fmt = get_format(fmt, arg="fmt")
    m = check_margin(margin)
    if m != int(m):
        raise ValueError(f"margin must be a whole number of binades for an MX scale, got {m}")
    a = _amax_arg(amax)
    ok = torch.isfinite(a) & (a > 0)
    if a.dtype == torch.float64:  # floor(log2 a) = frexp's exponent - 1, exact
        e = torch.frexp(torch.where(ok, a, 1.0))[1].to(torch.int32) - 1
        a = a.float()
    else:
        e = ((torch.where(ok, a, 1.0).view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2 a)
    x = (e - (fmt.max_exponent - int(m))).clamp(E8M0.min_exponent, E8M0.max_exponent)
    # 2^x from its bit pattern (exact; 2^-127 is float32's subnormal 2^22 ulp): an ldexp
    # is a call to pow per value in inductor's code, per MX block of every quantize
    p2 = torch.where(x >= -126, (x.to(torch.int32) + 127) << 23, 1 << 22).view(torch.float32)
    return torch.where(ok, p2, 1.0)


_E4M3 = get_format("e4m3fn")


def nv_scale(
    amax: Tensor, fmt: str | Format, tensor_amax: Tensor | None = None, margin: float = 0.0
) -> Tensor:
    """NVFP4-style two-level scales for block maxima ``amax`` (all blocks of one tensor).

    One float32 tensor scale ``s_t = max(amax) / (fmt.max · 448)`` maps the block scales
    into E4M3's range; each block scale ``s_b = Q_E4M3(amax / (fmt.max · s_t))`` (saturating;
    a zero rounds to E4M3's smallest subnormal); the returned scale is ``s_b · s_t``.
    Non-finite block maxima are left out of ``s_t`` and get scale 1 (module docstring);
    a float64 ``amax`` beyond float32's range raises ``ValueError``.

    ``tensor_amax``: where ``amax`` holds the blocks of several tensors (the experts of a
    grouped GEMM), each block's tensor maximum ``max(amax)`` over the finite block maxima
    of its own tensor, broadcastable to ``amax``; ``s_t`` is then one per tensor.

    ``margin``: binades of headroom on the tensor scale, which becomes
    ``s_t · 2^margin = max(amax) · 2^margin / (fmt.max · 448)`` (one correctly rounded
    division, clamped to ``[2^-126, 2^127]``) while the block scales ``s_b`` stay as
    above: every returned scale is ``2^margin`` times the one of ``margin=0`` (exactly, for
    an integer ``margin`` and scales in float32's normal range), so ``|x / scale|`` is at
    most ``fmt.max · 2^-margin`` up to the E4M3 rounding of ``s_b``. ``|margin| <= 256``
    (else ``ValueError``).
    """
    fmt = get_format(fmt, arg="fmt")
    m = check_margin(margin)
    a = _amax_arg(amax).float()
    ok = torch.isfinite(a)
    fin = torch.where(ok, a, 0.0)
    if tensor_amax is not None:
        t_amax = tensor_amax.float()
    else:
        t_amax = fin.amax() if fin.numel() else fin.new_zeros(())
    pos = t_amax > 0
    div = fmt.max * _E4M3.max
    s_t = torch.where(pos, _div_const(t_amax, div), 1.0)
    s_b = quantize(fin / (fmt.max * s_t), _E4M3, saturate=True)
    if m != 0.0:  # the divisor times 2^-margin, exactly (two ldexp steps, as compute_scale)
        dm = math.ldexp(div, -int(m)) * 2.0 ** -(m - int(m))
        s_t = torch.where(pos, _div_const(t_amax, dm).clamp(_MIN_SCALE, _MAX_SCALE), 1.0)
    s = torch.where(s_b > 0, s_b, _E4M3.min_subnormal) * s_t
    return torch.where(ok, s, 1.0)


def nonfinite_scale(scale: Tensor, amax: Tensor, fmt: str | Format, kind: str) -> Tensor:
    """``scale`` with NaN where ``amax`` is not finite and the block cannot carry the
    non-finite value: ``kind`` ``"mx"``/``"nv"`` (a granularity kind), or a ``fmt``
    without Inf and NaN codes (``special="finite"``). Elsewhere ``scale`` unchanged (see
    the module docstring: the rule of every scaled cast).

    Example:
        >>> import torch
        >>> a = torch.tensor([2.0, float("inf")])
        >>> nonfinite_scale(torch.ones(2), a, "e2m1", "tensor").tolist()
        [1.0, nan]
        >>> nonfinite_scale(torch.ones(2), a, "e5m2", "axis").tolist()
        [1.0, 1.0]
    """
    if kind in ("mx", "nv") or get_format(fmt, arg="fmt").special == "finite":
        return torch.where(torch.isfinite(amax), scale, torch.nan)
    return scale


def group_scale(
    amax: Tensor,
    fmt: str | Format,
    granularity: str | Granularity = "tensor",
    margin: float = 0.0,
    power_of_two: bool = False,
    mx_rounding: str = "floor",
) -> Tensor:
    """The scale of each group of a granularity: for ``mx`` :func:`mx_scale` (OCP's
    ``mx_rounding="floor"``) or the power of two at or above ``amax·2^margin/max``
    (``"ceil"``), :func:`nv_scale` for ``nv``, each with ``margin``, else
    :func:`compute_scale` (``margin``, ``power_of_two``); then :func:`nonfinite_scale`.
    ``ValueError`` for ``power_of_two`` with ``nv`` (its block scales are E4M3 values) and
    an ``mx_rounding`` other than ``"floor"``/``"ceil"``."""
    kind = as_granularity(granularity).kind
    if mx_rounding not in ("floor", "ceil"):
        raise ValueError(f"mx_rounding must be 'floor' or 'ceil', got {mx_rounding!r}")
    if kind == "mx" and mx_rounding == "ceil":
        s = compute_scale(amax, fmt, margin, True)
    elif kind == "mx":
        s = mx_scale(amax, fmt, margin)
    elif kind == "nv":
        if power_of_two:
            raise ValueError("power_of_two: NVFP4 block scales are E4M3 values, not powers of two")
        s = nv_scale(amax, fmt, margin=margin)
    else:
        s = compute_scale(amax, fmt, margin, power_of_two)
    return nonfinite_scale(s, amax, fmt, kind)
