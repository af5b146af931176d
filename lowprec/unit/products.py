"""Unit-scaled products (re-exported by :mod:`lowprec.unit.functional`): ``matmul`` and
``probs_matmul`` of two activations, ``linear`` and ``linear_readout`` of an activation and
a weight (with an injectable GEMM, :data:`Matmul`), and ``conv1d``.

Each op reads as :mod:`lowprec.unit.functional` describes: ideal scales, the constraint,
``scale_bwd`` on the inputs, the standard op, ``scale_fwd`` on the output; :func:`linear`
folds its scales into the GEMMs (:mod:`lowprec.unit.folded`) where it can.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.core.autograd import apply_fn
from lowprec.core.casts import quantize_grad, quantize_ste
from lowprec.core.observe import CastOperand, GemmSink, gemm_sink
from lowprec.core.rounding import quantize
from lowprec.unit import moments
from lowprec.unit.core import (
    apply_constraint,
    check_flag,
    check_float,
    check_number,
    check_same_dtype,
    scale_bwd,
    scale_fwd,
)
from lowprec.unit.core import unit_op as _unit_op
from lowprec.unit.folded import ScaledLinear, gemm_kernels_apply

__all__ = ["Matmul", "conv1d", "linear", "linear_readout", "matmul", "probs_matmul"]


def _product(
    f: Callable[[Tensor, Tensor], Tensor], a: Tensor, b: Tensor, s_out: float, s_a: float,
    s_b: float, float8: bool,
) -> Tensor:  # fmt: skip
    """``y = s_out·f(a, b)`` with ``∂a = s_a·(∂f/∂a)ᵀg``, ``∂b = s_b·(∂f/∂b)ᵀg`` (``f``
    bilinear: a matmul). Without ``float8`` every scale is applied to an operand or to the
    incoming gradient, never to a product: ``f(scale_fwd(a, s_out), b)``, ``s_a·g`` into
    ``f``'s backward, and ``b``'s gradient corrected by ``s_b/(s_out·s_a)``. So neither
    pass materialises an unscaled product, ``√K`` times the unit output (``K`` the summed
    dim): in FP16 that would give away ``√K`` of headroom. With ``float8`` the operands are
    rounded to E4M3 and the gradient into the product to E5M2, saturating, with no scales
    (:func:`lowprec.core.casts.quantize_ste`, :func:`~lowprec.core.casts.quantize_grad`),
    and the product, in a wide-range dtype, is scaled as the maths reads. Its three GEMMs
    are observed (:mod:`lowprec.core.observe`) at scale 1 where a sink is active.
    """
    if check_flag("float8", float8):
        a_hp, b_hp = scale_bwd(a, s_a), scale_bwd(b, s_b)
        a, b = quantize_ste(a_hp, "e4m3fn"), quantize_ste(b_hp, "e4m3fn")
        y = quantize_grad(f(a, b), "e5m2")
        sink = gemm_sink()
        if sink is not None:
            _observe_fp8(sink, f is F.linear, a_hp, a, b_hp, b, y)
        return scale_fwd(y, s_out)
    y = f(scale_fwd(a, s_out), scale_bwd(b, s_b / (s_out * s_a)))
    return scale_bwd(y, s_a)


def _observe_fp8(
    sink: GemmSink, linear: bool, a_hp: Tensor, a: Tensor, b_hp: Tensor, b: Tensor, y: Tensor
) -> None:
    """Hand the scale-free FP8 product's GEMMs to ``sink``: the forward now, the two
    backward GEMMs when the gradient reaches ``y`` (rounded to E5M2 as
    :func:`~lowprec.core.casts.quantize_grad` rounds it). A linear (``F.linear(a, b)``,
    ``b`` a weight) is oriented as a float8 linear's GEMMs are; another product ``a @ b``
    as ``dA = G·Bᵀ``, ``dB = Aᵀ·G``."""
    a_hp, a, b_hp, b = a_hp.detach(), a.detach(), b_hp.detach(), b.detach()

    def t(x: Tensor) -> Tensor:
        return x.transpose(-2, -1)

    ra, rb = ("input", "weight") if linear else ("a", "b")
    bm_hp, bm = (t(b_hp), t(b)) if linear else (b_hp, b)  # the forward is a @ B
    sink("forward", CastOperand(ra, a_hp, a, "e4m3fn"), CastOperand(rb, bm_hp, bm, "e4m3fn"))
    if not y.requires_grad:
        return

    def on_grad(g: Tensor) -> None:
        g = g.detach()
        go = CastOperand("grad_output", g, quantize(g, "e5m2", saturate=True), "e5m2")
        sink("input_grad", go, CastOperand(rb, t(bm_hp), t(bm), "e4m3fn"))
        if linear:  # dW = Gᵀ·A
            gt = CastOperand("grad_output", t(go.hp), t(go.cast), "e5m2")
            sink("weight_grad", gt, CastOperand(ra, a_hp, a, "e4m3fn"))
        else:  # dB = Aᵀ·G
            sink("weight_grad", CastOperand(ra, t(a_hp), t(a), "e4m3fn"), go)

    y.register_hook(on_grad)  # type: ignore[no-untyped-call]


@_unit_op
def matmul(
    a: Tensor, b: Tensor, *, constraint: str | None = "to_output_scale", float8: bool = False
) -> Tensor:
    """``a @ b`` for ``a (..., M, K)``, ``b (..., K, N)`` (batch dims broadcast).

    Forward ``y = (a @ b) / √K``; backward ``∂a = (g bᵀ)/√N'``, ``∂b = (aᵀ g)/√M'`` with
    ``N'``, ``M'`` the terms each element of ``∂a``, ``∂b`` sums: ``N`` (``M``) times the
    batch elements an operand is broadcast over (a ``(M, K)`` weight against a batch of
    ``B`` right operands sums ``N·B`` terms, as does one expanded to that batch).
    Activations (no cut edge) have their scales tied to the output's by ``constraint``;
    an operand that is an ``nn.Parameter`` (or a view of one: ``self.w @ x``,
    ``x @ self.w.t()``) is a cut edge and keeps its own ``1/√N'`` or ``1/√M'``, as a linear's
    weight gradient does.
    ``float8``: operands rounded to E4M3, the gradient into the product to E5M2.
    """
    check_float("a", a)
    check_float("b", b)
    check_same_dtype(a=a, b=b)
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"a, b: need >= 2 dims, got shapes {tuple(a.shape)}, {tuple(b.shape)}")
    k, n, m = max(1, b.shape[-2]), max(1, b.shape[-1]), max(1, a.shape[-2])
    batch = 1  # (loops, not generators: Dynamo traces this)
    for size in torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]):  # type: ignore[no-untyped-call]
        batch *= int(size)
    n_eff = n * batch // _distinct(a)
    m_eff = m * batch // _distinct(b)
    weight_a, weight_b = _is_weight(a), _is_weight(b)
    tied = [s for s, w in ((n_eff**-0.5, weight_a), (m_eff**-0.5, weight_b)) if not w]
    s_out, *rest = apply_constraint(constraint, k**-0.5, *tied)
    s_a = n_eff**-0.5 if weight_a else rest.pop(0)
    s_b = m_eff**-0.5 if weight_b else rest.pop(0)
    return _product(torch.matmul, a, b, s_out, s_a, s_b, float8)


def _distinct(t: Tensor) -> int:
    """The batch elements of ``t (..., R, C)`` that are distinct in memory (an expanded,
    stride-0 batch dim holds one)."""
    n = 1
    for size, stride in zip(t.shape[:-2], t.stride()[:-2], strict=True):
        if stride != 0:
            n *= int(size)
    return max(1, n)


def _is_weight(t: Tensor) -> bool:
    """Whether ``t`` is an ``nn.Parameter`` that requires grad, or a view of one."""
    base = t._base if t._base is not None else t
    return bool(t.requires_grad and isinstance(base, torch.nn.Parameter))


@_unit_op
def probs_matmul(p: Tensor, v: Tensor, *, float8: bool = False, mult: float = 1.0) -> Tensor:
    """``p @ v`` for attention probabilities ``p (..., L, S)`` (a softmax output at any
    scale, masked keys exactly 0) and values ``v (..., S, E)``: the explicit form of
    attention (``softmax(m·q kᵀ/√d + mask) @ v``, as HF's eager attention writes it, with
    ``m`` = ``mult``, the softmax's multiplier).

    Forward ``y = c·(p @ v)``, backward ``∂p = c·g vᵀ``, ``∂v = c·pᵀ g``, with
    ``c = 1/√P2`` and ``P2 = mean_i r_i²·P2(m_i)``: ``r_i = Σ_j p_ij`` (1 for
    probabilities, the unit softmax's ``1/√E[p²]`` for its output), ``m_i`` the row's
    nonzero entries (its allowed keys; a dropped entry counts as masked) and ``P2(m) =
    E[Σ_j p_j²]`` over ``m`` logits of variance ``σ² = m²`` (unit ``q, k`` at the standard
    ``1/√d``, times ``m``; :func:`lowprec.unit.moments.softmax_row_table`). That is the
    SDPA rule's ``P2`` (:func:`scaled_dot_product_attention`) with the allowed keys read
    from ``p`` instead of a boolean mask, so explicit and SDPA attention compute the same
    ``y``; for unit, independent ``v``, ``Var y_i = Σ_j p_ij²``. ``c`` is a detached
    scalar tensor (no host sync).
    ``float8``: as :func:`matmul`.
    """
    check_float("p", p)
    check_float("v", v)
    check_same_dtype(p=p, v=v)
    mult = check_number("mult", mult, 0.0, open_low=True)
    if p.dim() < 2 or v.dim() < 2:
        raise ValueError(f"p, v: need >= 2 dims, got shapes {tuple(p.shape)}, {tuple(v.shape)}")
    q = p.detach().float()
    m = (q != 0).sum(-1, dtype=torch.float32)  # exact to 2**24 keys a row
    counts, p2s, _ = moments.softmax_row_table(max(1, p.shape[-1]), mult)
    p2 = (q.sum(-1).square() * moments.row_values(m, counts, p2s)).mean()
    c = p2.clamp(min=torch.finfo(torch.float32).tiny).rsqrt().to(p.dtype)
    # c applied to an operand, not to the product: rows of c·p have Σ_j (c·p_ij)² ≈ 1, so no
    # product larger than the unit output is formed (a unit softmax's p is n times the
    # probabilities); p @ (c·v) is the same product and, where v is the smaller operand
    # (the usual L ≥ E), no attention-map-sized c·p is written and kept for the backward.
    if float8 or p.numel() <= v.numel():
        return _product(torch.matmul, p * c, v, 1.0, 1.0, 1.0, float8)
    return _product(torch.matmul, p, v * c, 1.0, 1.0, 1.0, float8)


Matmul = Callable[[Tensor, Tensor], Tensor]
"""A linear's product ``matmul(x, w) = x wᵀ`` for ``x (..., fan_in)``, ``w (fan_out, fan_in)``
(``F.linear`` without bias), differentiable in both operands."""


def _affine(
    x: Tensor, weight: Tensor, bias: Tensor | None, constraint: str | None, float8: bool,
    fwd_mult: float, matmul: Matmul | None = None,
) -> Tensor:  # fmt: skip
    """:func:`linear`'s maths with a further forward-only factor ``fwd_mult`` on ``x Wᵀ``."""
    check_float("x", x)
    check_float("weight", weight)
    check_float("bias", bias, optional=True)
    check_same_dtype(x=x, weight=weight, bias=bias)
    if weight.dim() != 2:
        raise ValueError(f"weight: need 2 dims (fan_out, fan_in), got shape {tuple(weight.shape)}")
    if matmul is not None and not callable(matmul):
        raise TypeError(f"matmul must be callable or None, got {type(matmul).__name__}")
    if matmul is not None and float8:
        raise ValueError(
            "matmul: float8=True rounds the operands itself; give a matmul (e.g. a float8 "
            "layer's scaled GEMM) or float8=True, not both"
        )
    fan_out, fan_in = max(1, weight.shape[0]), max(1, weight.shape[1])
    batch = max(1, x.numel() // fan_in)
    s_out, s_x = apply_constraint(constraint, fan_in**-0.5, fan_out**-0.5)
    s_w = batch**-0.5
    if matmul is None and not float8 and gemm_kernels_apply(x, weight, bias):
        y = apply_fn(ScaledLinear, x, weight, bias, s_out * fwd_mult, s_x, s_w, s_w)
        return cast(Tensor, y)
    if matmul is None:
        y = _product(F.linear, x, weight, s_out * fwd_mult, s_x, s_w, float8)
    else:  # the injected product runs as given: no torch function mode converts its ops
        with torch._C.DisableTorchFunction():  # (eager: the unit mode is already off here)
            y = _product(matmul, x, weight, s_out * fwd_mult, s_x, s_w, float8)
    return y if bias is None else y + scale_bwd(bias, s_w)


def _linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    constraint: str | None = "to_output_scale",
    float8: bool = False,
    matmul: Matmul | None = None,
) -> Tensor:
    """``x Wᵀ + b`` for ``x (..., fan_in)``, ``W (fan_out, fan_in)``.

    Forward ``y = x Wᵀ/√fan_in + b``; backward ``∂x = (g W)/√fan_out`` (tied to the output
    scale by ``constraint``), ``∂W = (gᵀ x)/√B`` and ``∂b = Σ_B g/√B`` (cut edges, ideal).

    ``matmul``: the product ``x Wᵀ`` to use instead of ``F.linear`` (:data:`Matmul`), e.g.
    a :class:`~lowprec.float8.Float8Linear`'s scaled GEMM (``layer.gemm``), as unit
    scaling's simulated-format transform swaps the matmul of a unit-scaled op. It receives
    the operands the scales are folded into — ``x/√fan_in`` forward, and ``W`` whose
    gradient is rescaled — so its output is the unit output ``x Wᵀ/√fan_in`` and its
    backward sees the unit-scaled gradient. Not with ``float8=True`` (which casts itself).
    """
    return _affine(x, weight, bias, constraint, float8, 1.0, matmul)


linear = _unit_op(_linear)


@_unit_op
def linear_readout(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    constraint: str | None = None,
    float8: bool = False,
    mult: float = 1.0,
    matmul: Matmul | None = None,
) -> Tensor:
    """The output layer (u-μP): ``y = mult·x Wᵀ/fan_in + b`` — :func:`linear` with a
    further forward-only ``mult/√fan_in`` on ``x Wᵀ`` (μP's readout multiplier; ``mult``
    u-μP's ``output_mult``, > 0), so ``std(y) = mult/√fan_in`` at init; the bias is added
    as :func:`linear` adds it, unscaled. Backward as :func:`linear`: ``∂W``, ``∂b`` unit;
    ``∂x = (g W)/√fan_out``, unit, with the default ``constraint=None`` (u-μP's readout,
    as unit-scaling's ``linear_readout``): the gradient the rest of the model receives
    has unit scale whatever ``fan_out``, the vocabulary. ``"to_output_scale"`` ties it to
    the linear's output scale, ``1/√fan_in``: ``√(fan_out/fan_in)`` times that. ``matmul``:
    as :func:`linear`'s (a float8 layer's GEMM,
    :attr:`lowprec.float8.Float8Linear.linear_fn`).
    """
    check_float("weight", weight)
    mult = check_number("mult", mult, 0.0, open_low=True)
    fan_in = max(1, weight.shape[1]) if weight.dim() == 2 else 1
    return _affine(x, weight, bias, constraint, float8, mult * fan_in**-0.5, matmul)


@_unit_op
def conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int = 1,
    padding: int | str = 0, dilation: int = 1, groups: int = 1,
    *, constraint: str | None = "to_output_scale",
) -> Tensor:  # fmt: skip
    """``conv1d`` with ``W (C_out, C_in/groups, k)``: a matmul of fan-in ``C_in/groups·k``.
    Forward ``/√fan_in``; ``∂x`` by ``1/√(C_out·k/(groups·stride))`` (the outputs each input
    feeds), tied by ``constraint``; ``∂W, ∂b`` by ``1/√(B·L_out)`` (cut edges)."""
    check_float("x", x)
    check_float("weight", weight)
    check_float("bias", bias, optional=True)
    if weight.dim() != 3 or x.dim() not in (2, 3):
        raise ValueError(
            f"x, weight: need x (N, C_in, L) or (C_in, L) and weight (C_out, C_in/groups, k), "
            f"got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    check_same_dtype(x=x, weight=weight, bias=bias)
    c_out, c_in_g, ksz = weight.shape
    if c_out == 0 or ksz == 0:
        raise ValueError(f"weight: need C_out >= 1 and k >= 1, got shape {tuple(weight.shape)}")
    fan_in = max(1, c_in_g * ksz)
    fan_out = max(1.0, c_out * ksz / (groups * stride))
    s_out, s_x = apply_constraint(constraint, fan_in**-0.5, fan_out**-0.5)
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ValueError(f"padding must be an int, 'same' or 'valid', got {padding!r}")
        l_out = x.shape[-1] if padding == "same" else x.shape[-1] - dilation * (ksz - 1)
    else:
        l_out = (x.shape[-1] + 2 * padding - dilation * (ksz - 1) - 1) // stride + 1
    w_s = max(1, x.numel() // max(1, x.shape[-1]) // max(1, x.shape[-2]) * l_out) ** -0.5
    x = scale_bwd(x, s_x)
    y = F.conv1d(x, scale_bwd(weight, w_s), None, stride, padding, dilation, groups)
    y = scale_fwd(y, s_out)
    return y if bias is None else y + scale_bwd(bias, w_s).view(1, -1, 1)
