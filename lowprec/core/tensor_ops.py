"""Layout ops of a :class:`~lowprec.core.tensor.ScaledTensor` that keep its scale valid.

A ScaledTensor stands for ``data × scale``, the scale broadcast block-wise: along each
dimension ``d`` the scale has extent 1 (one scale for the whole dimension), the data's
extent (one per element) or ``n / g`` (one per block of ``g`` elements). An op that moves
or selects values is exact on the pair ``(data, scale)`` when every scale block stays whole:

* **transpose, t, permute**: the data and the scale are permuted alike (a row-scaled matrix
  becomes column-scaled); the recorded granularity is kept for a tensor-wise scale and
  dropped (``None``: unknown) otherwise.
* **view, reshape**: only a tensor-wise scale (one number) survives any reshape; a finer
  scale would be split across the new dimensions: refused.
* **slice, select, split, chunk, unbind** along ``d``: exact where the scale has extent 1
  or one entry per element along ``d``; for blocks of ``g`` the start and the end (or the
  dimension's end) must be multiples of ``g`` and the step 1.
* **cat** along ``d``: the inputs must share format, logical dtype and granularity. Equal
  scales that are broadcast along ``d`` (a tensor-wise scale, say) are kept. Otherwise the
  scales are concatenated along ``d`` when every input holds whole blocks of one common
  size there (per element, per block of ``g``, or a broadcast scale over an extent equal
  in every input, which becomes a block of that extent; the granularity is then
  unknown); anything else would need requantizing and is refused.
* **copy_** of a ScaledTensor into a plain tensor writes its values
  (:mod:`lowprec.core.tensor`); **index_put_** into a tensor-wise scaled tensor takes
  ScaledTensor values of the same format and scale (their payloads are written).

Everything else raises ``ValueError`` naming the layout reason (a zero-padded tensor,
``unpadded_shape``, takes none of these: its padding is not part of its values). These
rules apply to ScaledTensors of no domain; a domain's own rules decide for its tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lowprec.core.tensor import ScaledTensor, register_rule

__all__: list[str] = []

aten = torch.ops.aten


def _scale_nd(x: ScaledTensor) -> Tensor:
    """The scale with as many dims as the data (leading broadcast dims of size 1)."""
    s = x._scale
    return s.reshape((1,) * (x._data.dim() - s.dim()) + tuple(s.shape))


def _check_unpadded(x: ScaledTensor, op: str) -> None:
    if x._unpadded is not None:
        raise ValueError(
            f"{op}: the ScaledTensor is zero-padded to whole blocks (unpadded_shape "
            f"{x._unpadded}); dequantize it first"
        )


def _group(x: ScaledTensor, s: Tensor, dim: int) -> int:
    """Elements per scale entry along ``dim`` (0: the scale is broadcast along it)."""
    n, k = int(x._data.shape[dim]), int(s.shape[dim])
    if k == 1 and n != 1:
        return 0
    return n // k


def _wrap(x: ScaledTensor, data: Tensor, scale: Tensor, keep_granularity: bool) -> ScaledTensor:
    g = x.granularity if keep_granularity else None
    return ScaledTensor._wrap(data, scale, x.dtype, x._fmt, x._domain, g, None)


def _tensor_wise(x: ScaledTensor) -> bool:
    return x._scale.numel() == 1


@register_rule(aten.t.default, aten.transpose.int, aten.permute.default, plain_only=True)
def _permute(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    x: ScaledTensor = args[0]
    _check_unpadded(x, str(func))
    data = func(x._data, *args[1:], **kwargs)
    if _tensor_wise(x):
        return _wrap(x, data, x._scale, True)
    return _wrap(x, data, func(_scale_nd(x), *args[1:], **kwargs), False)


@register_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, plain_only=True)
def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    x: ScaledTensor = args[0]
    _check_unpadded(x, str(func))
    if not _tensor_wise(x):
        raise ValueError(
            f"{func}: a ScaledTensor with scale shape {tuple(x._scale.shape)} cannot be "
            "reshaped: its scale blocks would be split across the new dimensions (only a "
            "tensor-wise scale survives a reshape); dequantize it first"
        )
    return _wrap(x, func(x._data, *args[1:], **kwargs), x._scale, True)


def _slice_scale(x: ScaledTensor, s: Tensor, dim: int, start: int, end: int, op: str) -> Tensor:
    """The scale of ``data[start:end]`` along ``dim``, or ``ValueError`` if that cuts a block."""
    g = _group(x, s, dim)
    if g == 0:
        return s
    n = int(x._data.shape[dim])
    if start % g or (end % g and end != n):
        raise ValueError(
            f"{op}: [{start}:{end}] along dim {dim} cuts the ScaledTensor's scale blocks of "
            f"{g} elements (scale shape {tuple(x._scale.shape)}); slice on block boundaries "
            "or dequantize first"
        )
    return s.narrow(dim, start // g, (end - start + g - 1) // g)


def _norm(dim: int, nd: int) -> int:
    return dim + nd if dim < 0 else dim


@register_rule(aten.slice.Tensor, plain_only=True)
def _slice(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    x: ScaledTensor = args[0]
    _check_unpadded(x, "slice")
    params = list(args[1:]) + [None] * (4 - len(args[1:]))
    dim = _norm(int(kwargs.get("dim", params[0] if params[0] is not None else 0)), x.dim())
    n = int(x._data.shape[dim])
    start = kwargs.get("start", params[1])
    end = kwargs.get("end", params[2])
    step = int(kwargs.get("step", params[3] if params[3] is not None else 1))
    start, end, _ = slice(start, end).indices(n)
    data = x._data[(slice(None),) * dim + (slice(start, end, step),)]
    if _tensor_wise(x):
        return _wrap(x, data, x._scale, True)
    s = _scale_nd(x)
    if step != 1 and _group(x, s, dim) not in (0, 1):
        raise ValueError(f"slice: a step of {step} along dim {dim} cuts the scale blocks")
    if _group(x, s, dim) == 1:
        scale = s[(slice(None),) * dim + (slice(start, end, step),)]
    else:
        scale = _slice_scale(x, s, dim, start, max(end, start), "slice")
    return _wrap(x, data, scale, True)


@register_rule(aten.select.int, plain_only=True)
def _select(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    x: ScaledTensor = args[0]
    _check_unpadded(x, "select")
    dim, index = _norm(int(args[1]), x.dim()), int(args[2])
    data = x._data.select(dim, index)
    if _tensor_wise(x):
        return _wrap(x, data, x._scale, True)
    s = _scale_nd(x)
    g = _group(x, s, dim)
    if g > 1:
        raise ValueError(
            f"select: one element of dim {dim} cuts the ScaledTensor's scale blocks of {g}; "
            "dequantize first"
        )
    scale = s.select(dim, 0) if g == 0 else s.select(dim, index)
    return _wrap(x, data, scale, False)


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, plain_only=True)
def _split(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[ScaledTensor]:
    x: ScaledTensor = args[0]
    _check_unpadded(x, "split")
    size = args[1]
    dim = _norm(int(args[2] if len(args) > 2 else kwargs.get("dim", 0)), x.dim())
    n = int(x._data.shape[dim])
    sizes = (
        [size] * (n // size) + ([n % size] if n % size else []) if isinstance(size, int) else size
    )
    out, start = [], 0
    for k in sizes:
        out.append(_slice(aten.slice.Tensor, (x, dim, start, start + int(k)), {}))
        start += int(k)
    return out


@register_rule(aten.unbind.int, plain_only=True)
def _unbind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[ScaledTensor]:
    x: ScaledTensor = args[0]
    dim = _norm(int(args[1] if len(args) > 1 else kwargs.get("dim", 0)), x.dim())
    return [_select(aten.select.int, (x, dim, i), {}) for i in range(int(x.shape[dim]))]


@register_rule(aten.cat.default, plain_only=True)
def _cat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    xs: Sequence[Any] = args[0]
    if not all(isinstance(t, ScaledTensor) for t in xs):
        raise ValueError("cat: a ScaledTensor joins only ScaledTensors (dequantize the others)")
    first: ScaledTensor = xs[0]
    dim = _norm(int(args[1] if len(args) > 1 else kwargs.get("dim", 0)), first.dim())
    for t in xs:
        _check_unpadded(t, "cat")
        if (t._fmt, t.dtype, t._granularity, t._data.dtype) != (
            first._fmt,
            first.dtype,
            first._granularity,
            first._data.dtype,
        ):
            raise ValueError(
                "cat: the ScaledTensors differ in format, dtype or granularity; they cannot "
                "share one layout"
            )
    data = torch.cat([t._data for t in xs], dim)
    scales = [_scale_nd(t) for t in xs]
    if all(torch.equal(sc, scales[0]) for sc in scales[1:]) and all(
        _group(t, sc, dim) == 0 for t, sc in zip(xs, scales, strict=True)
    ):  # one scale along dim, the same for all (a tensor-wise scale, say): it is kept
        return _wrap(first, data, first._scale, True)
    # Otherwise the scale entries along dim are concatenated: each input must hold whole
    # blocks of one common size (a scale broadcast along dim is one block of its extent).
    sizes = {
        int(t._data.shape[dim]) if _group(t, sc, dim) == 0 else _group(t, sc, dim)
        for t, sc in zip(xs, scales, strict=True)
    }
    others = {tuple(sc.shape[:dim]) + tuple(sc.shape[dim + 1 :]) for sc in scales}
    if len(sizes) != 1 or len(others) != 1:
        raise ValueError(
            f"cat: along dim {dim} the scales differ and the tensors do not hold whole scale "
            f"blocks of one size (block sizes {sorted(sizes)}, scale shapes "
            f"{[tuple(t._scale.shape) for t in xs]}): two scales cannot become one without "
            "requantizing; dequantize first"
        )
    joined = torch.cat(scales, dim)
    keep = all(_group(t, sc, dim) != 0 for t, sc in zip(xs, scales, strict=True))
    return _wrap(first, data, joined, keep)  # a new block layout: granularity unknown


@register_rule(aten.index_put_.default, aten.index_put.default, plain_only=True)
def _index_put(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    x, indices, values = args[0], args[1], args[2]
    if not isinstance(x, ScaledTensor) or not _tensor_wise(x):
        raise ValueError(
            "index_put_: only into a ScaledTensor with a tensor-wise scale (a finer scale "
            "would have to be recomputed for the written rows)"
        )
    _check_unpadded(x, "index_put_")
    if not isinstance(values, ScaledTensor) or values._fmt != x._fmt:
        raise ValueError(
            "index_put_: values must be a ScaledTensor of the same format (quantize them "
            "with this tensor's scale first)"
        )
    if values._scale.numel() != 1 or not torch.equal(
        values._scale.reshape(()), x._scale.reshape(())
    ):
        raise ValueError("index_put_: the values' scale differs from this tensor's scale")
    accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
    if accumulate:
        raise ValueError("index_put_: accumulate=True would add payloads, not values")
    data = x._data if func is aten.index_put_.default else x._data.clone()
    data.index_put_(indices, values._data.to(data.dtype))
    if func is aten.index_put_.default:
        return x
    return _wrap(x, data, x._scale, True)
