"""Scale-propagation rules: shape ops, selection, softmax, norms, embedding, loss, casts, dropout.

Shape ops move the data and transform the scale the same way (a per-tensor scale is kept
as is; a block-broadcast scale is transposed/permuted/sliced with the data, or, for a view
that mixes dims, materialised elementwise first). See :mod:`lowprec.scalify.core` for the
notation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lowprec.core.granularity import apply_scale
from lowprec.core.tensor import LOGICAL_DTYPES, ScaledTensor
from lowprec.scalify.config import current_config
from lowprec.scalify.core import (
    assign,
    check_compatible,
    combine,
    deq,
    first_st,
    fscale,
    full_scale,
    guard,
    one,
    out,
    pad,
    pair,
    saturate,
    scalar,
    share,
    sqrt_factor,
    work_dtype,
)
from lowprec.scalify.domains import out_domain, rule
from lowprec.scalify.fused import fused_rule
from lowprec.scalify.rules import number_pair

aten = torch.ops.aten
__all__: list[str] = []


def _same(x: ScaledTensor, d: Tensor, s: Tensor, func: Any, args: Any) -> ScaledTensor:
    """Shape ops keep the data exactly: no rounding, no rescale; a result stored in ``x``'s
    storage shares it (in-place writes reach ``x``: :func:`~lowprec.scalify.core.share`)."""
    y = ScaledTensor._wrap(d, s.reshape(()) if s.numel() == 1 else s, x.dtype, x._fmt,
                           x.domain)  # fmt: skip
    return share(x, y, func)


# ---- shape ops ----------------------------------------------------------------------------


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
      aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
      aten.unflatten.int)  # fmt: skip
def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """View/reshape: ``d = view(d_x)``; ``s = s_x`` if per-tensor, else ``view`` of the
    materialised elementwise scale."""
    x: ScaledTensor = args[0]
    d = func(x.qdata, *args[1:], **kwargs)
    s = x.scale if scalar(x.scale) else func(full_scale(x.qdata, x.scale), *args[1:], **kwargs)
    return _same(x, d, s, func, args)


@rule(aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
      aten.expand.default)  # fmt: skip
def _dimwise(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """t, transpose, permute, unsqueeze, expand: the same op on the data and on the scale
    (padded to the data's dims: block-broadcasting is per dim, so it commutes)."""
    x: ScaledTensor = args[0]
    d = func(x.qdata, *args[1:], **kwargs)
    s = x.scale
    if not scalar(s):
        s = pad(s, x.dim())
        s = s.contiguous() if func is aten.expand.default else func(s, *args[1:], **kwargs)
    return _same(x, d, s, func, args)


def _dim_arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if func in (aten.split.Tensor, aten.split_with_sizes.default):
        return int(args[2] if len(args) > 2 else kwargs.get("dim", 0))
    return int(args[1] if len(args) > 1 else kwargs.get("dim", 0))


@rule(aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
      aten.index.Tensor, aten.index_select.default, aten.narrow.default,
      aten.unbind.int)  # fmt: skip
def _select(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """slice, select, split, index, index_select, narrow, unbind: the op on the data; the
    scale kept (per-tensor, or 1 along the dim) or put through the same op (materialised
    first when it is blocked along that dim)."""
    x: ScaledTensor = args[0]
    d = func(x.qdata, *args[1:], **kwargs)
    s = x.scale
    if scalar(s):
        ss: Any = s
    else:
        s = pad(s, x.dim())
        if func is aten.index.Tensor:
            s = full_scale(x.qdata, s)
        else:
            dim = _dim_arg(func, args, kwargs) % x.dim()
            if s.shape[dim] != x.shape[dim]:
                s = s if s.shape[dim] == 1 else full_scale(x.qdata, s)
            if s.shape[dim] == 1:
                ss = s.squeeze(dim) if func in (aten.select.int, aten.unbind.int) else s
                if isinstance(d, (list, tuple)):
                    ss = [ss] * len(d)
                return _pack(x, d, ss, func, args)
        ss = func(s, *args[1:], **kwargs)
    if isinstance(d, (list, tuple)) and not isinstance(ss, (list, tuple)):
        ss = [ss] * len(d)
    return _pack(x, d, ss, func, args)


def _pack(x: ScaledTensor, d: Any, s: Any, func: Any, args: Any) -> Any:
    if isinstance(d, (list, tuple)):
        return [_same(x, di, si, func, args) for di, si in zip(d, s, strict=True)]
    return _same(x, d, s, func, args)


def _same_scale(xs: list[Any]) -> Tensor | None:
    """The common per-tensor scale of ScaledTensors stored in the configured format, in
    one domain, eager and without automatic rescale (which would read the float32
    result), else ``None``."""
    cfg = current_config()
    if not xs or cfg.rescale != "none":
        return None
    if not all(isinstance(x, ScaledTensor) and x.scale.numel() == 1 for x in xs):
        return None
    store = cfg.storage_dtype
    if any(x.qdata.dtype != store for x in xs) or len({x.domain for x in xs}) != 1:
        return None
    first: ScaledTensor = xs[0]
    f = fscale(first.scale)
    if f is None or any(fscale(x.scale) != f for x in xs[1:]):
        return None
    return first.scale.reshape(()).float()


@rule(aten.cat.default, aten.stack.default)
def _cat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """cat/stack of ``x_i``: per-tensor scales give ``s = max s_i``, ``d = cat(d_i·s_i/s)``;
    otherwise ``s = cat`` of the materialised elementwise scales. A plain tensor counts at
    its own scale (:func:`~lowprec.scalify.rules.number_pair`: an empty or all-zero one at
    0, small values their own): HF's key/value cache starts each layer with
    ``cat([empty, k])``, whose result at scale 1 flushed ``k`` at ``s_k = 2^-30`` to zero."""
    xs = list(args[0])
    check_compatible(*xs)
    ref = first_st(xs)
    work = work_dtype(*xs)
    same = _same_scale(xs)
    if same is not None:  # (eager) d_i·s_i/s = d_i: the stored data, joined as they are
        d = func([x.qdata for x in xs], *args[1:], **kwargs)
        return ScaledTensor._wrap(d, same, ref.dtype, ref._fmt, out_domain(args))
    pairs = [pair(x, work) if isinstance(x, ScaledTensor) else number_pair(x, ref, work)
             for x in xs]  # fmt: skip
    if all(scalar(s) for _, s in pairs):
        s = torch.stack([p[1].reshape(()) for p in pairs]).amax()
        safe = torch.where(s > 0, s, 1.0)
        d = func([di * (si / safe).to(work) for di, si in pairs], *args[1:], **kwargs)
        return out(func, args, d, s)
    fulls = [full_scale(di, si) for di, si in pairs]
    d = func([di.to(work) for di, _ in pairs], *args[1:], **kwargs)
    s = func(fulls, *args[1:], **kwargs)
    return ScaledTensor._wrap(d.to(ref.qdata.dtype), s, ref.dtype, ref._fmt, ref.domain)


# ---- selection ---------------------------------------------------------------------------


# A fill of at least FP16's largest finite value (HF's ``finfo(dtype).min`` masks, ±inf)
# is a sentinel: it saturates instead of raising the scale (which would flush the data).
_SENTINEL = 65504.0


def _is_number(t: Any) -> bool:
    return not isinstance(t, ScaledTensor) and (not isinstance(t, Tensor) or t.dim() == 0)


@rule(aten.where.self)
def _where(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``where(c, a, b)``: ``s = max(s_a, s_b)``, ``d = where(c, a, b) / s``; finite data
    saturate (:func:`~lowprec.scalify.core.saturate`).

    With one operand a number ``f`` (Python or a plain 0-dim tensor) and the other ``x``
    scaled: ``s = max(s_x, |f| / max_q)`` (``max_q``: the storage format's largest value),
    the smallest scale at or above ``x``'s that holds ``f``; a sentinel fill
    ``|f| >= 65504`` (e.g. ``torch.finfo(torch.float32).min`` of an attention mask) gets
    ``s = max(s_x, 1)`` and saturates to ``±max_q`` there, as in a plain model of the
    format, so it still masks (kept at ``x``'s own smaller scale it saturated to
    ``±max_q·s_x``: at ``s_x = 2^-12`` a causal mask let 16% of a row's weight onto masked
    keys); ±inf keeps ``s = s_x`` (for a per-tensor ``s_x``; otherwise the general
    rule)."""
    c, a, b = args
    x, fill = (b, a) if _is_number(a) else (a, b)
    if _is_number(a) != _is_number(b) and isinstance(x, ScaledTensor) and x.scale.numel() == 1:
        work = work_dtype(x)
        fv = (
            fill.to(device=x.qdata.device, dtype=work)
            if isinstance(fill, Tensor)
            else torch.tensor(float(fill), dtype=work, device=x.qdata.device)
        )
        mag = fv.detach().abs().float()
        top = float(torch.finfo(x.qdata.dtype).max)
        need = torch.where(torch.isfinite(mag), torch.where(mag < _SENTINEL, mag / top, 1.0), 0.0)
        s = torch.maximum(x.scale.float(), need)
        v = torch.where(c, deq(x, work), fv) if x is a else torch.where(c, fv, deq(x, work))
        d = apply_scale(v, torch.where(s > 0, s, 1.0).to(work), "div")
        return out(func, args, saturate(d), s)
    check_compatible(a, b)
    ref = first_st((a, b))
    work = work_dtype(a, b)
    (da, sa), (db, sb) = number_pair(a, ref, work), number_pair(b, ref, work)
    v = torch.where(c, apply_scale(da, sa.to(work)), apply_scale(db, sb.to(work)))
    s = combine(sa, sb, tuple(v.shape))
    d = apply_scale(v, torch.where(s > 0, s, 1.0).to(work), "div")
    return out(func, args, saturate(d), s)


@rule(aten.masked_fill.Scalar)
def _masked_fill(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``masked_fill(x, m, v)``: ``d = masked_fill(d_x, m, v / s_x)``, ``s = s_x`` where
    the storage format holds ``v / s_x`` (±inf stays ±inf); otherwise, for a per-tensor
    ``s_x``, :func:`_where`'s rule for ``where(m, v, x)`` (the scale rises to hold ``v``;
    a sentinel fill raises it to at least 1 and saturates there)."""
    x, mask, v = args
    work = work_dtype(x)
    f = fscale(x.scale)
    top = float(torch.finfo(x.qdata.dtype).max)
    if f is not None and f > 0:
        fill = float(v) / f
        if not math.isfinite(fill) or abs(fill) <= top:
            # in the storage format directly: no casts; only the fill value is rounded
            # (a where() with the fill as a 0-dim tensor: the same values, one pass)
            q = x.qdata
            if isinstance(mask, Tensor) and mask.dim() <= q.dim():
                fv = torch.tensor(fill, dtype=q.dtype, device=q.device)
                return _same(x, torch.where(mask, fv, q), x.scale, func, args)
            return _same(x, q.masked_fill(mask, fill), x.scale, func, args)
    if x.scale.numel() == 1:  # the scale rises to hold the fill: where's rule
        return _where(func, (mask, v, x), {})
    s = x.scale.amax()
    d = deq(x, work).masked_fill(mask, float(v)) / torch.where(s > 0, s, 1.0).to(work)
    return out(func, args, saturate(d), s)


# ---- softmax -----------------------------------------------------------------------------


@rule(aten._softmax.default, aten._log_softmax.default)
def _softmax(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r"""softmax / log_softmax: ``v = f(d_x·s_x)`` in float32 (not scale-invariant), ``s = 1``,
    then :func:`~lowprec.scalify.core.guard` applied (log_softmax of logits at ``2^20`` is
    ``~-2^21``: beyond FP16 at scale 1)."""
    x, dim = args[0], args[1]
    work = work_dtype(x)
    fused = fused_rule(func, [x], work, (dim, False))
    if fused is not None:
        return out(func, args, *guard(fused, one(fused)))
    v = func(deq(x, work), dim, False)
    return out(func, args, *guard(v, one(v)))


@rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """softmax: ``y ⊙ (g − Σ g⊙y)``; log_softmax: ``g − exp(y)·Σ g`` (``y`` the forward
    output). Both are linear in ``g``: ``d`` = the same formula on ``d_g``, ``s = s_g``
    (a non-scalar ``s_g`` is folded to its max first, as the sum mixes rows)."""
    g, y, dim = args[0], args[1], args[2]
    work = work_dtype(g, y)
    if isinstance(g, ScaledTensor) and scalar(g.scale):
        fused = fused_rule(func, [(g.qdata, None), y], work, (dim, work))
        if fused is not None:
            return out(func, args, fused, g.scale)
    dg, sg = pair(g, work)
    if not scalar(sg):
        sg = sg.amax()
        dg = deq(g, work) / sg.to(work)
    return out(func, args, func(dg, deq(y, work), dim, work), sg)


# ---- norms ----------------------------------------------------------------------------------


@rule(aten.native_layer_norm.default)
def _layer_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``y = (x − μ)/√(σ² + ε)·w + b`` from ``v = d_x·s_x`` and the affine's values, in
    float32 by aten's kernel (one pass, as the plain model computes it); ``s = max(s_w,
    s_b)`` (1 without affine), ``d = y / s``, then :func:`~lowprec.scalify.core.guard`
    (``y`` is not unit where ``σ² ≪ ε``: inputs at ``2^-40`` under the default ``ε``
    normalise to ~``2^-23``, FP16 zeros at ``s``). Mean and rstd return as plain
    float32."""
    x, shape, w, b, eps = args
    work = work_dtype(x)
    wv = deq(w, work) if w is not None else None
    bv = deq(b, work) if b is not None else None
    y, mean, rstd = func(deq(x, work), shape, wv, bv, eps)
    scales = [t.scale.amax() for t in (w, b) if isinstance(t, ScaledTensor)]
    s = torch.stack(scales).amax() if scales else one(y)
    if fscale(s) != 1.0:  # (a unit scale, eager: nothing to divide)
        y = y / torch.where(s > 0, s, 1.0).to(work)
    return out(func, args, *guard(y, s)), mean, rstd


@rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Linear in ``g``: aten's backward on ``d_g`` (and float32 ``x``, ``w``) gives
    ``dx`` at ``s = s_g``, :func:`~lowprec.scalify.core.guard` applied (``dx`` carries the
    ``1/σ`` of ``x``: at ``x ~ 2^20`` its data would be FP16 subnormals at ``s_g``); ``dw``,
    ``db`` (sums over r rows) at ``s_g·c(r)``, data ``/c(r)``, guarded as well (``dw`` sums
    ``g·x̂``, as small as ``x̂`` where ``σ² ≪ ε``)."""
    g, x, shape, mean, rstd, w, b, mask = args
    work = work_dtype(g, x)
    dg, sg = pair(g, work)
    if not scalar(sg):
        sg = sg.amax()
        dg = deq(g, work) / sg.to(work)
    wv, bv = deq(w, work), deq(b, work)
    dx, dw, db = func(dg, deq(x, work), shape, mean, rstd, wv, bv, mask)
    numel = 1
    for k in shape:
        numel *= k
    c = sqrt_factor(dg.numel() // max(numel, 1))
    res = [out(func, args, *guard(dx, sg)) if dx is not None else None]
    res += [out(func, args, *guard(t / c, sg * c)) if t is not None else None for t in (dw, db)]
    return tuple(res)


# ---- embedding and loss ----------------------------------------------------------------------


@rule(aten.embedding.default)
def _embedding(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``W[idx]``: ``d = d_W[idx]``; ``s = s_W`` per-tensor, ``s_W[idx]`` per-row, else the
    materialised scale gathered."""
    w, idx = args[0], args[1]
    d = func(w.qdata, idx, *args[2:], **kwargs)
    s = w.scale
    if not scalar(s):
        s = pad(s, 2)
        s = s[idx] if s.shape[1] == 1 and s.shape[0] == w.shape[0] else full_scale(w.qdata, s)[idx]
    return _same(w, d, s, func, args)


@rule(aten.embedding_dense_backward.default)
def _embedding_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Scatter-add of ``g`` rows (about n/V per row): ``d = scatter(d_g)/c(n/V)``,
    ``s = s_g·c(n/V)``."""
    g, idx, num = args[0], args[1], int(args[2])
    work = work_dtype(g)
    dg, sg = pair(g, work)
    if not scalar(sg):
        sg = sg.amax()
        dg = deq(g, work) / sg.to(work)
    c = sqrt_factor(max(idx.numel() // max(num, 1), 1))
    return out(func, args, func(dg, *args[1:], **kwargs) / c, sg * c)


def _plain_weight(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``(x, target, weight, ...)`` with a scaled class ``weight`` dequantized."""
    w = args[2]
    if isinstance(w, ScaledTensor):
        return (*args[:2], deq(w, work_dtype(w)), *args[3:])
    return args


@rule(aten.nll_loss_forward.default)
def _nll(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``−mean x[target]`` (linear): ``d = nll(d_x)``, ``s = s_x`` (per-tensor scale).
    Class weights are read as their values (a scaled ``weight`` dequantized)."""
    args = _plain_weight(args)
    x = args[0]
    if not isinstance(x, ScaledTensor):  # (only the weight was scaled)
        return func(*args, **kwargs)
    work = work_dtype(x)
    if scalar(x.scale):
        v, tw = func(x.qdata.to(work), *args[1:], **kwargs)
        return out(func, args, v, x.scale), tw
    v, tw = func(deq(x, work), *args[1:], **kwargs)
    return out(func, args, v, one(v)), tw


@rule(aten.nll_loss_backward.default)
def _nll_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Mean reduction: ``d = −d_g`` at the targets (the sum's gradient) and
    ``s = s_g / total_weight``: the ``1/N`` of the mean goes into the scale."""
    g, x, target, weight, reduction, ignore, tw = args[:1] + _plain_weight(args[1:])
    work = work_dtype(g, x)
    dg, sg = pair(g, work)
    xd = x.qdata if isinstance(x, ScaledTensor) else x
    if reduction == 1:
        d = func(dg, xd.to(work), target, weight, 2, ignore, tw)
        return out(func, args, d, sg / tw.to(sg.dtype))
    return out(func, args, func(dg, xd.to(work), target, weight, reduction, ignore, tw), sg)


# ---- casts, creation, scalars ------------------------------------------------------------


@rule(aten._to_copy.default)
def _to_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Cast: a float dtype changes the logical dtype only (data and scale untouched, moved
    to a device if asked); a non-float dtype returns the plain ``d_x·s_x`` cast."""
    x: ScaledTensor = args[0]
    kw = dict(kwargs)
    dtype = kw.pop("dtype", None) or x.dtype
    kw.pop("layout", None)
    if dtype not in LOGICAL_DTYPES:
        return deq(x, work_dtype(x)).to(dtype)
    return ScaledTensor._wrap(func(x.qdata, **kw), func(x.scale, **kw), dtype, x._fmt, x.domain)


@rule(aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
      aten.full_like.default)  # fmt: skip
def _like(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """New tensors shaped like ``x``: plain tensors (of ``x``'s logical dtype unless given);
    nothing to scale yet. Mixed with ScaledTensors later they count as scale 1."""
    x: ScaledTensor = args[0]
    kw = dict(kwargs)
    kw["dtype"] = kw.get("dtype") or x.dtype
    return func(x.qdata, *args[1:], **kw)


@rule(aten._local_scalar_dense.default)
def _item(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.item()``: of ``d_x·s_x``."""
    return func(deq(args[0], work_dtype(args[0])))


@rule(aten.isfinite.default, aten.isnan.default, aten.isinf.default)
def _test(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """isfinite, isnan, isinf: of ``d_x`` (scales are finite and > 0 or zero)."""
    return func(args[0].qdata)


@rule(aten.eq.Scalar, aten.ne.Scalar, aten.gt.Scalar, aten.lt.Scalar, aten.ge.Scalar,
      aten.le.Scalar, aten.eq.Tensor, aten.ne.Tensor, aten.gt.Tensor, aten.lt.Tensor,
      aten.ge.Tensor, aten.le.Tensor)  # fmt: skip
def _compare(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Comparisons: of the values ``d·s`` (a plain bool tensor)."""
    work = work_dtype(*args)
    return func(*(deq(a, work) for a in args), **kwargs)


@rule(aten.copy_.default)
def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``dst.copy_(src)``: a ScaledTensor ``dst`` takes ``src``'s data and scale (a view
    ``dst``, as ``z[1:3] = y`` makes, its values at its own scale:
    :func:`~lowprec.scalify.core.assign`); a plain ``dst`` gets ``d·s``."""
    dst, src = args[0], args[1]
    if isinstance(dst, ScaledTensor):
        d, s = pair(src, work_dtype(src))
        if not scalar(s) and d.shape != dst.shape:  # src broadcast: its scale with it
            s = full_scale(d, s).expand(dst.shape).contiguous()
        return assign(dst, d.to(dst.qdata.dtype).expand(dst.shape).clone(), s, func)
    return dst.copy_(deq(src, work_dtype(src)))


# ---- dropout -------------------------------------------------------------------------------


@rule(aten.native_dropout.default)
def _dropout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x·m/(1−p)`` (m the Bernoulli keep-mask): ``d = d_x·m`` (exact), ``s = s_x/(1−p)``
    in training, ``s_x`` otherwise."""
    x, p, train = args[0], float(args[1]), args[2]
    _, mask = func(x.qdata, p, train)
    s = x.scale / (1.0 - p) if train and p < 1.0 else x.scale
    d = x.qdata * mask
    return ScaledTensor._wrap(d, s, x.dtype, x._fmt, x.domain), mask


@rule(aten.native_dropout_backward.default)
def _dropout_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``g·m·c`` (c = 1/(1−p)): ``d = d_g·m`` (exact), ``s = s_g·c``."""
    g, mask, c = args[0], args[1], float(args[2])
    return ScaledTensor._wrap(g.qdata * mask, g.scale * c, g.dtype, g._fmt, g.domain)
