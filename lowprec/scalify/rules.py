"""Scale-propagation rules: arithmetic, activations, matmuls (FP8 operands), reductions.

Each rule states its maths as ``(data, scale)`` of the output from ``x = d_x·s_x`` (see
:mod:`lowprec.scalify.core`). Scalar (per-tensor) scales take the data-space fast path;
broadcastable (per-row, per-block) scales compute ``d_x·s_x`` in float32 and divide by the
chosen output scale, which is still block-broadcast. An output's value never depends on the
chosen scale (up to the final rounding): only its range does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lowprec.core import kernels
from lowprec.core.bits import round_bits
from lowprec.core.formats import get_format
from lowprec.core.granularity import apply_scale
from lowprec.core.scales import amax, compute_scale, group_scale, round_pow2
from lowprec.core.tensor import ScaledTensor, quantize_scaled
from lowprec.scalify.config import current_config
from lowprec.scalify.core import (
    BlockCache,
    Pair,
    check_compatible,
    check_real_float,
    combine,
    compiling,
    deq,
    first_st,
    fscale,
    guard,
    is_st,
    is_zero,
    one,
    out,
    pad,
    pair,
    saturate,
    scalar,
    sqrt_factor,
    upcast,
    work_dtype,
)
from lowprec.scalify.domains import is_grad, rule
from lowprec.scalify.fused import enabled as fused_enabled
from lowprec.scalify.fused import fused_rule

aten = torch.ops.aten
__all__: list[str] = []


# ---- add / sub --------------------------------------------------------------------------


def add_pairs(a: Pair, b: Pair, alpha: float, shape: tuple[int, ...]) -> Pair:
    """``a + α·b``: ``s = max(s_a, s_b)`` (or ``√(s_a²+s_b²)``), ``d = (a + α·b) / s``.

    Scalar scales stay in data space, ``d = d_a·(s_a/s) + α·d_b·(s_b/s)`` (ratios ≤ 1 with
    the max rule), so no intermediate leaves the range whatever the absolute scales.
    """
    (da, sa), (db, sb) = a, b
    fa, fb = fscale(sa), fscale(sb)
    if fa is not None and fb is not None and current_config().add_rule == "max":
        f = max(fa, fb)
        if f == 0.0:
            return torch.zeros(shape, dtype=da.dtype, device=da.device), sa.reshape(())
        da = da if fa == f else da * (fa / f)
        return torch.add(da, db, alpha=alpha * fb / f), sa.new_tensor(f)
    s = combine(sa, sb, shape, "add")
    if scalar(sa) and scalar(sb):
        w = da.dtype
        safe = torch.where(s > 0, s, 1.0)
        return da * (sa / safe).to(w) + db * (alpha * sb / safe).to(w), s
    v = apply_scale(da, sa.to(da.dtype)) + alpha * apply_scale(db, sb.to(db.dtype))
    return apply_scale(v, torch.where(s > 0, s, 1.0).to(v.dtype), "div"), s


def number_pair(x: Any, ref: Tensor, work: torch.dtype) -> Pair:
    """A number ``c`` (Python, or a plain 0-dim tensor) as ``(c/|c|, |c|)``: its own
    scale, so ``x + ε`` with a tiny ``s_x`` gets ``s = max(s_x, ε)``, not 1 (which would
    flush ``x`` in FP16). Zero has the scale 0 (it never wins a max); ±inf/NaN scale 1.

    A plain tensor ``p`` (an additive mask, a ``zeros_like`` accumulator) has the scale
    ``min(1, 2^⌈log2 max|p|⌉)`` over its finite entries: an all-zero tensor 0, small
    values their own (so ``zeros_like(x) + x`` at ``s_x = 2^-20`` keeps ``x``'s bits,
    where scale 1 left FP16 subnormals), masks and large values 1 as before. An all-zero
    tensor with ±inf/NaN entries (a ``0/-inf`` mask) has the smallest normal float32
    scale: it never wins a max, and its entries stay ±inf/NaN."""
    if isinstance(x, Tensor) and not isinstance(x, ScaledTensor) and x.dim() > 0:
        return _plain_pair(x, work)
    if isinstance(x, ScaledTensor):
        return pair(x, work)
    t = x.to(work) if isinstance(x, Tensor) else torch.tensor(float(x), dtype=work,
                                                              device=ref.device)  # fmt: skip
    mag = t.abs()
    fin = torch.isfinite(mag)
    d = torch.where(fin & (mag > 0), t / torch.where(mag > 0, mag, 1.0), t)
    return d, torch.where(fin, mag, 1.0).float()


def _plain_pair(x: Tensor, work: torch.dtype) -> Pair:
    """:func:`number_pair` of a plain tensor of one or more dims."""
    d = x.to(work)
    fin = torch.isfinite(d)
    amax = torch.where(fin, d.abs(), 0.0).amax().float() if d.numel() else d.new_zeros(())
    own = torch.clamp(round_pow2(torch.where(amax > 0, amax, 1.0), "up"), max=1.0)
    empty = torch.where(fin.all(), 0.0, torch.finfo(torch.float32).tiny)
    s = torch.where(amax > 0, own, empty).float()
    return apply_scale(d, torch.where(s > 0, s, 1.0).to(work), "div"), s


def _fused_add(a: Any, b: Any, alpha: float, work: torch.dtype) -> Pair | None:
    """:func:`add_pairs`' max rule for two ScaledTensors of one shape with per-tensor
    scales, ``d = d_a·(s_a/s) + d_b·(α·s_b/s)``, ``s = max(s_a, s_b)``, from one fused
    kernel (:func:`~lowprec.scalify.fused.fused_rule`) that also rounds to the storage
    format; ``None`` where it does not apply (checked first where the kernels are off:
    the ratios read both scales on the host)."""
    if not fused_enabled() or not (is_st(a) and is_st(b)) or tuple(a.shape) != tuple(b.shape):
        return None
    if current_config().add_rule != "max":
        return None
    fa, fb = fscale(a.scale), fscale(b.scale)
    if fa is None or fb is None or max(fa, fb) == 0.0:
        return None
    f = max(fa, fb)
    ra, rb = fa / f, alpha * fb / f

    def factor(r: float) -> Tensor | None:
        return None if r == 1.0 else torch.tensor(r, dtype=torch.float32, device=a.device)

    ops = [(a.qdata, factor(ra)), (b.qdata, factor(rb))]
    d = fused_rule(aten.add.Tensor, ops, work)
    return None if d is None else (d, a.scale.new_tensor(f).reshape(()))


@rule(aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar)
def _add(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``a ± α·b``: :func:`add_pairs`; a zero-scale operand short-circuits to the other.
    With a plain operand (an additive mask), finite data saturate
    (:func:`~lowprec.scalify.core.saturate`)."""
    a, b = args[0], args[1]
    alpha = float(kwargs.get("alpha", args[2] if len(args) > 2 else 1))
    if func in (aten.sub.Tensor, aten.sub.Scalar):
        alpha = -alpha
    check_compatible(a, b)
    if is_zero(b) and isinstance(a, ScaledTensor) and tuple(a.shape) == tuple(b.shape):
        return a
    if is_zero(a) and alpha == 1.0 and is_st(b) and tuple(a.shape) == tuple(b.shape):
        return b
    if not isinstance(b, Tensor) and float(b) * alpha == 0.0 and isinstance(a, ScaledTensor):
        return a
    work = work_dtype(a, b)
    fused = _fused_add(a, b, alpha, work)
    if fused is not None:
        return out(func, args, *fused)
    ref = first_st((a, b))
    pa, pb = number_pair(a, ref, work), number_pair(b, ref, work)
    shape = tuple(torch.broadcast_shapes(pa[0].shape, pb[0].shape))  # type: ignore[no-untyped-call]
    d, s = add_pairs(pa, pb, alpha, shape)
    if not (is_st(a) and is_st(b)):  # a plain operand (a mask): its range is not tracked
        d = saturate(d)
    return out(func, args, d, s)


