"""The HTML report: compare training runs and explain their numerics in plain language.

``write_report([run_dir, ...], "report.html")`` (or ``lowprec report RUN_DIR ... -o F``)
writes one self-contained page (images embedded as PNG data URIs, no external files):

* a summary table (losses, gap to the first run, skipped steps, divergence, the worst
  underflow and overflow of the last tracked step);
* loss curves and the loss scale of all runs (:func:`plot_runs`);
* per run: a plain-language diagnosis (:func:`diagnose`), per-tensor scale charts at
  initialisation and at the end, exponent histograms of the worst tensors, and tables of
  the tensors with the most underflow and overflow per format.

A run directory is what ``lowprec train`` writes: ``config.json``, ``metrics.jsonl`` and,
for the numerics, ``numerics.jsonl`` (:mod:`lowprec.analysis.tracking` records at the first
and the last step).
"""

from __future__ import annotations

import base64
import html
import json
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowprec.analysis.plots import plot_exp_histograms, plot_scale_chart
from lowprec.analysis.tracking import BACKWARD_KINDS, KINDS
from lowprec.core.formats import get_format
from lowprec.jobs.train import CONFIG, METRICS, NUMERICS, RunError, read_metrics, summary_of

__all__ = ["Run", "diagnose", "load_run", "plot_runs", "write_report"]

_KIND_TEXT = {
    "input": "inputs",
    "output": "activations",
    "weight": "weights",
    "grad_output": "activation gradients",
    "weight_grad": "weight gradients",
}
UNDERFLOW_ALERT = 0.25  # share of a tensor below a format's smallest normal
OVERFLOW_ALERT = 1e-4  # share above a format's max


@dataclass
class Run:
    """A loaded run directory."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    numerics: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""  # the name shown; write_report makes it unique among the runs

    @property
    def name(self) -> str:
        return self.label or self.path.name

    @property
    def planned_steps(self) -> int | None:
        steps = self.config.get("train", {}).get("steps")
        return int(steps) if isinstance(steps, int) else None

    @property
    def stopped_early(self) -> bool:
        planned = self.planned_steps
        return planned is not None and int(self.summary.get("steps", 0)) < planned

    @property
    def recipe(self) -> str:
        return str(self.config.get("train", {}).get("recipe", "?"))

    @property
    def formats(self) -> list[str]:
        first = self.numerics[0] if self.numerics else {}
        return list(first.get("below_normal", {}))

    @property
    def float8(self) -> str | None:
        """The float8 preset of the run's recipe, if any."""
        f8 = self.config.get("recipe", {}).get("float8")
        return None if f8 is None else str(f8)

    @property
    def tracked_steps(self) -> list[int]:
        return sorted({int(r["step"]) for r in self.numerics})

    @property
    def compute_format(self) -> str:
        """The format the run's activations and gradients are stored in."""
        rec = self.config.get("recipe", {})
        return str(rec.get("autocast") or rec.get("param_dtype") or "fp32")


def load_run(path: str | Path) -> Run:
    """Read a run directory; :class:`RunError` (a ``ValueError``) if it is not one."""
    p = Path(path)
    if not p.is_dir():
        raise RunError(f"{p} is not a directory (expected a run directory of `lowprec train`)")
    missing = [n for n in (CONFIG, METRICS) if not (p / n).is_file()]
    if missing:
        raise RunError(
            f"{p} is not a lowprec run directory: no {' or '.join(missing)} "
            "(make one with `lowprec train --out DIR` or `lowprec demo`)"
        )
    try:
        config = json.loads((p / CONFIG).read_text())
        metrics = read_metrics(p)
    except (json.JSONDecodeError, OSError) as e:
        raise RunError(f"{p}: unreadable run files ({e})") from None
    if not metrics:
        raise RunError(f"{p}: the run has no recorded steps yet ({METRICS} is empty)")
    numerics: list[dict[str, Any]] = []
    if (p / NUMERICS).is_file():
        try:
            numerics = [json.loads(ln) for ln in (p / NUMERICS).read_text().splitlines() if ln]
        except json.JSONDecodeError as e:
            raise RunError(f"{p}: {NUMERICS} is corrupt or truncated ({e})") from None
    return Run(p, config, metrics, summary_of(metrics, config), numerics)


