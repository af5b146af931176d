"""The Gaussian moments behind the scales of :mod:`lowprec.unit.functional`'s activations
and softmax: ``E[·]`` under ``X ~ N(0, 1)``, by Gauss–Hermite quadrature
(:func:`gauss_moment`) for the pointwise maps, sampled once per ``(n, mult)`` for the
softmax and the rows of attention. Each public function is a constant of a
``torch.compile`` graph (evaluated when it is traced) and cached.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "RELU_GAINS", "activation_gains", "attention_rows", "gauss_moment", "key_grid", "row_values",
    "silu_second_moment", "softmax_gains", "softmax_row_table",
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


@functools.lru_cache(maxsize=2048)
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


_EXACT_KEYS = 16  # key counts 1..16 are grid points; above them, 4 per octave
_PER_OCTAVE = 4


def key_grid(n: int) -> tuple[int, ...]:
    """The key counts at which :func:`softmax_row_table` samples: ``1..16``, then
    ``round(16·2^{j/4})`` for ``j = 1, 2, …`` up to the first count ``>= n`` (at least two
    counts)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    grid = list(range(1, min(max(n, 2), _EXACT_KEYS) + 1))
    j = 0
    while grid[-1] < n:
        j += 1
        m = round(_EXACT_KEYS * 2 ** (j / _PER_OCTAVE))
        if m > grid[-1]:
            grid.append(m)
    return tuple(grid)


RowTable = tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]
"""``(counts, P2, D2)``: :func:`key_grid` counts and the row moments there."""


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def softmax_row_table(n: int, sigma: float) -> RowTable:
    """The moments of one attention row at each :func:`key_grid` count ``m`` up to ``n``,
    for ``m`` logits ``N(0, σ²)``: ``P2(m) = E[Σ_j p_j²]`` (the variance of ``Σ_j p_j v_j``
    for unit, independent ``v``) and ``D2(m) = E[Σ_j p_j²(u_j - Σ_k p_k u_k)²]·σ²`` (the
    variance of ``Σ_j ∂x_j k_j`` through the softmax for unit ``u`` and ``k``, ``∂x_j =
    p_j(u_j - Σ_k p_k u_k)``, times the logits' ``σ²``: the query gradient's variance in
    attention). Both from :func:`_softmax_moments_cached` (``P2 = m·E[p²]``, ``D2 =
    m·E[(∂x)²]``). No closed form holds across the range: ``P2 → e^{σ²}/m`` only while
    ``e^{σ²} ≪ m`` (at ``σ = 2``, 64 keys: 0.16 against ``e^4/64 = 0.85``), ``→ 1`` when
    one logit dominates; ``D2 → σ²·P2`` for flat rows and ``→ 0`` for one-hot ones (a
    saturated softmax passes no gradient). A constant of a ``torch.compile`` graph."""
    return _softmax_row_table_cached(int(n), float(sigma))


@functools.lru_cache(maxsize=64)
def _softmax_row_table_cached(n: int, sigma: float) -> RowTable:
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be finite and >= 0, got {sigma!r}")
    counts = key_grid(max(n, 1))
    moments = [_softmax_moments_cached(m, sigma) for m in counts]
    return (
        counts,
        tuple(m * a for m, (a, _) in zip(counts, moments, strict=True)),
        tuple(m * b for m, (_, b) in zip(counts, moments, strict=True)),
    )


def row_values(
    keys: torch.Tensor, counts: tuple[int, ...], values: tuple[float, ...]
) -> torch.Tensor:
    """``values`` (one per grid count of :func:`key_grid`, each > 0) at the key counts
    ``keys`` (a floating tensor; below 1 read as 1, above the grid as its last count),
    linear in ``log m``–``log value`` between neighbouring grid counts: exact at ``m <=
    16``, and exact for a power law such as the flat rows' ``P2 = e^{σ²}/m`` in between.
    Tensor ops only (traceable; on the device of ``keys``, in its dtype)."""
    g = torch.tensor(counts, dtype=keys.dtype, device=keys.device).log()
    v = torch.tensor(values, dtype=keys.dtype, device=keys.device).clamp(min=1e-30).log()
    m = keys.clamp(min=1.0, max=float(counts[-1])).log()
    hi = torch.searchsorted(g, m.contiguous()).clamp(min=1, max=len(counts) - 1)
    lo = hi - 1
    t = (m - g[lo]) / (g[hi] - g[lo])
    return (v[lo] + t * (v[hi] - v[lo])).exp()


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def attention_rows(rows: int, n: int, sigma: float, causal: bool) -> tuple[float, float]:
    """The mean over ``rows`` query rows of :func:`softmax_row_table`'s ``(P2, D2)``: each
    row sees ``n`` keys, or with ``causal`` row ``i`` the first ``min(i + 1, n)``. A
    constant of a ``torch.compile`` graph."""
    return _attention_rows_cached(int(rows), int(n), float(sigma), bool(causal))


@functools.lru_cache(maxsize=256)
def _attention_rows_cached(rows: int, n: int, sigma: float, causal: bool) -> tuple[float, float]:
    counts, p2, d2 = _softmax_row_table_cached(max(n, 1), sigma)
    keys = (
        torch.arange(1, max(rows, 1) + 1, dtype=torch.float64).clamp(max=max(n, 1))
        if causal
        else torch.full((1,), float(max(n, 1)), dtype=torch.float64)
    )
    return float(row_values(keys, counts, p2).mean()), float(row_values(keys, counts, d2).mean())
