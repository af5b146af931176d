"""Shared machinery of the scale-propagation rules: operands, scale choice, output wrapping.

Notation in the rule docstrings: an operand is ``x = d_x · s_x`` (data ``d_x``, scale
``s_x``, block-broadcast); a plain tensor operand has ``s = 1``; ``c(n)`` is ``√n`` rounded
to a power of two as the active ``pow2`` mode says. Rules compute in float32 (float64 for
float64 tensors) from the stored data and round the output data to the storage format once.
Which rules apply, and under which config, is :mod:`lowprec.scalify.domains`'s business.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lowprec.core.granularity import apply_scale, check_scale_shape
from lowprec.core.layout import dense_view
from lowprec.core.scales import ScaleOverflowError, round_pow2
from lowprec.core.tensor import ScaledTensor
from lowprec.core.upcast import upcast as widen
from lowprec.scalify.config import current_config
from lowprec.scalify.domains import out_domain, sts

__all__ = ["Pair", "assign", "combine", "guard", "out", "pair", "share", "wrap"]

Pair = tuple[Tensor, Tensor]  # (data in working precision, scale)


def compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def is_st(x: object) -> bool:
    return isinstance(x, ScaledTensor)


def first_st(args: Any) -> ScaledTensor:
    for a in sts(args):
        return a
    raise TypeError("scalify rule called without a ScaledTensor argument")


def work_dtype(*xs: Any) -> torch.dtype:
    return (
        torch.float64
        if any(getattr(x, "dtype", None) == torch.float64 for x in xs)
        else (torch.float32)
    )


def check_compatible(*xs: Any) -> None:
    """``ValueError`` if tensor operands mix devices or ScaledTensors mix logical dtypes."""
    dev = None
    dtype = None
    for x in xs:
        if not isinstance(x, Tensor):
            continue
        if dev is None:
            dev = x.device
        elif x.device != dev and x.dim() > 0:
            raise ValueError(
                f"scalify: operands on different devices ({dev} and {x.device}); move them to "
                "one device"
            )
        if isinstance(x, ScaledTensor):
            if dtype is None:
                dtype = x.dtype
            elif x.dtype != dtype:
                raise ValueError(
                    f"scalify: ScaledTensors of logical dtypes {dtype} and {x.dtype} in one op; "
                    "cast one with .to(dtype) first"
                )


def one(ref: Tensor) -> Tensor:
    return torch.ones((), device=ref.device)


class BlockCache(threading.local):
    """A few recent results of an elementwise map of stored data, keyed by the block of
    storage the data occupy (per thread: no thread sees another's entries mid-update).

    A rule reads one tensor several times, often through different views (``g`` and
    ``gᵀ``, ``x`` and its ``(B·T, C)`` reshape): views made inside a rule carry no
    ``_base`` and no shared version counter, so the key is the storage block itself:
    the storage's address, the block's offset and length, the dtype and the view's
    version counter (an in-place change through that view misses). Stored data are never
    changed in place by scalify (in-place ops replace a ScaledTensor's data); the entry
    keeps the tensor, so its storage, alive (no address reuse). Tensors under ``min_numel``
    elements get ``fn`` directly: for them a lookup costs about what it saves."""

    def __init__(self, size: int, min_numel: int = 1 << 16) -> None:
        self.size, self.min_numel = size, min_numel
        self.entries: list[tuple[tuple[Any, ...], Tensor, Tensor]] = []  # (key, data, result)

    def get(
        self, d: Tensor, tag: tuple[Any, ...], fn: Callable[[Tensor], Tensor | None]
    ) -> Tensor | None:
        """``fn`` (an elementwise map, or one whose per-tensor statistics are the same for
        every view of the block) of ``d``, laid out like ``d``: computed on the block
        flattened in storage order, or a recent result for the same block reused. A ``d``
        that does not cover a contiguous block exactly once, or a small one, gets ``fn(d)``
        directly."""
        if d.numel() < self.min_numel:
            return fn(d)
        flat = dense_view(d)
        if not flat.is_contiguous():
            return fn(d)
        key = (d.untyped_storage().data_ptr(), d.storage_offset(), d.numel(), d.dtype,
               d._version, *tag)  # fmt: skip
        hit = [r for k, _, r in self.entries if k == key]
        if hit:
            r: Tensor | None = hit[0]
        else:
            r = fn(flat.reshape(-1))
            if r is None:
                return None
            r = r.contiguous()  # (the block's layout, for the strided views below)
            self.entries.insert(0, (key, d, r))
            del self.entries[self.size :]
        assert r is not None
        return r.as_strided(d.shape, d.stride(), r.storage_offset())


_UPCASTS = BlockCache(4)


def upcast(d: Tensor, work: torch.dtype) -> Tensor:
    """``d.to(work)``, reusing a recent upcast of the same stored data (eager, large
    tensors only; :class:`BlockCache`): backward ops read one gradient or activation
    several times, often through different views, and each is upcast once. A float8
    payload is widened by :func:`lowprec.core.upcast.upcast` (torch's own E4M3 cast is a
    scalar loop), the same bits."""
    if d.dtype == work or compiling():
        return d.to(work)
    up = _UPCASTS.get(d, (work,), lambda t: widen(t, work))
    assert up is not None
    return up


def pair(x: Any, work: torch.dtype) -> Pair:
    """``(d_x, s_x)`` in working precision; a plain tensor is its own data at scale 1.
    ``TypeError`` for a complex plain tensor (scaled arithmetic is real)."""
    if isinstance(x, ScaledTensor):
        return upcast(x.qdata, work), x.scale
    if x.is_complex():
        raise TypeError(f"scalify: complex operands are not supported, got dtype {x.dtype}")
    return x.to(work), one(x)


def scalar_pair(x: Any, work: torch.dtype) -> Pair:
    """:func:`pair` with a per-tensor scale: a block scale is folded to its max,
    ``d = d_x·s_x / max s_x``, ``s = max s_x`` (for rules whose maths mixes blocks)."""
    d, s = pair(x, work)
    if s.numel() == 1:
        return d, s.reshape(())
    m = s.amax()
    return apply_scale(d, (s / torch.where(m > 0, m, 1.0)).to(work)), m


def check_real_float(op: Any, *xs: Any) -> None:
    """``TypeError`` naming ``op`` if a plain tensor operand is not floating point (torch
    refuses mixed-dtype matmuls too: scaled arithmetic must not accept them silently)."""
    for i, x in enumerate(xs):
        if isinstance(x, Tensor) and not isinstance(x, ScaledTensor):
            if not x.is_floating_point():
                raise TypeError(
                    f"scalify: operand {i} of {op} has dtype {x.dtype}; a matmul needs "
                    "floating-point operands (cast it first)"
                )


def deq(x: Any, work: torch.dtype) -> Tensor:
    """``d_x · s_x`` as a plain tensor (a unit scale short-circuits the multiply)."""
    if not isinstance(x, ScaledTensor):
        return x.to(work) if isinstance(x, Tensor) and x.is_floating_point() else x
    d, s = upcast(x.qdata, work), x.scale
    f = fscale(s)
    if f is not None:
        return d if f == 1.0 else d * f
    return apply_scale(d, s.to(work))


def is_zero(x: Any) -> bool:
    """A ScaledTensor with the special scale 0 (all zeros): eager only."""
    return (
        isinstance(x, ScaledTensor)
        and x.scale.numel() == 1
        and not compiling()
        and float(x.scale) == 0.0
    )


def fscale(s: Tensor) -> float | None:
    """A per-tensor scale as a Python float in eager mode (fast paths), else ``None``."""
    return float(s) if s.numel() == 1 and not compiling() else None


def scalar(s: Tensor) -> bool:
    return s.numel() == 1


def pad(s: Tensor, ndim: int) -> Tensor:
    """``s`` with leading 1-dims up to ``ndim`` dims."""
    return s.reshape((1,) * (ndim - s.dim()) + tuple(s.shape)) if s.dim() < ndim else s


def full_scale(d: Tensor, s: Tensor) -> Tensor:
    """The elementwise scale of data ``d`` (block-broadcast ``s`` materialised)."""
    return apply_scale(torch.ones(d.shape, device=d.device), s)


def sqrt_factor(n: int) -> float:
    """``c(n) = √n`` (power-of-two rounded per the config): the growth of a sum of n terms."""
    return round_pow2(math.sqrt(max(n, 1)), current_config().pow2)


def combine(s_a: Tensor, s_b: Tensor, shape: tuple[int, ...], how: str = "") -> Tensor:
    """Output scale of a two-operand elementwise op: ``max(s_a, s_b)``, or ``√(s_a²+s_b²)``
    with the ``unit`` add rule (``how="add"``); elementwise scales if blocks disagree."""
    cfg = current_config()
    nd = len(shape)
    try:
        a, b = pad(s_a, nd), pad(s_b, nd)
        if how == "add" and cfg.add_rule == "unit":
            s = round_pow2(torch.sqrt(a * a + b * b), cfg.pow2)
        else:
            s = torch.maximum(a, b)
        check_scale_shape(tuple(s.shape), shape)
        return s
    except (RuntimeError, ValueError):
        ones = torch.ones(shape, device=s_a.device)
        return combine(apply_scale(ones, s_a), apply_scale(ones, s_b), shape, how)


def stat(d: Tensor, how: str) -> Tensor:
    """max |d|, mean |d| (``l1``) or RMS (``l2``) of ``d``; 0 for an empty ``d``."""
    if not d.numel():
        return torch.zeros((), dtype=d.dtype, device=d.device)
    if how == "max":
        if not compiling():  # one read, no |d| temporary (NaN propagates as with amax)
            lo, hi = torch.aminmax(d.detach())
            return torch.maximum(hi, -lo)
        return d.detach().abs().amax()
    a = d.detach().abs()
    if how == "l1":
        return a.mean()
    return a.square().mean().sqrt()


def saturate(d: Tensor) -> Tensor:
    """``d`` with finite entries beyond the storage format's largest value clamped to it
    (±inf and NaN kept). For rules that take plain tensors or fill values, whose range
    no scale tracks: an additive attention mask of -3.4e38 (HF's float32 minimum) at the
    scores' scale overflows FP16 to -inf, and a fully masked row's softmax becomes NaN,
    where float32 gives a finite (uniform) row. Saturated, the value is still below every
    unmasked score by far more than ``exp`` can resolve, so softmax is FP32's."""
    store = current_config().storage_dtype
    if d.dtype == store or not d.is_floating_point():
        return d
    m = torch.finfo(store).max
    if not compiling() and d.numel():
        # Eager fast path: data already within ±m (so finite) are returned as they are,
        # which is what the masked clamp below gives them; one read, no temporaries.
        lo, hi = torch.aminmax(d)
        if float(torch.maximum(hi, -lo)) <= m:
            return d
    return torch.where(torch.isfinite(d), d.clamp(-m, m), d)


GUARD = 4  # a guarded rule keeps the max |data| of its output within [2^-GUARD, 2^GUARD]


def guard(d: Tensor, s: Tensor) -> Pair:
    """``(d, s)``, or ``(d/m, s·m)`` with ``m = 2^⌊log2 M⌋`` when the largest finite
    ``M = max |d|`` lies outside ``[2^-GUARD, 2^GUARD]`` (``M = 0``: unchanged). The value
    ``d·s`` is the same (``m`` is a power of two: exact). Compiled: sync-free (no host
    branch). Eager float32 data: ``M`` is read on the host (one sync, as the eager scale
    fast paths already do) and an in-range ``d`` is returned as it is.

    The static rules choose an output's scale from the inputs' scales, which keeps data
    near 1 for linear maps of data near 1. Rules whose data are a *nonlinear* function of
    their inputs' data, so not bounded by them, pass through this guard before the cast to
    the storage format: products ``d_a·d_b`` and matmuls (data below 1 shrink
    multiplicatively, towards FP16's subnormals), quotients and powers ``d^p`` (an
    rsqrt's data is ~2^7 when its input's is ~2^-14, and the cube in its backward, ~2^21,
    overflows FP16 at the scale ``s^p``)."""
    if not d.numel():
        return d, s
    if d.dtype == torch.float32 and not compiling():
        f = _finite_amax(d)
        if f is not None:  # the same (d, s) as below, with host arithmetic on one read
            if f == 0.0 or 2.0**-GUARD <= f <= 2.0**GUARD:
                return d, s
            mf = round_pow2(f, "down")
            return d / mf, s * mf
    a = d.detach().abs()
    a = torch.where(torch.isfinite(a), a, 0.0).amax().float()
    off = (a > 2.0**GUARD) | ((a > 0) & (a < 2.0**-GUARD))
    m = torch.where(off, round_pow2(torch.where(a > 0, a, 1.0), "down"), 1.0)
    return d / m.to(d.dtype), s * m


def _finite_amax(d: Tensor) -> float | None:
    """Eager: ``max |d|`` as a Python float if every entry of ``d`` is finite, else
    ``None`` (one ``aminmax`` read: no ``|d|`` or ``isfinite`` temporaries)."""
    lo, hi = torch.aminmax(d.detach())
    f = float(torch.maximum(hi, -lo))
    return f if math.isfinite(f) else None


def wrap(
    d: Tensor, s: Tensor, like: ScaledTensor, domain: str, op: Any, dtype: Any = None
) -> ScaledTensor:
    """Round data ``d`` (working precision) to the storage format at scale ``s``.

    With ``rescale`` set, first ``s ← s·r``, ``d ← d / r`` with ``r`` the data's max / mean
    |.| / RMS (power-of-two rounded; 1 if zero or non-finite). A non-finite or negative
    scale raises ``ValueError`` naming ``op`` (checked eagerly when ``check_scales``).
    """
    cfg = current_config()
    if cfg.rescale != "none" and d.numel() > 1:
        r = stat(d, cfg.rescale).float()
        r = torch.where(torch.isfinite(r) & (r > 0), round_pow2(r, cfg.pow2), 1.0)
        d, s = d / r.to(d.dtype), s * r
    if s.numel() == 1 and s.dim():
        s = s.reshape(())
    s = s.float()
    if cfg.check_scales and not compiling():
        if s.numel() == 1:
            f = float(s)
            ok = math.isfinite(f) and f >= 0
        else:
            ok = bool((torch.isfinite(s) & (s >= 0)).all())
        if not ok:
            bad = ~(torch.isfinite(s) & (s >= 0))
            raise ScaleOverflowError(
                f"scalify: {op} created a non-finite or negative scale "
                f"({s[bad].flatten()[:4].tolist()}); its inputs' scales were too large or "
                "too small for float32 (rebalance them first)"
            )
    # One-element results (losses, norms) keep their working precision: free, and exact.
    store = cfg.storage_dtype if d.numel() > 1 else d.dtype
    return ScaledTensor._wrap(d.to(store), s, dtype or like.dtype, _FMT[store], domain)


_FMT: dict[torch.dtype, str | None] = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: None,
}


def out(func: Any, args: Any, d: Tensor, s: Tensor) -> ScaledTensor:
    """Wrap ``(d, s)`` as the result of ``func`` on ``args`` (dtype and domain from them)."""
    return wrap(d, s, first_st(args), out_domain(args), func)


def share(base: ScaledTensor, view: ScaledTensor, op: Any) -> ScaledTensor:
    """Mark ``view`` (the result of the shape op ``op`` on ``base``) and ``base`` as sharing
    storage when ``op`` returns an alias of its input (a slice, a transpose, a view; its
    schema says so) and, eagerly, ``view``'s data are stored in ``base``'s (a ``reshape``
    that copied is not): an in-place op on either then writes into that storage
    (:func:`assign`). Returns ``view``."""
    if op._schema.returns[0].alias_info is None:
        return view
    a, b = view._data, base._data
    if compiling() or (
        a.numel() and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ):
        view._shared = base._shared = True  # type: ignore[attr-defined]
    return view


def assign(x: ScaledTensor, d: Tensor, s: Tensor, op: Any) -> ScaledTensor:
    """Put the values ``d·s`` (data in ``x``'s storage dtype, scale ``s``) into ``x`` in
    place: the result of the in-place op ``op`` on ``x``; returns ``x``.

    ``x`` alone with its data: ``x`` takes ``d`` and ``s`` (its scale follows the new
    values). ``x`` sharing its storage with other ScaledTensors (:func:`share`: ``z[1:3]``
    of ``z[1:3] = y``, ``z.t()``, a base that has such views): they read that storage
    through their own scales, so the values are written into it at ``x``'s scale,
    ``d_x ← d·s/s_x`` elementwise. Where a finite value would overflow the storage dtype
    at that scale and the scale is per-tensor (one number, which the sharing tensors
    share), the whole storage is first rescaled in place to the larger scale ``s`` (as an
    out-of-place op on the base would rescale it). ``ValueError`` naming ``op`` when the
    scale is 0 or not finite, or a blocked scale would overflow (checked eagerly: clone
    the tensor before writing into it)."""
    if not getattr(x, "_shared", False):
        x._data, x._scale = d, s
        return x
    work = torch.float64 if x._data.dtype == torch.float64 else torch.float32
    values = apply_scale(d.to(work), s.to(work))
    sx = x._scale.to(work)
    if not compiling() and not bool((torch.isfinite(sx) & (sx > 0)).all()):
        raise ValueError(
            f"scalify: {op} writes into a tensor that shares its storage (a view, or a "
            "tensor with views) at a scale that is 0 or not finite; clone it first"
        )
    new = (values / full_scale(x._data, sx).to(work)).to(x._data.dtype)
    if not compiling() and bool((torch.isfinite(values) & ~torch.isfinite(new)).any()):
        grown = fscale(s) if scalar(s) else None
        if x._scale.numel() != 1 or grown is None or not grown > float(sx.reshape(())):
            raise ValueError(
                f"scalify: {op} writes values that overflow {x._data.dtype} at the scale of a "
                "tensor that shares its storage (a view, or a tensor with views); clone it "
                "first"
            )
        _rescale_storage(x, grown)
        new = (values / grown).to(x._data.dtype)
    x._data.copy_(new)
    return x


def _rescale_storage(x: ScaledTensor, scale: float) -> None:
    """Every value stored in ``x``'s storage re-expressed at the per-tensor ``scale``:
    the data ``·s_x/scale`` and the scale number, both in place, so every tensor that
    shares them reads the same values."""
    whole = x._data.new_empty(0).set_(x._data.untyped_storage())
    ratio = float(x._scale.reshape(())) / scale
    whole.copy_((whole.to(torch.float64) * ratio).to(whole.dtype))
    x._scale.fill_(scale)
