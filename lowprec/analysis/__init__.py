"""Numerics analysis: value counts and statistics (:mod:`~lowprec.analysis.stats`, the one
implementation), per-tensor tracking in forward and backward, per-GEMM measured numerics of
the low-precision casts (:mod:`~lowprec.analysis.gemms`), plots, the plain-language
diagnosis of a run, and the rounding SNR of formats across scales.

Example::

    from lowprec.analysis import track, plot_scale_chart
    with track(model, formats=["fp16", "e4m3fn", "e5m2"], every=10) as t:
        ...  # train
    plot_scale_chart(t.records, step=0, formats=t.formats, path="scales.png")
"""

from lowprec.analysis.gemms import GemmRecorder, measure_gemms
from lowprec.analysis.plots import plot_curves, plot_exp_histograms, plot_scale_chart, rows_at
from lowprec.analysis.stats import count_values, grad_stats
from lowprec.analysis.tracking import KINDS, Tracker, tensor_stats, track

__all__ = [
    "KINDS",
    "GemmRecorder",
    "Tracker",
    "count_values",
    "grad_stats",
    "measure_gemms",
    "plot_curves",
    "plot_exp_histograms",
    "plot_scale_chart",
    "rows_at",
    "tensor_stats",
    "track",
]
