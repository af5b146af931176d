"""Entering, leaving and rebalancing scaled arithmetic.

* :func:`as_scaled` / :func:`scaled`: plain tensor -> scalify ``ScaledTensor``.
* :func:`unscale`: ``ScaledTensor`` -> plain ``d·s`` (its gradient re-enters as a scaled
  gradient).
* :func:`rebalance` and :func:`dynamic_rescale` (``max``, ``l1``, ``l2``): same value,
  new scale; place them in a model by hand where a tensor's range drifts.

All are differentiable: the gradient of a rebalance is the incoming gradient (the value is
unchanged), optionally rebalanced too (``grad=True``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from lowprec.core.autograd import apply_fn
from lowprec.core.scales import Pow2Mode, round_pow2
from lowprec.core.tensor import ScaledTensor
from lowprec.scalify.config import ScalifyConfig
from lowprec.scalify.core import compiling, stat, work_dtype
from lowprec.scalify.domains import FWD, GRAD, config_of, domain, lookup, record, tag

__all__ = ["as_scaled", "dynamic_rescale", "rebalance", "scaled", "unscale"]

Stat = Literal["max", "l1", "l2"]


def _check_scale(s: Tensor, what: str) -> None:
    if not compiling() and not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError(
            f"{what} must be finite and > 0 everywhere, got {s.flatten()[:4].tolist()}"
        )


def _entry_scale(x: Tensor, cfg: ScalifyConfig) -> Tensor:
    """Scale of a tensor entering scaled arithmetic: ``max |x|`` rounded per ``pow2``; the
    special scale 0 for an all-zero tensor (a known zero: rules short-circuit it);
    ``ValueError`` if x holds NaN/Inf (the scale would be non-finite)."""
    a = stat(x, "max").float()
    _check_scale(torch.where(a == 0, 1.0, a), "the entry scale (max |x|) of an input")
    return torch.where(a > 0, round_pow2(a, cfg.pow2), 0.0)


def _to_st(x: Tensor, s: Tensor, dom: str, cfg: ScalifyConfig) -> ScaledTensor:
    work = work_dtype(x)
    d = (x.detach().to(work) / torch.where(s > 0, s, 1.0).to(work)).to(cfg.storage_dtype)
    fmt = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(cfg.storage_dtype, "fp32")
    return ScaledTensor._wrap(d, s, x.dtype, fmt, dom)


class _ToScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: Tensor | None, key: str) -> ScaledTensor:
        cfg = lookup(key)
        s = _entry_scale(x, cfg) if scale is None else scale.float()
        ctx.dtype = x.dtype
        return _to_st(x, s, domain(FWD, key), cfg)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        if isinstance(g, ScaledTensor):
            g = g.dequantize(ctx.dtype)
        return g.to(ctx.dtype), None, None


class _ToPlain(torch.autograd.Function):
    """``d·s``; the gradient enters scaled arithmetic with the config ``x`` was made under
    (recorded in its domain), so a region's backward runs under its forward's config."""

    @staticmethod
    def forward(ctx: Any, x: ScaledTensor) -> Tensor:
        ctx.key = tag((x,))
        return x.dequantize()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> ScaledTensor:
        if isinstance(g, ScaledTensor):
            return g
        cfg = lookup(ctx.key)
        return _to_st(g, _entry_scale(g, cfg), domain(GRAD, ctx.key), cfg)


def as_scaled(
    x: Tensor, scale: Tensor | float | None = None, *, config: ScalifyConfig | None = None
) -> ScaledTensor:
    """``x`` as a scalify ``ScaledTensor`` (data in the config's format).

    ``scale`` defaults to ``max |x|`` (power-of-two rounded per the config), so the data
    lies in [-1, 1]. A given ``scale`` must be finite and > 0 (``ValueError``) and
    large enough that the finite values of ``x / scale`` fit the storage format
    (``ValueError`` naming ``scale`` when one would overflow to ±inf; a scale so large
    that values fall below the format's range flushes them to 0, as any rounding does).
    NaN/±inf entries of ``x`` stay NaN/±inf. Differentiable: ``x``'s gradient is the plain
    ``d_g·s_g``. With
    ``config``, the result records it: every op on it and on what is computed from it, in
    forward and backward, runs under ``config`` (see :mod:`lowprec.scalify.domains`);
    without, ops use the calling thread's active config.

    Example:
        >>> import torch
        >>> t = as_scaled(torch.tensor([1e-30, -4e-30]))
        >>> t.qdata.tolist(), [f"{v:.4g}" for v in unscale(t * 3.0).tolist()]
        ([0.25, -1.0], ['3e-30', '-1.2e-29'])
    """
    if not isinstance(x, Tensor) or isinstance(x, ScaledTensor):
        raise TypeError(f"x must be a plain torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    s = None
    if scale is not None:
        s = scale if isinstance(scale, Tensor) else torch.tensor(float(scale))
        _check_scale(s.float(), "scale")
        s = s.to(x.device)
    if config is not None and not isinstance(config, ScalifyConfig):
        raise TypeError(f"config must be a ScalifyConfig or None, got {type(config).__name__}")
    key = "" if config is None else record(config)
    out: ScaledTensor = apply_fn(_ToScaled, x, s, key)
    if s is not None and not compiling() and x.numel():
        fin = torch.isfinite(x)
        if not bool(torch.isfinite(out.qdata)[fin].all()):
            big = float((x.detach().abs() * fin).amax())
            raise ValueError(
                f"scale: {s.flatten()[:4].tolist()} is too small for x (max |x| = {big:.4g}): "
                f"x/scale overflows the storage format {out.qdata.dtype}; use a scale of at "
                "least max |x| / the format's max, or the default (max |x|)"
            )
    return out


def enter(x: Tensor, key: str) -> ScaledTensor:
    """``as_scaled(x)`` recording the config of ``key`` (from :func:`record`); no checks."""
    out: ScaledTensor = apply_fn(_ToScaled, x, None, key)
    return out


def scaled(data: Tensor, scale: Tensor | float, dtype: torch.dtype = torch.float32) -> ScaledTensor:
    """The scalify ``ScaledTensor`` ``data × scale`` with ``data`` stored as given (no
    rounding) and logical ``dtype`` (what it dequantizes to); ``ValueError`` names a NaN,
    Inf or non-positive ``scale``.

    Example:
        >>> import torch
        >>> scaled(torch.ones(2, dtype=torch.float16), 2.0**-40).dequantize().tolist()
        [9.094947017729282e-13, 9.094947017729282e-13]
    """
    return ScaledTensor(data, scale, dtype, domain=FWD)


def unscale(x: Tensor) -> Tensor:
    """The plain value ``d·s`` (a plain tensor is returned as is); its gradient enters
    scaled arithmetic again with scale ``max |g|``."""
    if not isinstance(x, ScaledTensor):
        return x
    out: Tensor = apply_fn(_ToPlain, x)
    return out


class _Rebalance(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: ScaledTensor, s: Tensor, grad_stat: str | None) -> ScaledTensor:
        ctx.grad_stat = grad_stat
        return _set_scale(x, s)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        if ctx.grad_stat is not None and isinstance(g, ScaledTensor):
            g = _set_scale(g, _new_scale(g, ctx.grad_stat, None))
        return g, None, None


def _set_scale(x: ScaledTensor, s: Tensor) -> ScaledTensor:
    work = work_dtype(x)
    # s = 0 only for a known zero (scale 0) kept as it is: its data stays (never 0/0).
    r = torch.where(s > 0, x.scale / torch.where(s > 0, s, 1.0), 1.0).to(work)
    d = (x.qdata.to(work) * r).to(x.qdata.dtype)
    return ScaledTensor._wrap(d, s, x.dtype, x._fmt, x.domain)


def _new_scale(x: ScaledTensor, how: str, pow2_mode: Pow2Mode | None) -> Tensor:
    if how not in ("max", "l1", "l2"):
        raise ValueError(f"how must be 'max', 'l1' or 'l2', got {how!r}")
    r = stat(x.qdata.float(), how)
    if not compiling() and not bool(torch.isfinite(r)):
        raise ValueError(f"dynamic_rescale: the {how} statistic of x's data is {float(r)}")
    mode = config_of((x,)).pow2 if pow2_mode is None else pow2_mode
    # An all-zero (or empty) x has r = 0: no range to fix, its scale is kept (a known
    # zero's scale 0 included), so the result is x's value, never 0/0 = NaN.
    return x.scale * torch.where(r > 0, round_pow2(r, mode), 1.0)


def rebalance(x: ScaledTensor, s: Tensor | float) -> ScaledTensor:
    """The same value at scale ``s``: ``d ← d·(s_x/s)``; ``ValueError`` for a NaN/Inf/≤0
    ``s``. The gradient passes unchanged.

    Example:
        >>> import torch
        >>> t = rebalance(scaled(torch.tensor([1.0, 2.0]), 1.0), 4.0)
        >>> t.qdata.tolist(), t.scale.item()
        ([0.25, 0.5], 4.0)
    """
    if not isinstance(x, ScaledTensor):
        raise TypeError(f"x must be a ScaledTensor, got {type(x).__name__}")
    st = s if isinstance(s, Tensor) else torch.tensor(float(s))
    st = st.float().to(x.device)
    _check_scale(st, "s")
    out: ScaledTensor = apply_fn(_Rebalance, x, st, None)
    return out


def dynamic_rescale(
    x: ScaledTensor, how: Stat = "max", *, pow2: Pow2Mode | None = None, grad: bool = False
) -> ScaledTensor:
    """Rebalance ``x`` to the scale ``s_x·r(d_x)``: ``r`` the ``max`` |d|, mean |d| (``l1``)
    or RMS (``l2``) of the data, rounded per ``pow2`` (``"none"``, ``"down"``, ``"up"``;
    default: the config's). So the data's max / mean |.| / RMS becomes ≈ 1. An all-zero
    or empty ``x`` (``r = 0``) keeps its scale: the result equals ``x`` (zeros, no NaN).
    Data holding NaN/Inf raises ``ValueError`` (the statistic is not finite). With
    ``grad=True`` the gradient is rescaled the same way in backward.

    Example:
        >>> import torch
        >>> t = dynamic_rescale(scaled(torch.tensor([3.0, -6.0]), 0.5), "max", pow2="up")
        >>> t.qdata.tolist(), t.scale.item()
        ([0.375, -0.75], 4.0)
    """
    if not isinstance(x, ScaledTensor):
        raise TypeError(f"x must be a ScaledTensor, got {type(x).__name__}")
    if pow2 not in (None, "none", "down", "up"):
        raise ValueError(f"pow2 must be None, 'none', 'down' or 'up', got {pow2!r}")
    s = _new_scale(x, how, pow2)
    out: ScaledTensor = apply_fn(_Rebalance, x, s, how if grad else None)
    return out