# ---- mul / div --------------------------------------------------------------------------


def _times_number(func: Any, args: Any, x: ScaledTensor, c: float) -> ScaledTensor:
    """``x·c`` for a number ``c``: ``s = s_x·p``, ``d = d_x·(c/p)`` with ``p = |c|`` rounded
    per ``pow2`` (``none``: the data only changes sign, exactly). ``c = 0``: the zero scale."""
    work = work_dtype(x)
    d = x.qdata
    if c == 0.0:
        return out(func, args, torch.zeros_like(d, dtype=work), torch.zeros((), device=d.device))
    if not math.isfinite(c):
        return out(func, args, deq(x, work) * c, one(d))
    cfg = current_config()
    p = round_pow2(abs(c), cfg.pow2)
    if c / p == 1.0 and cfg.rescale == "none" and x.numel() > 1:
        # The data are unchanged: wrap the stored data (an exact round trip through
        # ``work`` would give the same values, at two full-size copies).
        return out(func, args, x.qdata, x.scale * p)
    d = d.to(work)
    return out(func, args, d * (c / p) if c / p != 1.0 else d, x.scale * p)


@rule(aten.mul.Tensor, aten.mul.Scalar)
def _mul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``a·b``: ``d = d_a·d_b``, ``s = s_a·s_b`` (a plain operand has ``s = 1``; then
    :func:`~lowprec.scalify.core.guard`); a number goes to the scale (:func:`_times_number`)."""
    a, b = args[0], args[1]
    if not isinstance(a, Tensor):
        a, b = b, a
    if not isinstance(b, Tensor):
        return _times_number(func, args, a, float(b))
    check_compatible(a, b)
    if is_zero(a) or is_zero(b):
        z: Any = a if is_zero(a) else b
        shape = torch.broadcast_shapes(a.shape, b.shape)  # type: ignore[no-untyped-call]
        return out(func, args, torch.zeros(shape, device=z.device), z.scale)
    work = work_dtype(a, b)
    (da, sa), (db, sb) = pair(a, work), pair(b, work)
    d = da * db
    try:
        s = pad(sa, d.dim()) * pad(sb, d.dim())
        return out(func, args, *guard(d, s))
    except (RuntimeError, ValueError):  # block layouts that do not combine: elementwise
        s = torch.ones(d.shape, device=d.device)
        return out(func, args, *guard(d, apply_scale(apply_scale(s, sa), sb)))


@rule(aten.div.Tensor, aten.div.Scalar)
def _div(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``a / b``: ``d = d_a / d_b``, ``s = s_a / s_b`` (:func:`~lowprec.scalify.core.guard`:
    a small ``d_b`` makes ``d`` large); by a number: ``x·(1/c)``."""
    a, b = args[0], args[1]
    if not isinstance(b, Tensor):
        return _times_number(func, args, a, 1.0 / float(b))
    check_compatible(a, b)
    work = work_dtype(a, b)
    if not isinstance(a, Tensor):
        a = torch.tensor(float(a), device=b.device)
    (da, sa), (db, sb) = pair(a, work), pair(b, work)
    d = da / db
    try:
        return out(func, args, *guard(d, pad(sa, d.dim()) / pad(sb, d.dim())))
    except (RuntimeError, ValueError):
        return out(func, args, deq(a, work) / deq(b, work), one(d))


