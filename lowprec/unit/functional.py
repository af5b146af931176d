"""Unit-scaled ops: same maths as ``torch.nn.functional`` up to fixed forward factors, with
fixed backward factors, chosen so outputs and gradients are ~unit variance at init.

Each op reads: compute ideal scales → apply the constraint (``lowprec.unit.core``) →
``scale_bwd`` the inputs → the standard op → ``scale_fwd`` the output. "Ideal" scales
assume unit-normal, independent inputs and a unit-normal incoming gradient ``g``; ``B``
below is the number of rows a weight gradient sums over (all leading dims).

Inputs: tensors must be real floating point (``TypeError`` naming the argument for an
integer, bool or complex one; indices are integer), numbers finite (``ValueError``). A
zero-size dimension gives torch's (empty or all-zero) result: each count in a scale is
taken as at least 1, so no scale divides by zero. Activation and softmax constants are
moments under ``X ~ N(0, 1)`` (:mod:`lowprec.unit.moments`).

Where a scale would cost a pass of its own, it is folded (:mod:`lowprec.unit.folded`):
:func:`linear` puts its scales in the GEMMs' ``alpha`` (and the bias in ``beta``),
:func:`softmax` keeps only its scaled output for a backward of its own; the maths is the
composition above.

Attention and dropout live in :mod:`lowprec.unit.attention`, embedding and the losses
(cross-entropy, mean squared error) in :mod:`lowprec.unit.lookup`, ``scale_elementwise``
in :mod:`lowprec.unit.core`; they are re-exported here.

Example:
    >>> import torch
    >>> from lowprec.unit import functional as U
    >>> x, w = torch.randn(4096, 256), torch.randn(512, 256)
    >>> round(U.linear(x, w).std().item(), 1)
    1.0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.core.casts import quantize_grad, quantize_ste
from lowprec.unit import moments
from lowprec.unit.attention import dropout, scaled_dot_product_attention
from lowprec.unit.core import (
    apply_constraint,
    check_dim,
    check_float,
    check_number,
    check_same_dtype,
    scale_bwd,
    scale_elementwise,
    scale_fwd,
)
from lowprec.unit.core import unit_op as _unit_op
from lowprec.unit.folded import ScaledLinear, UnitSoftmax, gemm_kernels_apply
from lowprec.unit.lookup import cross_entropy, embedding, mse_loss
from lowprec.unit.moments import gauss_moment

__all__ = [
    "add", "conv1d", "cross_entropy", "dropout", "embedding", "gauss_moment", "gelu",
    "layer_norm", "linear", "linear_readout", "log_softmax", "matmul", "mse_loss",
    "probs_matmul", "relu", "residual_add", "residual_apply", "residual_split",
    "residual_taus", "rms_norm", "scale_elementwise", "scaled_dot_product_attention",
    "silu", "silu_glu", "softmax",
]  # fmt: skip


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
    and the product, in a wide-range dtype, is scaled as the maths reads.
    """
    if float8:
        a = quantize_ste(scale_bwd(a, s_a), "e4m3fn")
        b = quantize_ste(scale_bwd(b, s_b), "e4m3fn")
        return scale_fwd(quantize_grad(f(a, b), "e5m2"), s_out)
    y = f(scale_fwd(a, s_out), scale_bwd(b, s_b / (s_out * s_a)))
    return scale_bwd(y, s_a)


