"""The Gaussian moments behind the scales of :mod:`lowprec.unit.functional`'s activations
and softmax: ``E[·]`` under ``X ~ N(0, 1)``, by Gauss–Hermite quadrature
(:func:`gauss_moment`) for the pointwise maps, sampled once per ``(n, mult)`` for the
softmax. Each public function is a constant of a ``torch.compile`` graph (evaluated when
it is traced) and cached.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "RELU_GAINS", "activation_gains", "gauss_moment", "silu_second_moment", "softmax_gains",
]  # fmt: skip

_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(160)
_WEIGHTS = _WEIGHTS / math.sqrt(2 * math.pi)
_ERF = np.vectorize(math.erf)


def gauss_moment(f: Callable[[np.ndarray], np.ndarray], centred: bool = False) -> float:
    """``E[f(X)^2]`` (or ``Var f(X)`` if ``centred``) for ``X ~ N(0, 1)``."""
    v = f(_NODES)
    m2 = float(np.sum(_WEIGHTS * v * v))
    return m2 - float(np.sum(_WEIGHTS * v)) ** 2 if centred else m2


def _phi(x: np.ndarray) -> np.ndarray:
    return np.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # type: ignore[no-any-return]


def _Phi(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + _ERF(x / math.sqrt(2)))  # type: ignore[no-any-return]


def _sig(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))  # type: ignore[no-any-return]


def _gelu(x: np.ndarray) -> np.ndarray:
    return x * _Phi(x)  # type: ignore[no-any-return]


def _gelu_d(x: np.ndarray) -> np.ndarray:
    return _Phi(x) + x * _phi(x)  # type: ignore[no-any-return]


def _silu(x: np.ndarray) -> np.ndarray:
    return x * _sig(x)  # type: ignore[no-any-return]


def _silu_d(x: np.ndarray) -> np.ndarray:
    return _sig(x) * (1 + x * (1 - _sig(x)))  # type: ignore[no-any-return]


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def activation_gains(name: str, mult: float) -> tuple[float, float]:
    """:func:`_activation_moments` as constants of a ``torch.compile`` graph."""
    return _activation_moments(name, float(mult))


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def silu_second_moment(mult: float) -> float:
    """``E[silu(m·G)²]`` (uncentred: a product's second moment), ``G ~ N(0, 1)``."""
    return _silu_m2_cached(float(mult))


@functools.lru_cache(maxsize=256)
def _activation_moments(name: str, mult: float) -> tuple[float, float]:
    """``(Var f(mX), E[(m·f'(mX))²])`` of ``f`` = ``name`` at ``mult = m``, ``X ~ N(0, 1)``:
    the squared forward and backward gains of ``x ↦ f(m·x)`` (its derivative carries the
    ``m``), so the op stays unit at every multiplier u-μP tunes."""
    f, d = {"gelu": (_gelu, _gelu_d), "silu": (_silu, _silu_d)}[name]
    fwd = gauss_moment(lambda x: f(mult * x), True)
    bwd = gauss_moment(lambda x: mult * d(mult * x))
    return max(fwd, 1e-300), max(bwd, 1e-300)


@functools.lru_cache(maxsize=256)
def _silu_m2_cached(mult: float) -> float:
    return max(gauss_moment(lambda x: _silu(mult * x)), 1e-300)


RELU_GAINS = (0.5 - 1 / (2 * math.pi), 0.5)  # exact (the kink defeats quadrature)


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def softmax_gains(n: int, mult: float) -> tuple[float, float]:
    """:func:`_softmax_moments_cached` as constants of a ``torch.compile`` graph (evaluated when
    it is traced; ``n``, a key count, specialises it)."""
    return _softmax_moments_cached(int(n), float(mult))


@functools.lru_cache(maxsize=256)
def _softmax_moments_cached(n: int, mult: float) -> tuple[float, float]:
    """``(E[p²], E[(∂x)²])`` of ``p = softmax(m·x)`` over ``n`` unit-normal logits, the
    incoming gradient unit-normal and independent: ``∂x = m·p⊙(g - Σp g)``. Estimated once
    per ``(n, m)`` on a fixed sample (float64, 2^20 values: a relative error ~1/√rows),
    because no closed form covers both limits: ``E[n²p²] → e^{m²}`` while ``n ≫ e^{m²}``
    (flat rows) and ``→ n`` when one logit dominates (one-hot rows)."""
    rows = max(16, min(4096, (1 << 20) // max(n, 1)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    g = torch.randn(rows, n, generator=gen, dtype=torch.float64)
    p = torch.softmax(mult * x, dim=-1)
    dx = mult * p * (g - (p * g).sum(-1, keepdim=True))
    return float(p.square().mean()), max(float(dx.square().mean()), 1e-300)