# ---- unary ---------------------------------------------------------------------------------


@rule(aten.neg.default, aten.abs.default, aten.relu.default)
def _equivariant(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``f(x)`` with ``f(s·d) = s·f(d)`` for ``s > 0`` (neg, abs, relu): ``d = f(d_x)``, ``s_x``."""
    x = args[0]
    return out(func, args, func(x.qdata.to(work_dtype(x))), x.scale)


@rule(aten.gelu.default, aten.silu.default, aten.maximum.default, aten.minimum.default)
def _like_input(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """gelu, silu (``|f(x)| ≲ |x|``), maximum, minimum: ``v = f(d_x·s_x)`` in float32,
    ``s = s_x`` (two operands: ``max(s_a, s_b)``, a plain one at its own scale as in
    :func:`number_pair`: ``maximum(x, 0.5)`` at ``s_x = 2^-30`` read inf at ``s_x``),
    ``d = v / s``."""
    check_compatible(*args)
    work = work_dtype(*args)
    if len(args) == 1 and isinstance(args[0], ScaledTensor) and scalar(args[0].scale):
        sx = args[0].scale
        fused = fused_rule(func, args, work, kwargs=kwargs, divide_by=sx)
        if fused is not None:
            return out(func, args, fused, sx)
    v = func(*(deq(a, work) for a in args), **kwargs)
    ref = next(a for a in args if isinstance(a, ScaledTensor))
    scales = [a.scale if isinstance(a, ScaledTensor) else number_pair(a, ref, work)[1]
              for a in args]  # fmt: skip
    s = scales[0] if len(scales) == 1 else combine(scales[0], scales[1], tuple(v.shape))
    return out(func, args, apply_scale(v, torch.where(s > 0, s, 1.0).to(work), "div"), s)


@rule(aten.gelu_backward.default, aten.silu_backward.default, aten.threshold_backward.default)
def _act_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``g·f'(x)`` (linear in the gradient): ``d = d_g·f'(d_x·s_x)``, ``s = s_g``."""
    g, x = args[0], args[1]
    work = work_dtype(g, x)
    if isinstance(g, ScaledTensor) and scalar(g.scale):
        fused = fused_rule(func, [(g.qdata, None), x], work, tuple(args[2:]), kwargs)
        if fused is not None:
            return out(func, args, fused, g.scale)
    dg, sg = pair(g, work)
    xv = deq(x, work)
    if isinstance(g, ScaledTensor) and not scalar(sg):
        m = sg.amax()
        return out(func, args, func(deq(g, work), xv, *args[2:], **kwargs) / m.to(work), m)
    return out(func, args, func(dg, xv, *args[2:], **kwargs), sg)


@rule(aten.exp.default, aten.log.default, aten.tanh.default, aten.sigmoid.default)
def _unscale(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r"""exp, tanh, sigmoid: ``v = f(d_x·s_x)``, ``s = 1`` (the scale leaves), then
    :func:`~lowprec.scalify.core.guard`\ ed: e^x spans far more than FP16 at scale 1, and
    ``tanh(x) ≈ x``, ``sigmoid(x) ≈ e^x`` of tiny or very negative ``x`` would be FP16
    subnormals at scale 1.
    log: ``d = log d_x + log s_x``, ``s = 1`` (exact for any scale)."""
    x = args[0]
    work = work_dtype(x)
    if func is aten.log.default:
        d, s = pair(x, work)
        return out(func, args, torch.log(d) + torch.log(s.to(work)), one(d))
    return out(func, args, *guard(func(deq(x, work)), one(x)))


@rule(aten.pow.Tensor_Scalar, aten.sqrt.default, aten.rsqrt.default)
def _power(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x^p`` (sqrt: p = ½, rsqrt: p = -½): ``d = d_x^p``, ``s = s_x^p``
    (:func:`~lowprec.scalify.core.guard`: ``d_x^p`` leaves [-1, 1] for ``p ≠ 1``)."""
    x = args[0]
    p = {aten.sqrt.default: 0.5, aten.rsqrt.default: -0.5}.get(func)
    p = float(args[1]) if p is None else p
    d = x.qdata.to(work_dtype(x))
    return out(func, args, *guard(d.pow(p) if p != 2.0 else d * d, x.scale.pow(p)))


# ---- matmul ------------------------------------------------------------------------------


def _fp8(d: Tensor, s: Tensor, grad: bool) -> Pair:
    """Round data to E5M2 (gradients) or E4M3 (the rest) at the power-of-two scale
    ``r = 2^⌈log2(amax(d)/fmt.max)⌉`` of :func:`~lowprec.core.tensor.quantize_scaled`:
    ``d ← r·q(d / r)`` (exact in float32), ``s`` kept: the matmul then multiplies FP8
    values, as a scaled FP8 GEMM does."""
    if d.numel() == 0:
        return d, s
    fmt = "e5m2" if grad else "e4m3fn"
    if d.dtype == torch.float32 and d.device.type == "cpu":
        if compiling():  # the values on the bit pattern: inductor's float8 casts are scalar
            dd = d.detach()
            f = get_format(fmt)
            r = group_scale(amax(dd), f, "tensor", 0.0, True)
            return round_bits(dd / r, f, "nearest", True) * r, s
        fast = _fp8_cached(d.detach(), fmt)
        if fast is not None:
            return fast, s
    q = quantize_scaled(d.detach(), fmt, power_of_two=True)
    return q.dequantize(), s


_FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


_FP8_ROUNDINGS = BlockCache(4)


def _fp8_cached(d: Tensor, fmt: str) -> Tensor | None:
    """:func:`_fp8_eager`, reusing a recent result for the same stored data (a backward
    reads one gradient as ``g`` and ``gᵀ``; :class:`~lowprec.scalify.core.BlockCache`):
    only for a view covering its storage block once, whose per-tensor scale is then the
    block's, and the rounding elementwise."""
    return _FP8_ROUNDINGS.get(d, (fmt,), lambda t: _fp8_eager(t, fmt))


def _fp8_eager(d: Tensor, fmt: str) -> Tensor | None:
    """:func:`_fp8`'s ``quantize_scaled(d, fmt, power_of_two=True).dequantize()`` for
    float32 CPU data, eager. A large ``d`` takes one compiled kernel
    (:func:`~lowprec.core.kernels.run_group_round_trip` with one group): the amax, the
    scale ``r`` and the rounding of the traced path (tested equal to the quantize-dequantize
    for every input, zeros, Inf and NaN included), with no read back to the host.
    Otherwise, for a finite, nonzero ``amax`` (else ``None``): the same scale
    (:func:`~lowprec.core.scales.compute_scale` of the same ``amax``) and the same divide,
    cast and multiply, without the autograd and wrapper layers or the second range-check
    read. ``r ≥ amax / fmt.max`` (rounded up to a power of two), so ``|d / r| ≤ fmt.max``:
    the cast needs no saturation (checked, else ``None``)."""
    f = get_format(fmt)
    if kernels.takes(d, f, kernels.ROUND_TRIP_MIN_NUMEL):  # the same bits, one call
        fused = kernels.run_group_round_trip(
            d, (), f, lambda a: group_scale(a, f, "tensor", 0.0, True), "pow2", torch.float32
        )
        if fused is not None:
            return fused[0]
    lo, hi = torch.aminmax(d)
    a = torch.maximum(hi, -lo)
    fa = float(a)
    if not (math.isfinite(fa) and fa > 0.0):
        return None
    r = float(compute_scale(a, fmt, power_of_two=True))
    if fa / r > f.max:
        return None
    return (d / r).to(_FP8[fmt]).to(torch.float32) * r


def fp8_round(d: Tensor, grad: bool) -> Tensor:
    """The data ``d`` as a scaled FP8 GEMM sees them (:func:`_fp8`): E5M2 for gradients,
    E4M3 otherwise."""
    return _fp8(d, torch.ones(()), grad)[0]


def matmul_pair(a: Any, b: Any, op: Any) -> Pair:
    """``a @ b`` (mm/bmm) with K the contracted size: ``d = (d_a @ d_b) / c(K)``,
    ``s = s_a·s_b·c(K)`` when both scales are constant along K (per-tensor, per-row of
    ``a``, per-column of ``b``); otherwise ``v = (d_a·s_a) @ (d_b·s_b)`` and
    ``s = max s_a · max s_b · c(K)``; then :func:`~lowprec.scalify.core.guard`. FP8 data
    format: operands cast by :func:`_fp8` first."""
    check_compatible(a, b)
    check_real_float(op, a, b)
    work = work_dtype(a, b)
    (da, sa), (db, sb) = pair(a, work), pair(b, work)
    if current_config().fp8_matmul:
        da, sa = _fp8(da, sa, is_grad(a))
        db, sb = _fp8(db, sb, is_grad(b))
    c = sqrt_factor(da.shape[-1])
    pa, pb = pad(sa, da.dim()), pad(sb, db.dim())
    if pa.shape[-1] == 1 and pb.shape[-2] == 1:
        try:
            s = pa * pb * c
            return guard(_mm_scaled(op, da, db, 1.0 / c), s)
        except RuntimeError:
            pass
    s = sa.amax() * sb.amax() * c
    v = op(apply_scale(da, sa.to(work)), apply_scale(db, sb.to(work)))
    return guard(v / s.to(work), s)


def _mm_scaled(op: Any, a: Tensor, b: Tensor, alpha: float) -> Tensor:
    """``alpha·(a @ b)`` with ``alpha`` applied inside the GEMM (no extra pass)."""
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    if op is aten.mm.default:
        return torch.addmm(zero, a, b, beta=0, alpha=alpha)
    return torch.baddbmm(zero, a, b, beta=0, alpha=alpha)


@rule(aten.mm.default, aten.bmm.default)
def _mm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """mm, bmm: :func:`matmul_pair`."""
    d, s = matmul_pair(args[0], args[1], func)
    return out(func, args, d, s)


@rule(aten.addmm.default, aten.baddbmm.default)
def _addmm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``β·bias + α·(a @ b)``: :func:`matmul_pair`, then :func:`add_pairs` (one rounding)."""
    bias, a, b = args[:3]
    beta, alpha = float(kwargs.get("beta", 1)), float(kwargs.get("alpha", 1))
    op = aten.mm.default if func is aten.addmm.default else aten.bmm.default
    fast = _addmm_fast(func, args, bias, a, b, beta, alpha)
    if fast is not None:
        return fast
    dm, sm = matmul_pair(a, b, op)
    work = dm.dtype
    db, sb = pair(bias, work)
    d, s = add_pairs((dm, sm * alpha), (db, sb * beta), 1.0, tuple(dm.shape))
    return out(func, args, d, s)


def _addmm_fast(
    func: Any, args: Any, bias: Any, a: Any, b: Any, beta: float, alpha: float
) -> ScaledTensor | None:
    """Per-tensor scales, eager, max add rule: one GEMM (after the FP8 casts, if any),
    ``d = (β·s_bias/s)·d_bias + (α·s_a·s_b/s)·(d_a @ d_b)``,
    ``s = max(α·s_a·s_b·c(K), β·s_bias)``, then :func:`~lowprec.scalify.core.guard`."""
    cfg = current_config()
    if cfg.add_rule != "max" or not all(is_st(t) for t in (bias, a, b)):
        return None
    fs = [fscale(t.scale) for t in (bias, a, b)]
    if any(f is None for f in fs):
        return None
    check_compatible(bias, a, b)
    fbias, fa, fb = (float(f) for f in fs)  # type: ignore[arg-type]
    work = work_dtype(a, b)
    c = sqrt_factor(a.shape[-1])
    fm = alpha * fa * fb * c
    s = max(fm, beta * fbias)
    if s == 0.0 or not math.isfinite(s):
        return None
    da, db = upcast(a.qdata, work), upcast(b.qdata, work)
    if cfg.fp8_matmul:
        da, db = _fp8(da, a.scale, is_grad(a))[0], _fp8(db, b.scale, is_grad(b))[0]
    d = func(bias.qdata.to(work), da, db, beta=beta * fbias / s, alpha=fm / (c * s))
    return out(func, args, *guard(d, bias.scale.new_tensor(s)))


# ---- reductions --------------------------------------------------------------------------


def _reduced(x: ScaledTensor, dims: Any) -> int:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return x.numel()
    dims = [dims] if isinstance(dims, int) else dims
    return math.prod(x.shape[d] for d in dims)


@rule(aten.sum.dim_IntList, aten.sum.default)
def _sum(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Σ x`` over n elements: ``d = Σ d_x / c(n)``, ``s = s_x·c(n)`` (scalar scale); else
    ``v = Σ d_x·s_x``, ``s = max s_x · c(n)``."""
    x = args[0]
    kw = {k: v for k, v in kwargs.items() if k != "dtype"}
    dims = args[1] if len(args) > 1 else kw.get("dim")
    c = sqrt_factor(_reduced(x, dims if func is aten.sum.dim_IntList else None))
    work = work_dtype(x)
    rest = args[1:3] if func is aten.sum.dim_IntList else ()
    if scalar(x.scale):
        return out(func, args, func(x.qdata.to(work), *rest, **kw) / c, x.scale * c)
    s = x.scale.amax() * c
    return out(func, args, func(deq(x, work), *rest, **kw) / s.to(work), s)


@rule(aten.mean.dim, aten.mean.default, aten.amax.default, aten.amin.default)
def _mean(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """mean, amax, amin (``f(s·d) = s·f(d)``): ``d = f(d_x)``, ``s = s_x`` (scalar scale);
    else ``v = f(d_x·s_x)``, ``s = max s_x``."""
    x = args[0]
    kw = {k: v for k, v in kwargs.items() if k != "dtype"}
    work = work_dtype(x)
    if scalar(x.scale):
        return out(func, args, func(x.qdata.to(work), *args[1:], **kw), x.scale)
    s = x.scale.amax()
    return out(func, args, func(deq(x, work), *args[1:], **kw) / s.to(work), s)