@_unit_op
def matmul(
    a: Tensor, b: Tensor, *, constraint: str | None = "to_output_scale", float8: bool = False
) -> Tensor:
    """``a @ b`` for ``a (..., M, K)``, ``b (..., K, N)`` (both activations: no cut edge).

    Forward ``y = (a @ b) / √K``; backward ``∂a = (g bᵀ)/√N``, ``∂b = (aᵀ g)/√M'`` with
    ``M'`` the rows ``aᵀ g`` sums over; the three scales are tied by ``constraint``.
    ``float8``: operands rounded to E4M3, the gradient into the product to E5M2.
    """
    check_float("a", a)
    check_float("b", b)
    check_same_dtype(a=a, b=b)
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"a, b: need >= 2 dims, got shapes {tuple(a.shape)}, {tuple(b.shape)}")
    k, n = max(1, b.shape[-2]), max(1, b.shape[-1])
    m = max(1, a.numel() // k // max(1, b.numel() // (k * n)))
    s_out, s_a, s_b = apply_constraint(constraint, k**-0.5, n**-0.5, m**-0.5)
    return _product(torch.matmul, a, b, s_out, s_a, s_b, float8)


@_unit_op
def probs_matmul(p: Tensor, v: Tensor, *, float8: bool = False) -> Tensor:
    """``p @ v`` for attention probabilities ``p (..., L, S)`` (a softmax output at any
    scale, masked keys exactly 0) and values ``v (..., S, E)``: the explicit form of
    attention (``softmax(q kᵀ/√d + mask) @ v``, as HF's eager attention writes it).

    Forward ``y = c·(p @ v)``, backward ``∂p = c·g vᵀ``, ``∂v = c·pᵀ g``, with
    ``c = 1/√P2`` and ``P2 = mean_i r_i²·min(1, e/m_i)``: ``r_i = Σ_j p_ij`` (1 for
    probabilities, ``n/√(e-1)`` for a unit softmax's output) and ``m_i`` the row's nonzero
    entries (its allowed keys; a dropped entry counts as masked). That is the SDPA rule's
    ``P2`` (:func:`scaled_dot_product_attention`) for logits of variance ``σ² = 1`` (unit
    ``q, k`` at the standard ``1/√d``), with the allowed keys read from ``p`` instead of a
    boolean mask, so explicit and SDPA attention compute the same ``y``; for unit,
    independent ``v``, ``Var y_i = Σ_j p_ij² ≈ r_i²·min(1, e/m_i)``. ``c`` is a detached
    scalar tensor (no host sync). ``float8``: as :func:`matmul`.
    """
    check_float("p", p)
    check_float("v", v)
    check_same_dtype(p=p, v=v)
    if p.dim() < 2 or v.dim() < 2:
        raise ValueError(f"p, v: need >= 2 dims, got shapes {tuple(p.shape)}, {tuple(v.shape)}")
    q = p.detach().float()
    m = (q != 0).sum(-1, dtype=torch.float32).clamp(min=1)  # exact to 2**24 keys a row
    p2 = (q.sum(-1).square() * (math.e / m).clamp(max=1.0)).mean()
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
        return cast(Tensor, ScaledLinear.apply(x, weight, bias, s_out * fwd_mult, s_x, s_w, s_w))  # type: ignore[no-untyped-call]
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
    constraint: str | None = "to_output_scale",
    float8: bool = False,
) -> Tensor:
    """The output layer (u-μP): ``y = x Wᵀ/fan_in + b`` — :func:`linear` with a further
    forward-only ``1/√fan_in`` (μP's readout multiplier), so ``std(y) = 1/√fan_in`` at init;
    backward as :func:`linear` (``∂x`` at the linear's output scale, ``∂W`` unit).
    """
    check_float("weight", weight)
    fan_in = max(1, weight.shape[1]) if weight.dim() == 2 else 1
    return _affine(x, weight, bias, constraint, float8, fan_in**-0.5)