def _worst(
    run: Run,
    step: int,
    measure: str,
    kinds: Sequence[str] | None = None,
    formats: Sequence[str] | None = None,
) -> list[tuple[float, str, dict[str, Any]]]:
    """(share, format, record) of ``measure`` at ``step``, largest first."""
    out = []
    for r in run.numerics:
        if r["step"] != step or (kinds is not None and r["kind"] not in kinds):
            continue
        for fmt, share in r[measure].items():
            if formats is None or fmt in formats:
                out.append((float(share), fmt, r))
    return sorted(out, key=lambda t: -t[0])


def _judged(run: Run, backward: bool) -> list[str]:
    """The formats a run's tensors are judged against: its own storage format and the FP8
    format of that pass (E5M2 for gradients, E4M3 for activations and weights)."""
    want: tuple[str, ...] = (run.compute_format, "e5m2" if backward else "e4m3fn")
    if run.float8 is not None:  # its FP8 operands are scaled first: unscaled shares mislead
        want = (run.compute_format,)
    return [f for f in dict.fromkeys(want) if f in run.formats]


def _worst_overflow(run: Run, step: int) -> list[tuple[float, str, dict[str, Any]]]:
    """Overflow shares at ``step``: forward tensors in their formats, gradients in theirs."""
    fwd = [k for k in KINDS if k not in BACKWARD_KINDS]
    out = _worst(run, step, "above_max", fwd, _judged(run, backward=False))
    out += _worst(run, step, "above_max", BACKWARD_KINDS, _judged(run, backward=True))
    return sorted(out, key=lambda t: -t[0])


def diagnose(run: Run) -> list[str]:
    """Plain-language findings about ``run``, most important first.

    Gradients are judged against the run's own storage format and E5M2 (the FP8 gradient
    format), forward tensors against the own format and E4M3; one finding per format
    names the worst tensor and counts the others past the threshold
    (:data:`UNDERFLOW_ALERT` of the values below the smallest normal, or
    :data:`OVERFLOW_ALERT` above the max). "Would" marks a format the run does not use.
    """
    notes: list[str] = []
    s = run.summary
    if s.get("diverged_at") is not None:
        notes.append(
            f"The loss became NaN/Inf at step {s['diverged_at']}: the run diverged. Look for "
            "overflow below, lower the learning rate, or use loss scaling with skipped steps."
        )
    if run.stopped_early:
        notes.append(
            f"The run stopped at step {s.get('steps')} of {run.planned_steps} (interrupted?): "
            "its numbers are not final; `lowprec train --resume` continues it exactly."
        )
    if s.get("skipped_steps"):
        notes.append(
            f"The loss scaler skipped {s['skipped_steps']} step(s) with Inf/NaN gradients "
            "(expected while a dynamic loss scale finds its level)."
        )
    if not run.numerics:
        notes.append("No numerics were recorded for this run (no numerics.jsonl).")
        return notes
    last, own = run.tracked_steps[-1], run.compute_format
    found = False
    if run.float8 is not None:
        notes.append(
            f"Float8 recipe {run.float8!r}: each linear layer scales its GEMM operands before "
            "the cast to E4M3/E5M2, so its tensors are judged in the run's own format "
            f"({own}) only."
        )
    for fmt in _judged(run, backward=True):
        bad = [
            t
            for t in _worst(run, last, "below_normal", BACKWARD_KINDS, [fmt])
            if t[0] >= UNDERFLOW_ALERT
        ]
        if not bad:
            continue
        found = True
        share, _, r = bad[0]
        n_grads = len(
            {
                (x["name"], x["kind"])
                for x in run.numerics
                if x["step"] == last and x["kind"] in BACKWARD_KINDS
            }
        )
        more = (
            f" ({len(bad) - 1} more of the {n_grads} gradient tensors too)" if len(bad) > 1 else ""
        )
        verb = "underflow in" if fmt == own else "would underflow if cast unscaled to"
        fix = (
            "use loss scaling or unit scaling"
            if fmt == own
            else "scale them (loss scaling, unit scaling or per-tensor float8 scales)"
        )
        notes.append(
            f"{100 * share:.0f}% of the {_KIND_TEXT[r['kind']]} of {r['name']} {verb} {fmt} "
            f"(below its smallest normal, {get_format(fmt).min_normal:.3g}) at step {last}"
            f"{more}: {fix}."
        )
    for fmt in dict.fromkeys(_judged(run, backward=False) + _judged(run, backward=True)):
        bad = [t for t in _worst_overflow(run, last) if t[1] == fmt and t[0] >= OVERFLOW_ALERT]
        if not bad:
            continue
        found = True
        share, _, r = bad[0]
        verb = "overflow" if fmt == own else "would overflow"
        notes.append(
            f"{100 * share:.2g}% of the {_KIND_TEXT[r['kind']]} of {r['name']} {verb} {fmt} "
            f"(above {get_format(fmt).max:g}) at step {last}: scale them (per-tensor or "
            "delayed scaling) or keep them in a wider format."
        )
    if not found:
        checked = ", ".join(dict.fromkeys(_judged(run, False) + _judged(run, True)))
        notes.append(
            f"Healthy at step {last}: no gradient has {100 * UNDERFLOW_ALERT:.0f}% of its values "
            f"below the smallest normal, and nothing overflows ({checked})."
        )
    return notes


