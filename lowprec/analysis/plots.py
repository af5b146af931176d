"""Pictures of tracked numerics (records from :mod:`lowprec.analysis.tracking`), as PNG files.

* :func:`plot_scale_chart`: one row per tensor, a log2 magnitude axis, forward tensors as
  circles and backward tensors (gradients) as triangles: a line from the smallest nonzero
  magnitude's binade to ``amax``, a marker at the RMS. Each format's range is a band:
  pale from its smallest subnormal to its smallest normal, darker over its normal range.
* :func:`plot_exp_histograms`: exponent histograms of chosen tensors with the formats'
  ranges shaded the same way.
* :func:`plot_curves`: training curves of several runs (loss, gap to the first run,
  activation-gradient underflow, loss scale) from their metrics records.
* :func:`plot_verdicts`: the demo's failing and cured runs side by side, train loss and
  its gap to each run's reference with the seed-spread band.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lowprec.analysis.tracking import BACKWARD_KINDS
from lowprec.core.formats import get_format

__all__ = [
    "plot_curves",
    "plot_exp_histograms",
    "plot_scale_chart",
    "plot_verdicts",
    "rows_at",
]

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
# Tensors a scale chart shows (inputs repeat the previous module's output).
CHART_KINDS = ("output", "weight", "grad_output", "weight_grad")


def rows_at(
    records: Sequence[dict[str, Any]], step: int, kinds: Sequence[str] = CHART_KINDS
) -> list[dict[str, Any]]:
    """The records of ``step`` with a kind in ``kinds``, in model order, biases left out."""
    out = [r for r in records if r["step"] == step and r["kind"] in kinds]
    return [r for r in out if not r["name"].endswith(".bias")]


def _bands(ax: Any, formats: Sequence[str], vertical: bool, labels: bool = False) -> None:
    for i, name in enumerate(formats):
        f = get_format(name)
        c = _COLORS[i % len(_COLORS)]
        sub, low, top = math.log2(f.min_subnormal), math.log2(f.min_normal), math.log2(f.max)
        span = ax.axvspan if vertical else ax.axhspan
        span(sub, low, color=c, alpha=0.06, lw=0)
        span(low, top, color=c, alpha=0.12, lw=0, label=f"{f.name}: normal range (pale: subnormal)")
        line = ax.axvline if vertical else ax.axhline
        for v, label in ((sub, "min sub"), (top, "max")):
            line(v, color=c, lw=0.8, ls="--", alpha=0.7)
            if labels and vertical and abs(v) <= 64:  # name each bound along the top edge
                ax.text(
                    v,
                    1.0,
                    f" {f.name} {label}",
                    transform=ax.get_xaxis_transform(),
                    rotation=90,
                    va="bottom",
                    ha="center",
                    fontsize=6,
                    color=c,
                )


def _xlim(ax: Any, formats: Sequence[str], lo: float, hi: float) -> None:
    """Show the data and every format bound within 2^±64 (bf16/fp32 ranges are wider than
    any tensor: their band then spans the whole axis instead of squashing it)."""
    for name in formats:
        f = get_format(name)
        for b in (math.log2(f.min_subnormal), math.log2(f.max)):
            if abs(b) <= 64:
                lo, hi = min(lo, b), max(hi, b)
    ax.set_xlim(lo - 2, hi + 2)


def _low_exponent(r: dict[str, Any]) -> float | None:
    """The binade below which 1% of the nonzero values lie (from the exponent histogram)."""
    h = r["exp_hist"]
    counts = h["counts"]
    total = sum(counts)
    if not total:
        return None
    acc = 0
    for i, c in enumerate(counts):
        acc += c
        if acc >= 0.01 * total:
            return float(h["lo"] + i)
    return float(h["lo"])


def plot_scale_chart(
    records: Sequence[dict[str, Any]],
    step: int,
    formats: Sequence[str],
    path: str | Path,
    title: str = "",
) -> Path:
    """Write the per-tensor scale chart of ``step`` to ``path`` (PNG); see the module doc."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    rows = rows_at(records, step)
    if not rows:
        raise ValueError(f"records: nothing recorded at step {step}")
    height = max(3.0, 0.2 * len(rows) + 1.6)
    fig = Figure(figsize=(9.5, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    _bands(ax, formats, vertical=True, labels=True)
    # One artist per colour and marker (not one per row): drawing cost stays flat in rows.
    for back, color, marker in ((False, "#303090", "o"), (True, "#c03030", "^")):
        segs, ticks, rms = [], [], []
        for y, r in enumerate(rows):
            if (r["kind"] in BACKWARD_KINDS) != back:
                continue
            lo = _low_exponent(r)
            if r["amax"] > 0 and lo is not None:
                segs.append([(lo, y), (math.log2(r["amax"]), y)])
                ticks.append((math.log2(r["amax"]), y))
            if r["rms"] > 0:
                rms.append((math.log2(r["rms"]), y))
        ax.add_collection(LineCollection(segs, colors=color, linewidths=1.2, alpha=0.7))
        for pts, m, ms in ((ticks, "|", 8), (rms, marker, 5)):
            if pts:
                ax.plot(*zip(*pts, strict=True), m, color=color, ms=ms, ls="none")
    lows = [x for x in (_low_exponent(r) for r in rows) if x is not None]
    highs = [math.log2(r["amax"]) for r in rows if r["amax"] > 0]
    _xlim(ax, formats, min(lows, default=-10.0), max(highs, default=10.0))
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    labels = [f"{r['name']} · {r['kind']}" for r in rows]
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("log2 |x|   (line: 1st percentile binade to amax; marker: RMS)")
    ax.set_title(
        title or f"tensor scales at step {step}: forward ● (blue), backward ▲ (red)",
        fontsize=10,
        pad=62,
    )
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    # Margins from the label lengths (tight_layout would cost a full extra draw): 7 pt
    # labels are about 0.6 em wide a character; the title sits 62 pt above the axes.
    label_in = 0.15 + max(map(len, labels)) * 7 * 0.6 / 72
    fig.subplots_adjust(
        left=min(0.6, label_in / 9.5),
        right=0.98,
        bottom=0.55 / height,
        top=1 - 1.25 / height,
    )
    fig.savefig(path)
    return Path(path)


def plot_exp_histograms(
    records: Sequence[dict[str, Any]],
    step: int,
    names: Sequence[tuple[str, str]],
    formats: Sequence[str],
    path: str | Path,
) -> Path:
    """Exponent histograms of the ``(name, kind)`` tensors at ``step`` (share of nonzero
    values per binade), the formats' ranges shaded; written to ``path`` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by = {(r["name"], r["kind"]): r for r in records if r["step"] == step}
    chosen = [by[k] for k in names if k in by]
    if not chosen:
        raise ValueError(f"names: none of {list(names)[:4]} was recorded at step {step}")
    cols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / cols)
    fig = Figure(figsize=(4.2 * cols, 2.6 * nrows), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, cols, squeeze=False)
    for k, r in enumerate(chosen):
        ax = axes[k // cols][k % cols]
        _bands(ax, formats, vertical=True)
        h = r["exp_hist"]
        total = max(sum(h["counts"]), 1)
        xs = [h["lo"] + i for i in range(len(h["counts"]))]
        edges = [x - 0.5 for x in xs] + [xs[-1] + 0.5] if xs else [0.0]
        ax.stairs([100 * c / total for c in h["counts"]], edges, fill=True, color="#404040")
        _xlim(ax, formats, min(xs, default=-10), max(xs, default=10))
        ax.set_title(f"{r['name']} · {r['kind']}", fontsize=8)
        ax.set_xlabel("floor(log2 |x|)", fontsize=7)
        ax.set_ylabel("% of nonzero", fontsize=7)
        ax.tick_params(labelsize=7)
    for k in range(len(chosen), nrows * cols):
        axes[k // cols][k % cols].axis("off")
    axes[0][0].legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def plot_curves(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: str | Path) -> Path:
    """Four panels for several runs given as ``(name, metrics records)``: loss curves
    (train EMA 0.9, val dots), the val-loss gap to the first run, the share of activation
    gradients below their dtype's smallest normal, and the loss scale; written to ``path``
    (PNG). Records are the per-step dicts of ``lowprec train`` (``step``, ``loss``,
    ``loss_scale``, optional ``val_loss`` and ``act_grad_underflow``)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 7.5), dpi=110)
    FigureCanvasAgg(fig)
    (ax, ax_gap), (ax_uf, ax_s) = fig.subplots(2, 2)
    ref: dict[int, float] = {}
    # Up to 10 runs: matplotlib's tab10 cycle. More (the demo has 16): tab20's 20 colours,
    # runs after the 10th dashed, so that no two runs share a colour and a line style.
    palette = matplotlib.colormaps["tab10" if len(runs) <= 10 else "tab20"]
    for k, (name, recs) in enumerate(runs):
        steps = [r["step"] for r in recs]
        color = palette(k % palette.N)
        ls = "-" if k < 10 else "--"
        ax.plot(steps, _ema([r["loss"] for r in recs], 0.9), lw=1.3, ls=ls, color=color, label=name)
        vals = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
        if vals:
            ax.plot(list(vals), list(vals.values()), "o", ms=3, color=color)
        if k == 0:
            ref = vals
        common = [s for s in vals if s in ref]
        ax_gap.plot(
            common,
            [100 * (vals[s] / ref[s] - 1) for s in common],
            marker="o",
            ms=3,
            lw=1.2,
            ls=ls,
            color=color,
            label=name,
        )
        uf = [  # applied steps only: a skipped step's gradients hold Inf/NaN
            (r["step"], 100 * r["act_grad_underflow"])
            for r in recs
            if "act_grad_underflow" in r and not r.get("skipped")
        ]
        if uf:
            ax_uf.plot(*zip(*uf, strict=True), lw=1.2, ls=ls, color=color, label=name)
        ax_s.plot(steps, [r["loss_scale"] for r in recs], lw=1.3, ls=ls, color=color, label=name)
    first = runs[0][0] if runs else ""
    ax.set(xlabel="step", ylabel="loss (nats/char)", title="train loss (EMA 0.9) and val (dots)")
    ax_gap.axhline(0.0, color="black", lw=0.8)
    ax_gap.axhspan(-1.0, 1.0, color="green", alpha=0.08, label="±1%")
    ax_gap.set(xlabel="step", ylabel="%", title=f"val loss gap to {first}")
    ax_uf.set(
        xlabel="step",
        ylabel="% of values",
        ylim=(-2, 102),
        title="activation gradients below the smallest normal (underflow)",
    )
    ax_s.set(xlabel="step", ylabel="loss scale", yscale="log", title="loss scale")
    for a in (ax, ax_gap, ax_uf, ax_s):
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax_gap.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def _ema(xs: Sequence[float], beta: float) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None or not math.isfinite(m) else beta * m + (1 - beta) * x
        out.append(m)
    return out


