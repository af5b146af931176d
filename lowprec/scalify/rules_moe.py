"""Scale-propagation rules for the ops of a mixture-of-experts layer.

HF transformers' MoE forwards (routers, and the experts' ``grouped_mm``, ``batched_mm``
and ``eager`` implementations) and their backwards call, on scaled tensors: ``topk`` (and
``max``/``min`` along a dim, ``sort``), ``_grouped_mm`` (the experts' GEMMs, forward and
backward), ``gather``, ``index_put`` (the backward of indexing by a tensor),
``scatter``/``scatter_add`` (the backward of ``topk``/``gather``), ``index_add`` (the
eager implementation's combination), ``clamp`` (GPT-OSS's clamped SwiGLU) and the
``new_*`` factories. Notation as in :mod:`lowprec.scalify.core`: ``x = d_x·s_x``,
``c(n) = √n`` (power-of-two rounded per the config).

* **order ops** (``topk``, ``max.dim``, ``min.dim``, ``sort``): ``f(s·d) = s·f(d)`` for a
  per-tensor ``s ≥ 0`` (the order of the values is the order of the data), so the values
  are ``d = f(d_x)`` exactly, ``s = s_x``, and the indices are the plain op's; a blocked
  scale: ``f`` of ``d_x·s_x``, ``s = max s_x``.
* **grouped GEMM** ``_grouped_mm(a, b, offs)``: per-tensor scales, ``d = (d_a ⋆ d_b)/c(K)``,
  ``s = s_a·s_b·c(K)``, with ``K`` the contracted length: ``a``'s last dim, or, when the
  groups split the contracted dim (the weight gradient ``xᵀ ⋆ g``), its mean group length
  ``K/G``; then :func:`~lowprec.scalify.core.guard`. FP8 data format: both operands cast
  as a matmul's (E4M3, gradients E5M2) at per-tensor power-of-two scales, as ``mm``.
* **gather**: ``d = gather(d_x)``, ``s = s_x`` (exact).
* **writes into a tensor** (``index_put``, ``scatter``, ``scatter_add``, ``index_add``,
  out-of-place and in place): destination ``t`` and source ``u`` (a plain tensor at the
  scale of its largest magnitude, so zeros never set it), ``s = max(s_t, s_u)``,
  ``d = op(d_t·s_t/s, d_u·s_u/s)`` (ratios ≤ 1); an accumulating
  op (``accumulate``, ``scatter_add``, ``index_add``) sums duplicates, so its data go
  through :func:`~lowprec.scalify.core.guard`. A plain destination written in place (HF's
  ``zeros_like(...).index_add_(...)``) receives the source's values ``d_u·s_u``.
* **clamp** with number bounds: ``d = clamp(d_x, lo/s_x, hi/s_x)``, ``s = s_x`` (exact);
  with tensor bounds or a blocked scale, of the values, ``s = max s_x``.
* **new_zeros / new_ones / new_full / new_empty(_strided)**: plain tensors of the logical
  dtype, as ``zeros_like`` (scale 1 when mixed with scaled tensors later).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lowprec.core.tensor import ScaledTensor
from lowprec.scalify.config import current_config
from lowprec.scalify.core import (
    assign,
    check_compatible,
    deq,
    fscale,
    guard,
    is_st,
    out,
    scalar,
    scalar_pair,
    sqrt_factor,
    work_dtype,
)
from lowprec.scalify.domains import is_grad, rule
from lowprec.scalify.rules import fp8_round

aten = torch.ops.aten
__all__: list[str] = []


def _same(x: ScaledTensor, d: Tensor, s: Tensor) -> ScaledTensor:
    """Data moved exactly (no rounding): ``x``'s format, dtype and domain."""
    return ScaledTensor._wrap(d, s.reshape(()) if s.numel() == 1 else s, x.dtype, x._fmt, x.domain)


# ---- order ops ------------------------------------------------------------------------------


