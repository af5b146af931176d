"""The fallback for ops without a rule, and in-place ops.

An op on scalify ``ScaledTensor``s without a rule runs on the dequantized values
``d·s`` (float32) and its floating outputs are wrapped at scale 1 (a power of two when
their max leaves [2^-4, 2^4], :func:`~lowprec.scalify.core.guard`): correct values, but
the output's scale no longer follows its inputs' scales (counted by
:func:`~lowprec.scalify.coverage`, warned once per op). An in-place op ``x.op_(...)`` runs
its out-of-place twin's rule and puts the result into ``x``
(:func:`~lowprec.scalify.core.assign`: into ``x``'s storage when ``x`` is a view).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from lowprec.core.tensor import ScaledTensor
from lowprec.scalify.config import count_fallback
from lowprec.scalify.core import assign, deq, first_st, guard, one, work_dtype, wrap
from lowprec.scalify.domains import fallback, out_domain, rule

aten = torch.ops.aten
__all__: list[str] = []


def _fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Any other op: ``dequantize -> op -> wrap at scale 1`` (counted, warned once)."""
    schema = func._schema
    if (
        schema.arguments
        and schema.arguments[0].alias_info is not None
        and (schema.arguments[0].alias_info.is_write)
        and isinstance(args[0], ScaledTensor)
    ):
        return _inplace(func, args, kwargs)
    count_fallback(str(func))
    ref = first_st(tuple(args) + tuple(kwargs.values()))
    work = work_dtype(ref)
    dom = out_domain(args)
    plain = tree_map(lambda t: deq(t, work) if isinstance(t, ScaledTensor) else t, (args, kwargs))
    res = func(*plain[0], **plain[1])

    def back(t: Any) -> Any:
        if isinstance(t, Tensor) and t.is_floating_point():
            return wrap(*guard(t.to(work), one(t)), ref, dom, func)
        return t

    return tree_map(back, res)


def _inplace(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.op_(...)``: the out-of-place op's rule, its data and scale put into ``x``."""
    name = func._schema.name.split("::")[1].rstrip("_")
    functional = getattr(getattr(aten, name, None), func._overloadname, None)
    if functional is None and torch.Tag.inplace_view in func.tags:
        functional = getattr(aten, name, None)  # (transpose_.default: transpose.int)
    x = args[0]
    if not isinstance(x, ScaledTensor):
        # A plain tensor updated with a ScaledTensor operand (``out = zeros_like(x);
        # out += y``): it stays plain and takes the values d·s of the op's result.
        if functional is None:
            plain = tree_map(lambda t: deq(t, x.dtype) if isinstance(t, ScaledTensor) else t, args)
            return func(*plain, **kwargs)
        res = functional(*args, **kwargs)
        x.copy_(deq(res, x.dtype) if isinstance(res, ScaledTensor) else res)
        return x
    if functional is None:  # no out-of-place twin: run it on a dequantized copy
        count_fallback(str(func))
        v = deq(x, work_dtype(x)).clone()
        func(v, *args[1:], **kwargs)
        return assign(x, v.to(x.qdata.dtype), one(v), func)
    res = functional(*args, **kwargs)
    if torch.Tag.inplace_view in func.tags and isinstance(res, ScaledTensor):
        # squeeze_, unsqueeze_, transpose_, t_, as_strided_ (matmul's 1-D case ends in
        # squeeze_): x becomes the view, its outer shape included (as torch's
        # return_and_correct_aliasing sets a wrapper's metadata, with no dispatch).
        x._data, x._scale = res.qdata, res.scale
        with torch.utils._mode_utils.no_dispatch():
            meta = torch._C._meta_in_tls_dispatch_include()
            torch._C._set_meta_in_tls_dispatch_include(True)
            try:
                func(*args, **kwargs)
            finally:
                torch._C._set_meta_in_tls_dispatch_include(meta)
        return x
    if isinstance(res, ScaledTensor):
        return assign(x, res.qdata, res.scale, func)
    return assign(x, res.to(x.qdata.dtype), one(res), func)


fallback(_fallback)

_INPLACE = [aten.add_.Tensor, aten.add_.Scalar, aten.mul_.Tensor, aten.mul_.Scalar,
            aten.div_.Tensor, aten.div_.Scalar, aten.sub_.Tensor]  # fmt: skip
rule(*_INPLACE)(_inplace)
