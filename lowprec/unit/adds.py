"""Unit-scaled sums (re-exported by :mod:`lowprec.unit.functional`): the weighted ``add``
of two independent tensors, the residual stream's ``residual_split``/``residual_add`` (and
``residual_apply``, both in one call) and ``residual_taus``, the τ of each residual branch
under a scheme (``"fixed"``, ``"running-mean"``, ``"weighted"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lowprec.unit.core import apply_constraint, check_float, check_number, scale_bwd, scale_fwd
from lowprec.unit.core import unit_op as _unit_op

__all__ = ["add", "residual_add", "residual_apply", "residual_split", "residual_taus"]


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

    ``tau`` must lie in (0, 1) and ``weight`` be finite and > 0 (``ValueError``; NaN too);
    ``tau`` goes only with ``"fixed"`` and ``weight`` only with ``"weighted"`` (another
    value with another scheme is a ``ValueError``, not ignored).

    Example:
        >>> residual_taus(3)
        [0.5, 0.3333333333333333, 0.25]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if scheme != "fixed" and tau != 0.5:
        raise ValueError(f"tau={tau!r} applies only to scheme='fixed' (got {scheme!r})")
    if scheme != "weighted" and weight is not None:
        raise ValueError(f"weight={weight!r} applies only to scheme='weighted' (got {scheme!r})")
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