def _broadcast_sizes(*ts: Tensor) -> tuple[int, ...]:
    """For each tensor, how many output elements each of its elements feeds by
    broadcasting (the product of the dims broadcasting adds or expands)."""
    n = torch.broadcast_shapes(*(t.shape for t in ts)).numel()  # type: ignore[no-untyped-call]
    return tuple(max(1, n // max(1, t.numel())) for t in ts)


@_unit_op
def add(
    a: Tensor | float,
    b: Tensor | float,
    weights: tuple[float, float] = (1.0, 1.0),
    *,
    constraint: str | None = None,
) -> Tensor:
    """Weighted sum of two independent unit tensors (inputs are cut edges).

    Forward ``y = (w_a a + w_b b)/√(w_a² + w_b²)`` (unit variance). Where one operand is a
    single value (``numel() == 1``, a Python number included) it shifts the other instead
    of adding variance: ``y = (w_a a + w_b b)/|w_t|``, ``t`` the other operand (two
    Python numbers: their plain weighted sum). Backward ``∂a = g/√B_a``, ``∂b = g/√B_b``,
    ``B`` the number of output elements each element of the operand feeds by broadcasting
    (1 without broadcasting): a broadcast operand's gradient sums ``B`` unit gradients.
    ``constraint`` ties the output scale and the two gradient scales (``None``: each
    ideal, as above; a tensor operand's gradient is then unit).
    """
    if not isinstance(weights, (tuple, list)) or len(weights) != 2:
        raise TypeError(f"weights must be a pair of numbers, got {weights!r}")
    wa, wb = (check_number("weights", w) for w in weights)
    if isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, Tensor):
        a = check_number("a", a)
        check_float("b", b)
        if wb == 0.0:
            raise ValueError(f"weights: the tensor operand's weight is 0, got {weights!r}")
        return scale_fwd(b, wb / abs(wb)) + wa * a / abs(wb)
    if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, Tensor):
        return add(b, a, (wb, wa), constraint=constraint)
    check_float("a", a)
    check_float("b", b)
    assert isinstance(a, Tensor) and isinstance(b, Tensor)
    scalar = [t.numel() == 1 for t in (a, b)]
    if scalar[0] != scalar[1]:
        norm = abs(wb if scalar[0] else wa)
    else:
        norm = math.hypot(wa, wb)
    if norm == 0.0:
        raise ValueError(f"weights: need a non-zero weight on a tensor operand, got {weights!r}")
    ba, bb = _broadcast_sizes(a, b)
    s_out, s_a, s_b = apply_constraint(constraint, 1.0, ba**-0.5, bb**-0.5)
    a, b = scale_bwd(a, s_a), scale_bwd(b, s_b)
    return scale_fwd(scale_fwd(a, wa / norm) + scale_fwd(b, wb / norm), s_out)