def plot_verdicts(
    runs: Mapping[str, Sequence[dict[str, Any]]],
    panels: Sequence[tuple[str, Sequence[str]]],
    references: Mapping[str, str | None],
    tolerance: Mapping[str, float],
    path: str | Path,
) -> Path:
    """The demo's picture: one column per panel ``(title, run names)`` (runs in no panel
    get one more), train loss (EMA 0.9) on top and below it the gap of that EMA to each
    run's reference (``references[name]``; paired: the same batches at the same step), the
    seed-spread band ``±tolerance[reference]`` shaded. A run that hit NaN/Inf ends in a
    cross. Written to ``path`` (PNG)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rest = [n for n in runs if not any(n in names for _, names in panels)]
    cols = [(t, [n for n in names if n in runs]) for t, names in panels]
    cols = [c for c in cols if c[1]] + ([("other recipes", rest)] if rest else [])
    fig = Figure(figsize=(6.5 * len(cols), 7.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(cols), squeeze=False)
    palette = matplotlib.colormaps["tab10"]
    refs = [n for n in runs if references.get(n) is None]  # the references: black, grey
    color: dict[str, Any] = {n: ("black", "grey", "silver")[min(k, 2)] for k, n in enumerate(refs)}
    ema = {n: _ema([r["loss"] for r in recs], 0.9) for n, recs in runs.items()}
    for j, (title, names) in enumerate(cols):
        top, gap = axes[0][j], axes[1][j]
        bands: set[str] = set()
        crosses = 0
        others = [n for n in names if n not in color]
        color.update({n: palette(k % palette.N) for k, n in enumerate(others)})
        for n in names:
            steps = [r["step"] for r in runs[n]]
            ref_run = references.get(n) is None
            top.plot(steps, ema[n], lw=2.2 if ref_run else 1.4, color=color[n], label=n)
            bad = [s for s, v in zip(steps, ema[n], strict=True) if not math.isfinite(v)]
            if bad:
                good = [(s, v) for s, v in zip(steps, ema[n], strict=True) if math.isfinite(v)]
                if good:
                    top.plot(*good[-1], "x", ms=10, mew=2, color=color[n])
                top.annotate(
                    f"{n}: NaN at step {bad[0]}",
                    (0.98, 0.98 - 0.07 * crosses),
                    xycoords="axes fraction",
                    ha="right",
                    va="top",
                    fontsize=8,
                    color=color[n],
                )
                crosses += 1
            ref = references.get(n)
            if ref is None or ref not in ema:
                continue
            pairs = [
                (s, 100 * (a / b - 1))
                for s, a, b in zip(steps, ema[n], ema[ref], strict=False)
                if math.isfinite(a) and math.isfinite(b)
            ]
            if pairs:
                gap.plot(*zip(*pairs, strict=True), lw=1.3, color=color[n], label=f"{n} vs {ref}")
            if ref in tolerance and ref not in bands:
                t = 100 * tolerance[ref]
                gap.axhspan(-t, t, color=color[ref], alpha=0.12, label=f"seed spread vs {ref}")
                bands.add(ref)
        top.set(xlabel="step", ylabel="train loss (nats/char, EMA 0.9)", title=title)
        gap.axhline(0.0, color="black", lw=0.8)
        gap.set(xlabel="step", ylabel="% (train-loss EMA)", title="gap to the reference")
        gap.set_yscale("symlog", linthresh=1.0)
        lo, hi = gap.get_ylim()
        gap.set_ylim(min(lo, -2.0), max(hi, 2.0))
        for a in (top, gap):
            a.grid(alpha=0.3)
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=7, loc="upper right" if a is gap else "center right")
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)