@rule(aten.topk.default, aten.max.dim, aten.min.dim, aten.sort.default, aten.sort.stable)
def _order(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """topk, max/min along a dim, sort: values ``f(d_x)`` at ``s_x``, the plain indices."""
    x: ScaledTensor = args[0]
    if scalar(x.scale):
        vals, idx = func(x.qdata, *args[1:], **kwargs)
        return _same(x, vals, x.scale), idx
    work = work_dtype(x)
    vals, idx = func(deq(x, work), *args[1:], **kwargs)
    s = x.scale.amax()
    return out(func, args, vals / s.to(work), s), idx


@rule(aten.gather.default)
def _gather(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.gather(dim, idx)``: ``d = gather(d_x)``, ``s = s_x`` (a blocked scale: the
    values gathered, ``s = max s_x``)."""
    x: ScaledTensor = args[0]
    if scalar(x.scale):
        return _same(x, func(x.qdata, *args[1:], **kwargs), x.scale)
    work = work_dtype(x)
    s = x.scale.amax()
    return out(func, args, func(deq(x, work), *args[1:], **kwargs) / s.to(work), s)


# ---- grouped GEMM ---------------------------------------------------------------------------


def _contracted(a: Tensor, b: Tensor, offs: Tensor | None) -> int:
    """The contracted length of ``_grouped_mm(a, b, offs)`` a scale is chosen for: the mean
    group length where the groups split it (2-D ``a`` and ``b``), else ``a.shape[-1]``."""
    k = int(a.shape[-1])
    if a.dim() == 2 and b.dim() == 2 and offs is not None and offs.numel():
        return max(1, k // int(offs.numel()))
    return k


@rule(aten._grouped_mm.default)
def _grouped_mm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_grouped_mm(a, b, offs)`` (module doc): ``d = (d_a ⋆ d_b)/c(K)``,
    ``s = s_a·s_b·c(K)``; blocked scales are folded to their max first."""
    a, b = args[0], args[1]
    rest = list(args[2:])
    offs = rest[0] if rest else kwargs.get("offs")
    bias = rest[1] if len(rest) > 1 else kwargs.get("bias")
    if is_st(bias):
        raise NotImplementedError("scalify: _grouped_mm with a scaled bias has no rule")
    check_compatible(a, b)
    work = work_dtype(a, b)
    (da, sa), (db, sb) = scalar_pair(a, work), scalar_pair(b, work)
    if current_config().fp8_matmul:
        da, db = fp8_round(da, is_grad(a)), fp8_round(db, is_grad(b))
    c = sqrt_factor(_contracted(da, db, offs))
    kw = {k: v for k, v in kwargs.items() if k != "out_dtype"}
    d = func(da, db, *rest, **kw)
    return out(func, args, *guard(d / c, sa * sb * c))


# ---- writes into a tensor -------------------------------------------------------------------


def _own(x: Any, work: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(d, s)`` of a write's operand: a ScaledTensor's per-tensor pair; a plain tensor at
    the scale of its largest magnitude (0 for zeros, which then never set the scale: a
    zero destination must not flush a small-scaled source)."""
    if is_st(x):
        return scalar_pair(x, work)
    v = x.to(work)
    m = v.detach().abs().amax().float() if v.numel() else torch.zeros((), device=v.device)
    return v / torch.where(m > 0, m, 1.0).to(work), m


def _joint(t: Any, u: Any, work: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(d_t·s_t/s, d_u·s_u/s, s)`` with ``s = max(s_t, s_u)`` (per-tensor; a plain tensor
    at its own magnitude, :func:`_own`; a zero scale never wins)."""
    (dt, st), (du, su) = _own(t, work), _own(u, work)
    ft, fu = fscale(st), fscale(su)
    if ft is not None and fu is not None:
        f = max(ft, fu)
        if f == 0.0:
            return dt, du, st
        dt, du = (dt if ft == f else dt * (ft / f)), (du if fu == f else du * (fu / f))
        return dt, du, st.new_tensor(f)
    s = torch.maximum(st, su)
    safe = torch.where(s > 0, s, 1.0)
    return dt * (st / safe).to(work), du * (su / safe).to(work), s


def _write(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dst: Any, src: Any,
           call: Any, accumulate: bool) -> Any:  # fmt: skip
    """``call(d_dst, d_src)`` at the joint scale (module doc); in place into ``dst``."""
    inplace = func._schema.name.endswith("_")
    work = work_dtype(*(t for t in (dst, src) if is_st(t)))
    if inplace and not isinstance(dst, ScaledTensor):  # a plain tensor receives the values
        return call(dst, deq(src, dst.dtype) if is_st(src) else src, True)
    dt, du, s = _joint(dst, src, work)
    d = call(dt, du, False)
    d, s = guard(d, s) if accumulate else (d, s)
    res = out(func, (dst, src), d, s)
    if inplace:
        return assign(dst, res.qdata, res.scale, func)
    return res


@rule(aten.index_put.default, aten.index_put_.default)
def _index_put(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t[indices] = u`` (or ``+=`` with ``accumulate``): module doc."""
    dst, indices, src = args[0], args[1], args[2]
    acc = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))

    def call(t: Tensor, u: Tensor, plain_inplace: bool) -> Tensor:
        # the aten ops: ``t[:, idx] = u`` holds None in ``indices``, which only they take
        if plain_inplace:
            out: Tensor = aten.index_put_.default(t, indices, u.to(t.dtype), acc)
            return out
        res: Tensor = aten.index_put.default(t, indices, u.to(t.dtype), acc)
        return res

    return _write(func, args, kwargs, dst, src, call, acc)


@rule(aten.scatter.src, aten.scatter_.src, aten.scatter_add.default, aten.scatter_add_.default)
def _scatter(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.scatter(dim, idx, u)`` / ``scatter_add``: module doc."""
    dst, dim, index, src = args[:4]
    acc = func in (aten.scatter_add.default, aten.scatter_add_.default)

    def call(t: Tensor, u: Tensor, plain_inplace: bool) -> Tensor:
        if plain_inplace:
            return t.scatter_add_(dim, index, u) if acc else t.scatter_(dim, index, u)
        return torch.scatter_add(t, dim, index, u) if acc else torch.scatter(t, dim, index, u)

    return _write(func, args, kwargs, dst, src, call, acc)


@rule(aten.index_add.default, aten.index_add_.default)
def _index_add(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``t.index_add(dim, idx, u, alpha=α)``: module doc (``α`` applied to ``u``'s data)."""
    dst, dim, index, src = args[:4]
    alpha = float(args[4] if len(args) > 4 else kwargs.get("alpha", 1))

    def call(t: Tensor, u: Tensor, plain_inplace: bool) -> Tensor:
        if plain_inplace:
            return t.index_add_(dim, index, u.to(t.dtype), alpha=alpha)
        return torch.index_add(t, dim, index, u.to(t.dtype), alpha=alpha)

    return _write(func, args, kwargs, dst, src, call, True)


# ---- clamp, factories -----------------------------------------------------------------------


@rule(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)
def _clamp(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r"""``clamp(x, lo, hi)`` with number bounds: ``d = clamp(d_x, lo/s_x, hi/s_x)``,
    ``s = s_x`` (``s_x > 0``, eager); otherwise of the values, ``s = max s_x``; then
    :func:`~lowprec.scalify.core.guard` applied (a bound far above the values, ``clamp(min=
    0.25)`` of values at ``2^-20``, gives data beyond FP16 at ``s_x``)."""
    x: ScaledTensor = args[0]
    if func is aten.clamp.default:
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")
    else:
        b = args[1] if len(args) > 1 else kwargs.get("min", kwargs.get("max"))
        lo, hi = (b, None) if func is aten.clamp_min.default else (None, b)
    work = work_dtype(x)
    f = fscale(x.scale)
    if f is not None and f > 0 and not isinstance(lo, Tensor) and not isinstance(hi, Tensor):
        lo_d = None if lo is None else float(lo) / f
        hi_d = None if hi is None else float(hi) / f
        ok = all(v is None or math.isfinite(v) for v in (lo_d, hi_d))
        if ok:
            return out(func, args, *guard(torch.clamp(x.qdata.to(work), lo_d, hi_d), x.scale))
    _, s = scalar_pair(x, work)
    v = torch.clamp(deq(x, work), deq(lo, work), deq(hi, work))
    return out(func, args, *guard(v / torch.where(s > 0, s, 1.0).to(work), s))


@rule(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
      aten.new_empty.default, aten.new_empty_strided.default)  # fmt: skip
def _new(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """New tensors from ``x`` (shape given): plain tensors of ``x``'s logical dtype unless
    given; nothing to scale yet."""
    x: ScaledTensor = args[0]
    kw = dict(kwargs)
    kw["dtype"] = kw.get("dtype") or x.dtype
    return func(x.qdata, *args[1:], **kw)
