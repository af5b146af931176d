"""Unit-scaled activations, softmaxes and norms (re-exported by
:mod:`lowprec.unit.functional`): ``gelu``, ``silu``, ``relu``, SwiGLU's ``silu_glu``,
``softmax``, ``log_softmax``, ``layer_norm`` and ``rms_norm``.

The activations' and the softmax's scales are moments under ``X ~ N(0, 1)``
(:mod:`lowprec.unit.moments`); the softmax keeps only its scaled output for a backward of
its own (:class:`lowprec.unit.folded.UnitSoftmax`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.core.autograd import apply_fn
from lowprec.unit import moments
from lowprec.unit.core import (
    apply_constraint,
    check_dim,
    check_float,
    check_number,
    scale_bwd,
    scale_fwd,
)
from lowprec.unit.core import unit_op as _unit_op
from lowprec.unit.folded import UnitSoftmax

__all__ = [
    "gelu", "layer_norm", "log_softmax", "relu", "rms_norm", "silu", "silu_glu", "softmax",
]  # fmt: skip


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
    if mult == 0.0:
        raise ValueError(
            "mult must be non-zero (a zero multiplier flattens every row: no gradient)"
        )
    n = max(1, x.shape[d]) if x.dim() else 1
    p2, dx2 = moments.softmax_gains(n, mult)
    s_out, s_in = apply_constraint(constraint, p2**-0.5, dx2**-0.5)
    return cast(Tensor, apply_fn(UnitSoftmax, x, d, mult, s_out, s_in))


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
