"""Unit ops' scales folded into the computation, as autograd Functions (the maths of
:mod:`lowprec.unit.functional`'s ``scale_fwd``/``scale_bwd`` compositions, without a pass
of their own): a linear with its scales in the GEMMs' ``alpha`` and its bias in ``beta``
(:class:`ScaledLinear`), a softmax that keeps only its scaled output for its backward
(:class:`UnitSoftmax`). Tested against the compositions in
``tests/unit/test_functional.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lowprec.core.modes import is_plain

__all__ = ["ScaledLinear", "UnitSoftmax", "gemm_kernels_apply"]


def _mm(a: Tensor, b: Tensor, alpha: float, bias: Tensor | None = None) -> Tensor:
    """``alpha·(a @ b) [+ bias]`` for 2-D ``a, b``: the GEMM's own ``alpha`` and ``beta``
    (``beta = 0`` without a bias: the added input is never read), so neither the scaling nor
    the bias costs a pass of its own and the unscaled product is never stored (the
    accumulator is scaled before the store)."""
    if bias is None:
        return torch.addmm(a.new_zeros(()), a, b, beta=0, alpha=alpha)
    return torch.addmm(bias, a, b, alpha=alpha)


def gemm_kernels_apply(*ts: Tensor | None) -> bool:
    """Whether :class:`ScaledLinear` may compute a unit linear: plain tensors, and no torch
    function mode active that may handle ``F.linear`` itself (the unit + float8 recipes'
    float8 product, a user's mode); otherwise the primitives call ``F.linear``."""
    if torch._C._len_torch_function_stack() > 0:
        return False
    # subclasses (DTensor, scaled or float8 wrappers) go through the primitives and the
    # subclass's own ``F.linear`` rule
    return all(is_plain(t) for t in ts if t is not None)


def _rows(x: Tensor) -> Tensor:
    """``x (..., K)`` as ``(rows, K)`` (explicit sizes: ``K`` may be 0)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


class ScaledLinear(torch.autograd.Function):
    """``y = s_out·x Wᵀ + b``, ``∂x = s_x·g W``, ``∂W = s_w·gᵀ x``, ``∂b = s_b·Σ g``: every
    scale in a GEMM's ``alpha``, the bias in its ``beta`` term. The same maths as
    ``F.linear(scale_fwd(x, s_out), scale_bwd(W, s_w / (s_out·s_x)))``, then
    ``scale_bwd(·, s_x) + scale_bwd(b, s_b)``, without a pass over (or a saved copy of) the
    scaled activation, and with no unscaled product materialised."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, w: Tensor, b: Tensor | None, s_out: float, s_x: float, s_w: float,
        s_b: float,
    ) -> Tensor:  # fmt: skip
        ctx.save_for_backward(x, w)
        ctx.scales = (s_x, s_w, s_b)
        return _mm(_rows(x), w.t(), s_out, b).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        s_x, s_w, s_b = ctx.scales
        g2 = _rows(g)
        need = ctx.needs_input_grad
        gx = _mm(g2, w, s_x).view(x.shape) if need[0] else None
        gw = _mm(g2.t(), _rows(x), s_w) if need[1] else None
        gb = g2.sum(0) * s_b if need[2] else None
        return gx, gw, gb, None, None, None, None


class UnitSoftmax(torch.autograd.Function):
    """``y = s_out·softmax(mult·x)``; ``∂x = s_in·mult·p⊙(g - Σ p g)`` with ``p = y/s_out``
    (``g`` enters unscaled, as through ``scale_fwd``). Only ``y`` is kept for the backward:
    the probabilities ``p`` are never stored beside it (one tensor of the attention map's
    size a layer, as in the standard model)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, mult: float, s_out: float, s_in: float) -> Tensor:
        y = torch.softmax(x if mult == 1.0 else x * mult, dim=dim) * s_out
        ctx.save_for_backward(y)
        ctx.args = (dim, mult, s_out, s_in)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        (y,) = ctx.saved_tensors
        dim, mult, s_out, s_in = ctx.args
        gx = torch._softmax_backward_data(g, y * (1.0 / s_out), dim, y.dtype)
        return gx * (s_in * mult), None, None, None, None