@_unit_op
def residual_split(x: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    """Split the residual stream into ``(residual, skip)`` for a branch weighted by ``τ``.

    Forward: both are ``x``. Backward: ``∂x = √τ·∂residual + √(1-τ)·∂skip``, unit when
    both incoming gradients are unit and independent. Pair with :func:`residual_add`.
    """
    check_float("x", x)
    tau = _check_tau(tau)
    return scale_bwd(x, tau**0.5), scale_bwd(x, (1.0 - tau) ** 0.5)


@_unit_op
def residual_add(residual: Tensor, skip: Tensor, tau: float) -> Tensor:
    """Forward ``y = √τ·residual + √(1-τ)·skip`` (unit if both are); backward passes
    ``g`` unscaled to both (the weights are applied in :func:`residual_split`'s backward)."""
    check_float("residual", residual)
    check_float("skip", skip)
    tau = _check_tau(tau)
    return scale_fwd(residual, tau**0.5) + scale_fwd(skip, (1.0 - tau) ** 0.5)


def _check_tau(tau: object) -> float:
    t = check_number("tau", tau)
    if not 0.0 < t < 1.0:
        raise ValueError(f"tau must be in (0, 1), got {tau!r}")
    return t


def residual_apply(fn: Callable[[Tensor], Tensor], x: Tensor, tau: float) -> Tensor:
    """``residual_add(fn(residual), skip, τ)`` of ``residual, skip = residual_split(x, τ)``:
    a residual branch ``fn`` in one call (unit-scaling's ``residual_apply``; its ``tau``
    is the ratio ``t`` of the branch's scale to the skip's, and ``τ = t²/(1 + t²)`` here)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    residual, skip = residual_split(x, tau)
    return residual_add(fn(residual), skip, tau)


def residual_taus(
    n: int, scheme: str = "running-mean", tau: float = 0.5, weight: float | None = None
) -> list[float]:
    """``τ_l`` of ``n`` residual branches, in order.

    * ``"fixed"``: ``τ_l = tau`` (every branch the same share of the stream it joins);
    * ``"running-mean"``: ``τ_l = 1/(l+2)``: the stream after branch ``l`` is the mean of
      the embedding and branches ``0..l``, all with the same weight ``1/(n+1)`` at the end;
    * ``"weighted"``: embedding weight 1, each branch ``weight`` (default ``1/n``):
      ``τ_l = w/(1 + (l+1)w)`` (u-μP's depth rule, :func:`lowprec.unit.umup.umup_taus`).

    ``tau`` must lie in (0, 1) and ``weight`` be finite and > 0 (``ValueError``; NaN too).

    Example:
        >>> residual_taus(3)
        [0.5, 0.3333333333333333, 0.25]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if scheme == "fixed":
        return [_check_tau(tau)] * n
    if scheme == "running-mean":
        return [1.0 / (i + 2) for i in range(n)]
    if scheme == "weighted":
        w = (
            1.0 / max(n, 1)
            if weight is None
            else check_number("weight", weight, 0.0, open_low=True)
        )
        return [w / (1.0 + (i + 1) * w) for i in range(n)]
    raise ValueError(f"scheme must be one of ['fixed', 'running-mean', 'weighted'], got {scheme!r}")


def _pointwise(
    x: Tensor, f: Callable[[Tensor], Tensor], gains: tuple[float, float], constraint: str | None
) -> Tensor:
    check_float("x", x)
    s_out, s_in = apply_constraint(constraint, gains[0] ** -0.5, gains[1] ** -0.5)
    return scale_fwd(f(scale_bwd(x, s_in)), s_out)


@_unit_op
def gelu(x: Tensor, approximate: str = "none", *, mult: float = 1.0,
         constraint: str | None = "gmean") -> Tensor:  # fmt: skip
    """Forward ``y = gelu(m·x)/σ_f(m)``, ``σ_f(m)² = Var gelu(mX)`` (≈ 0.3456 at ``m = 1``);
    backward ``∂x = m·gelu'(m·x)·g/σ_b(m)``, ``σ_b(m)² = E[(m·gelu'(mX))²]`` (≈ 0.4559 at
    ``m = 1``), ``m`` = ``mult``; tied by ``constraint`` (input and output are not cut
    edges). The gains are exact moments at every ``mult`` (Gauss–Hermite), so u-μP's
    tuned ``act_mult`` keeps the op unit."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    mult = check_number("mult", mult)
    if mult == 0.0:
        raise ValueError("mult must be non-zero, got 0.0")
    gains = moments.activation_gains("gelu", mult)
    return _pointwise(x, lambda t: F.gelu(t * mult, approximate=approximate), gains, constraint)


@_unit_op
def silu(
    x: Tensor, *, mult: float = 1.0, constraint: str | None = "gmean", inplace: bool = False
) -> Tensor:
    """Forward ``y = silu(m·x)/σ_f(m)`` (``σ_f(m)² = Var silu(mX)``, ≈ 0.3131 at 1);
    backward ``∂x = m·silu'(m·x)·g/σ_b(m)`` (``σ_b(m)² = E[(m·silu'(mX))²]``, ≈ 0.3795 at
    1), exact at every ``mult``; tied by ``constraint``. ``inplace=True``: ``ValueError``."""
    if inplace:
        raise ValueError("inplace=True is not supported by the unit-scaled silu")
    mult = check_number("mult", mult)
    if mult == 0.0:
        raise ValueError("mult must be non-zero, got 0.0")
    return _pointwise(
        x, lambda t: F.silu(t * mult), moments.activation_gains("silu", mult), constraint
    )


@_unit_op
def relu(x: Tensor, *, constraint: str | None = "gmean") -> Tensor:
    """Forward ``y = relu(x)/σ_f`` (``σ_f² = ½ - 1/(2π)``); backward ``∂x = 1[x>0]·g·√2``
    (``E[1[X>0]] = ½``); tied by ``constraint``."""
    return _pointwise(x, F.relu, moments.RELU_GAINS, constraint)


@_unit_op
def silu_glu(
    x: Tensor, gate: Tensor, *, mult: float = 1.0, constraint: str | None = "gmean"
) -> Tensor:
    """SwiGLU's product ``y = x·silu(m·gate)/√E[silu(mG)²]`` (``≈ 0.3558`` at ``m = 1``);
    backward ``∂x = silu(m·gate)·g/√E[silu(mG)²]``,
    ``∂gate = x·m·silu'(m·gate)·g/√E[(m·silu'(mG))²]``, ``m`` = ``mult``; the three
    scales are tied by ``constraint``."""
    check_float("x", x)
    check_float("gate", gate)
    mult = check_number("mult", mult)
    if mult == 0.0:
        raise ValueError("mult must be non-zero, got 0.0")
    m2 = moments.silu_second_moment(mult)
    s_out, s_x, s_g = apply_constraint(
        constraint, m2**-0.5, m2**-0.5, moments.activation_gains("silu", mult)[1] ** -0.5
    )
    act = F.silu(scale_bwd(gate, s_g) * mult)
    return scale_fwd(scale_bwd(x, s_x) * act, s_out)


@_unit_op
def softmax(x: Tensor, dim: int = -1, *, mult: float = 1.0,
            constraint: str | None = "to_output_scale") -> Tensor:  # fmt: skip
    """Forward ``y = softmax(m·x)/√E[p²]`` along ``dim`` of size ``n``: the output has unit
    *root mean square* (not unit centred std: a softmax output's mean ``1/n`` is part of
    what its consumer, ``p @ v``, multiplies, and at small ``m`` the rows are nearly flat,
    where a centred normalisation would blow the rms up); backward
    ``∂x = m·p⊙(g - Σp g)/√E[(∂x)²]`` (the rms of that gradient for a unit ``g``), with
    ``E[·]`` over unit-normal logits at this ``n`` and ``m`` = ``mult``
    (``E[n²p²] ≈ e^{m²}`` for flat rows, ``n`` for one-hot ones); tied by ``constraint``
    (by default the output scale, so ``∂x`` is unit up to that tie)."""
    check_float("x", x)
    d = check_dim("dim", x, dim)
    mult = check_number("mult", mult)
    n = max(1, x.shape[d]) if x.dim() else 1
    p2, dx2 = moments.softmax_gains(n, mult)
    s_out, s_in = apply_constraint(constraint, p2**-0.5, dx2**-0.5)
    return cast(Tensor, UnitSoftmax.apply(x, d, mult, s_out, s_in))  # type: ignore[no-untyped-call]


@_unit_op
def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``y = x - logsumexp(x)`` is already unit: a shift of ``x`` (``Var y = Var x``), and
    ``∂x = g - p·Σg ≈ g``. Scales 1; here for completeness and the transform."""
    check_float("x", x)
    check_dim("dim", x, dim)
    return torch.log_softmax(x, dim=dim)


