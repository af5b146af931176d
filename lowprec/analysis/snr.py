"""The rounding SNR of a format across scales: how far a unit normal tensor may be scaled
before rounding into the format costs precision.

For a format ``f`` and an integer ``k``, ``x = N(0, 1) · 2^k`` (:func:`unit_normal`, exact
scaling in float64 for ``|k| <= 200``) is rounded into ``f`` and its SNR in dB is
``10 log10(Σ x² / Σ (x - round_f(x))²)`` (:func:`lowprec.core.rounding.snr_db`).
:func:`snr_sweep` gives one :class:`SnrCurve` per format; a curve's usable window is the
run of ``k`` within :data:`SNR_WINDOW_DB` of its peak. ``lowprec formats --snr`` prints
and plots them (:func:`plot_snr`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lowprec.core.formats import Format, get_format
from lowprec.core.rounding import snr_db

__all__ = [
    "SNR_DEFAULT_FORMATS",
    "SNR_SAMPLES",
    "SNR_SEED",
    "SNR_WINDOW_DB",
    "SnrCurve",
    "plot_snr",
    "snr_sweep",
    "unit_normal",
]

SNR_SEED = 0
"""Seed of the ``torch.Generator`` that draws the unit normal sample of ``formats --snr``."""
SNR_SAMPLES = 2**16
"""Number of float64 samples in the unit normal sample of ``formats --snr``."""
SNR_DEFAULT_FORMATS = ("fp16", "bf16", "e4m3fn", "e5m2")
SNR_WINDOW_DB = 3.0
"""The usable window of a format is the run of ``k`` within this many dB of its peak SNR."""


@dataclass(frozen=True)
class SnrCurve:
    """SNR (dB) of ``N(0,1) · 2^k`` rounded into ``fmt``, for each ``k`` in ``ks``."""

    fmt: Format
    ks: tuple[int, ...]
    snr: tuple[float, ...]

    @property
    def peak(self) -> float:
        """Highest SNR over the sweep (``inf`` if some ``k`` rounds exactly)."""
        return max(self.snr)

    @property
    def window(self) -> tuple[int, int]:
        """``(lo, hi)``: the contiguous run of ``k`` around the first peak with SNR within
        :data:`SNR_WINDOW_DB` of the peak (with an ``inf`` peak: the run of exact ``k``)."""
        i = self.snr.index(self.peak)
        floor = self.peak - SNR_WINDOW_DB
        lo = hi = i
        while lo > 0 and self.snr[lo - 1] >= floor:
            lo -= 1
        while hi < len(self.snr) - 1 and self.snr[hi + 1] >= floor:
            hi += 1
        return self.ks[lo], self.ks[hi]


def unit_normal(seed: int = SNR_SEED, n: int = SNR_SAMPLES) -> torch.Tensor:
    """``n`` float64 samples of ``N(0, 1)`` from ``torch.Generator().manual_seed(seed)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64)


def snr_sweep(fmts: Sequence[str | Format], ks: Sequence[int]) -> list[SnrCurve]:
    """SNR of :func:`unit_normal` times ``2^k`` for each format and each ``k`` (exact
    scaling: ``2^k`` is a power of two and float64 holds the products for ``|k| <= 200``)."""
    x = unit_normal()
    scaled = [x * 2.0**k for k in ks]
    return [SnrCurve(get_format(f), tuple(ks), tuple(snr_db(xk, f) for xk in scaled)) for f in fmts]


def plot_snr(curves: Sequence[SnrCurve], path: Path) -> None:
    """Plot the curves into ``path`` with the Agg canvas (no pyplot, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for c in curves:
        y = [v if math.isfinite(v) else math.nan for v in c.snr]  # exact rounding: no point
        ax.plot(c.ks, y, marker=".", markersize=4, label=f"{c.fmt.name} (peak {c.peak:.1f} dB)")
    ax.set_xlabel("scale exponent k (x = N(0,1) · 2^k)")
    ax.set_ylabel("SNR (dB)")
    ax.set_title(f"Rounding SNR of a unit normal tensor scaled by 2^k ({SNR_SAMPLES} samples)")
    ax.grid(True, alpha=0.4)
    ax.set_ylim(bottom=0)
    ax.margins(x=0.01)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="format")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