def plot_runs(runs: Sequence[str | Path], path: str | Path) -> None:
    """Four panels for several runs: loss curves (train EMA, val dots), the val-loss gap to
    the first run, the share of activation gradients below their dtype's smallest normal,
    and the loss scale."""
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
    for k, run in enumerate(runs):
        recs = read_metrics(run)
        name = Path(run).name
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
        uf = [(r["step"], 100 * r["act_grad_underflow"]) for r in recs if "act_grad_underflow" in r]
        if uf:
            ax_uf.plot(*zip(*uf, strict=True), lw=1.2, ls=ls, color=color, label=name)
        ax_s.plot(steps, [r["loss_scale"] for r in recs], lw=1.3, ls=ls, color=color, label=name)
    first = Path(runs[0]).name if runs else ""
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


def _ema(xs: Sequence[float], beta: float) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None or not math.isfinite(m) else beta * m + (1 - beta) * x
        out.append(m)
    return out


# ---- HTML -----------------------------------------------------------------------------


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


def _num(v: Any, fmt: str = "{:.4f}") -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN"
    return fmt.format(v)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _cell(t: tuple[float, str, dict[str, Any]]) -> str:
    share, fmt, r = t
    return f"{100 * share:.3g}% ({fmt}, {r['name']} {_KIND_TEXT[r['kind']]})"


def _summary_rows(runs: Sequence[Run]) -> list[list[str]]:
    def val(run: Run) -> float | None:  # None: no evaluation yet (or not finite)
        v = run.summary.get("val_loss")
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    ref = val(runs[0])
    rows = []
    for run in runs:
        s = run.summary
        v = val(run)
        gap = None if ref is None or v is None else 100 * (v / ref - 1)
        last = run.tracked_steps[-1] if run.numerics else -1
        uf = _worst(run, last, "below_normal", BACKWARD_KINDS, _judged(run, backward=True))
        of = _worst_overflow(run, last)
        rows.append(
            [
                run.name,
                run.recipe,
                str(s.get("steps")) + (f" of {run.planned_steps}" if run.stopped_early else ""),
                _num(s.get("train_loss")),
                _num(v),
                _num(gap, "{:+.2f}%"),
                str(s.get("skipped_steps", 0)),
                "–" if s.get("diverged_at") is None else f"step {s['diverged_at']}",
                _cell(uf[0]) if uf else "–",
                _cell(of[0]) if of and of[0][0] else "0",
            ]
        )
    return rows