@_unit_op
def layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """LayerNorm is unit in both passes (``y = (x-μ)/σ`` and ``∂x ≈ g/σ``): scales 1.
    The affine's gradients are cut edges summing over ``B`` rows: ``∂w, ∂b`` scaled by
    ``1/√B``."""
    check_float("x", x)
    check_float("weight", weight, optional=True)
    check_float("bias", bias, optional=True)
    eps = check_number("eps", eps, 0.0)
    batch = max(1, x.numel() // max(1, math.prod(normalized_shape)))
    w = None if weight is None else scale_bwd(weight, batch**-0.5)
    b = None if bias is None else scale_bwd(bias, batch**-0.5)
    return F.layer_norm(x, tuple(normalized_shape), w, b, eps)


@_unit_op
def rms_norm(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:  # fmt: skip
    """RMSNorm ``y = x/rms(x)·w``: unit both ways (as :func:`layer_norm`); ``∂w`` by ``1/√B``."""
    check_float("x", x)
    check_float("weight", weight, optional=True)
    if eps is not None:
        eps = check_number("eps", eps, 0.0)
    batch = max(1, x.numel() // max(1, math.prod(normalized_shape)))
    w = None if weight is None else scale_bwd(weight, batch**-0.5)
    return F.rms_norm(x, tuple(normalized_shape), w, eps)


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
