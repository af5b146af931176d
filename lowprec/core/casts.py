"""Straight-through casts: round one pass of autograd to a format, leave the other exact.

Training in a narrow format without scales (e.g. unit scaling's FP8 setting) needs two
casts, each differentiable in the *straight-through* sense:

* :func:`quantize_ste`: forward ``y = Q(x)`` (``x`` rounded to ``fmt``); backward
  ``∂L/∂x = ∂L/∂y`` — the rounding is treated as the identity (straight-through estimator).
* :func:`quantize_grad`: forward ``y = x`` (identity); backward ``∂L/∂x = Q(∂L/∂y)`` — the
  gradient flowing into ``x``'s producer is rounded to ``fmt``.

``Q`` is :func:`lowprec.core.rounding.quantize` with round-to-nearest-even, in the input's
dtype. ``saturate=True`` (the default) clamps finite values beyond ``±fmt.max`` to
``±fmt.max`` instead of letting them become Inf/NaN, as a scale-free cast must.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from lowprec.core.autograd import apply_fn
from lowprec.core.formats import Format, get_format
from lowprec.core.rounding import quantize

__all__ = ["quantize_grad", "quantize_ste"]


class _QuantizeSte(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fmt: Format, saturate: bool) -> Tensor:
        return quantize(x, fmt, saturate=saturate)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return g, None, None


class _QuantizeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fmt: Format, saturate: bool) -> Tensor:
        ctx.fmt, ctx.saturate = fmt, saturate
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        return quantize(g, ctx.fmt, saturate=ctx.saturate), None, None


def _check(x: object, fmt: str | Format, saturate: object) -> Format:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be a bool, got {type(saturate).__name__}")
    return get_format(fmt, arg="fmt")


def quantize_ste(x: Tensor, fmt: str | Format = "e4m3fn", saturate: bool = True) -> Tensor:
    """Forward: ``x`` rounded to ``fmt`` (no scale); backward: the gradient passes unchanged.

    Example:
        >>> import torch
        >>> x = torch.tensor([1.0625, 500.0], requires_grad=True)
        >>> y = quantize_ste(x, "e4m3fn"); (y * torch.tensor([2.0, 3.0])).sum().backward()
        >>> y.tolist(), x.grad.tolist()
        ([1.0, 448.0], [2.0, 3.0])
    """
    f = _check(x, fmt, saturate)
    return cast(Tensor, apply_fn(_QuantizeSte, x, f, saturate))


def quantize_grad(x: Tensor, fmt: str | Format = "e5m2", saturate: bool = True) -> Tensor:
    """Forward: identity; backward: the gradient flowing into ``x`` is rounded to ``fmt``.

    Example:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = quantize_grad(x, "e5m2"); (y * torch.tensor([1.1, 1e6])).sum().backward()
        >>> y.tolist(), x.grad.tolist()
        ([1.0, 1.0], [1.0, 57344.0])
    """
    f = _check(x, fmt, saturate)
    return cast(Tensor, apply_fn(_QuantizeGrad, x, f, saturate))