def _tensor_table(run: Run, step: int, measure: str, title: str) -> str:
    top = [t for t in _worst(run, step, measure) if t[0] > 0][:8]
    if not top:
        return f"<p>{html.escape(title)}: none.</p>"
    rows = [
        [
            r["name"],
            _KIND_TEXT[r["kind"]],
            fmt,
            f"{100 * share:.2f}%",
            f"{r['amax']:.3g}",
            f"{r['rms']:.3g}",
        ]
        for share, fmt, r in top
    ]
    return f"<h4>{html.escape(title)}</h4>" + _table(
        ["tensor", "kind", "format", "share", "amax", "rms"], rows
    )


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}
.diag{background:#fff8e6;border-left:4px solid #e0a000;padding:.4em 1em}
.run{border-top:2px solid #888;margin-top:2em}
"""


def _unique_labels(runs: Sequence[Run]) -> None:
    """Label runs by directory name, adding parent folders where names repeat."""
    paths = [r.path.resolve() for r in runs]
    distinct = len(set(paths))  # the same directory given twice keeps one label
    for depth in range(1, 8):
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == distinct:
            break
    for r, lab in zip(runs, labels, strict=True):
        r.label = lab


def write_report(runs: Sequence[str | Path], out: str | Path, title: str = "") -> Path:
    """Write the HTML report comparing ``runs`` (run directories) to ``out``; see the
    module docstring. Raises :class:`RunError` naming any directory that is not a run."""
    if not runs:
        raise ValueError("runs: give at least one run directory")
    loaded = [load_run(r) for r in runs]
    _unique_labels(loaded)
    out = Path(out)
    parts = [
        f"<h1>{html.escape(title or 'lowprec numerics report')}</h1>",
        "<h2>Summary</h2>",
        _table(
            [
                "run",
                "recipe",
                "steps",
                "train loss",
                "val loss",
                f"gap to {loaded[0].name}",
                "skipped",
                "diverged",
                "worst gradient underflow",
                "worst overflow",
            ],
            _summary_rows(loaded),
        ),
        "<p>Underflow: share of a gradient's values below a format's smallest normal "
        "(subnormal or lost); overflow: share of a tensor's values above a format's max. "
        "Each is judged in the run's own format and the FP8 format of its pass (E4M3 for "
        "activations and weights, E5M2 for gradients), at the last tracked step.</p>",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        plot_runs([r.path for r in loaded], t / "curves.png")
        parts += ["<h2>Loss curves and loss scale</h2>", _img(t / "curves.png", "loss curves")]
        for i, run in enumerate(loaded):
            parts.append(
                f'<div class="run"><h2>{html.escape(run.name)} '
                f"<small>({html.escape(run.recipe)})</small></h2>"
            )
            parts.append(
                '<div class="diag"><ul>'
                + "".join(f"<li>{html.escape(n)}</li>" for n in diagnose(run))
                + "</ul></div>"
            )
            steps = run.tracked_steps
            for label, step in (
                ("at initialisation", steps[0] if steps else None),
                ("at the end", steps[-1] if len(steps) > 1 else None),
            ):
                if step is None:
                    continue
                png = t / f"scales{i}_{step}.png"
                plot_scale_chart(
                    run.numerics,
                    step,
                    run.formats,
                    png,
                    f"{run.name}: tensor scales {label} (step {step})",
                )
                parts += [
                    f"<h3>Tensor scales {label} (step {step})</h3>",
                    _img(png, f"{run.name} scales {label}"),
                ]
            if steps:
                last = steps[-1]
                worst = list(
                    dict.fromkeys(
                        (r["name"], r["kind"]) for _, _, r in _worst(run, last, "below_normal")
                    )
                )[:6]
                png = t / f"hist{i}.png"
                plot_exp_histograms(run.numerics, last, worst, run.formats, png)
                parts += [
                    f"<h3>Exponent histograms of the most underflowing tensors (step {last})</h3>",
                    _img(png, f"{run.name} exponent histograms"),
                ]
                parts.append(_tensor_table(run, last, "below_normal", "Most underflow"))
                parts.append(_tensor_table(run, last, "above_max", "Most overflow"))
            parts.append("</div>")
    page = (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<link rel="icon" href="data:,">'
        f"<title>{html.escape(title or 'lowprec report')}</title><style>{_CSS}</style>"
        "</head><body>" + "\n".join(parts) + "</body></html>"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
