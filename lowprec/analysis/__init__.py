"""Numerics analysis: per-tensor statistics in forward and backward, and their plots.

Example::

    from lowprec.analysis import track, plot_scale_chart
    with track(model, formats=["fp16", "e4m3fn", "e5m2"], every=10) as t:
        ...  # train
    plot_scale_chart(t.records, step=0, formats=t.formats, path="scales.png")
"""

from lowprec.analysis.plots import plot_exp_histograms, plot_scale_chart, rows_at
from lowprec.analysis.tracking import KINDS, Tracker, tensor_stats, track

__all__ = [
    "KINDS",
    "Tracker",
    "plot_exp_histograms",
    "plot_scale_chart",
    "rows_at",
    "tensor_stats",
    "track",
]
