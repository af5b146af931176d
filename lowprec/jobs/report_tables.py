"""The report's tables (:mod:`lowprec.jobs.report` assembles the page): the summary rows,
each run's measured GEMMs, its per-layer plan, the guard's moves, the layers that explain a
failing run's gap, and the tensors with the most underflow and overflow, each in the format
it is stored in. Cells are plain text; :func:`table` escapes them into HTML.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from lowprec.analysis.diagnosis import (
    KIND_TEXT,
    Run,
    gemm_operands,
    judged_formats,
    worst,
    worst_overflow,
)
from lowprec.analysis.run_verdicts import compared_vals, references
from lowprec.analysis.tracking import BACKWARD_KINDS
from lowprec.analysis.verdicts import REFERENCE, percent
from lowprec.jobs.attribution import attribute_run
from lowprec.jobs.rundir import CHECKPOINT, RunError

__all__ = [
    "attribution_table",
    "chart_formats",
    "gemm_table",
    "moves_table",
    "plan_table",
    "summary_rows",
    "table",
    "tensor_table",
]


def num(v: Any, fmt: str = "{:.4f}") -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN"
    return fmt.format(v)


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def cell(t: tuple[float, str, dict[str, Any]]) -> str:
    share, fmt, r = t
    return f"{percent(share)} ({fmt}, {r['name']} {KIND_TEXT[r['kind']]})"


def summary_rows(runs: Sequence[Run]) -> list[list[str]]:
    def val(run: Run) -> float | None:  # None: no evaluation yet (or not finite)
        v = run.summary.get("val_loss")
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    rows = []
    for run, ref_run in zip(runs, references(runs), strict=True):
        s = run.summary
        v = val(run)
        gap_cell = REFERENCE if run.is_reference else "–"
        pair = None if ref_run is None else compared_vals(run, ref_run)
        if ref_run is not None and isinstance(pair, tuple) and math.isfinite(pair[0]):
            # against the verdict's reference (a unit-scaled run's: fp32-unit if present),
            # at the same step (an interrupted run's last evaluation)
            at = f", step {pair[2]}" if run.stopped_early and pair[2] >= 0 else ""
            gap_cell = f"{100 * (pair[0] / pair[1] - 1):+.2f}% ({ref_run.recipe}{at})"
        last = run.tracked_steps[-1] if run.numerics else -1
        uf = worst(run, last, "below_normal", BACKWARD_KINDS, own=True)
        of = worst_overflow(run, last)
        casts = gemm_operands(run)
        flush = max(casts, key=lambda t: float(t[2].get("flushed") or 0.0), default=None)
        rows.append(
            [
                run.name,
                run.recipe,
                str(s.get("steps")) + (f" of {run.planned_steps}" if run.stopped_early else ""),
                num(s.get("train_loss")),
                num(v),
                gap_cell,
                str(s.get("skipped_steps", 0)),
                "–" if s.get("diverged_at") is None else f"step {s['diverged_at']}",
                cell(uf[0]) if uf else "–",
                cell(of[0]) if of and of[0][0] else "0",
                "–" if flush is None else flush_cell(flush),
            ]
        )
    return rows


def flush_cell(t: tuple[dict[str, Any], str, dict[str, Any]]) -> str:
    r, role, op = t
    where = f"{r['layer']} {r['gemm']} {role}"
    return f"{percent(op['flushed'])} flushed ({op['format']}, {where})"


def gemm_table(run: Run) -> str:
    """Per layer and GEMM at the last measured step: the formats, the operands' SQNR and
    the flushed and saturated shares (the worst operand of the GEMM), the GEMM's error."""
    if not run.gemms:
        return ""
    step = max(int(r["step"]) for r in run.gemms)
    rows = []
    for r in run.gemms:
        if r["step"] != step:
            continue
        ops = r["operands"]
        fmts = " × ".join(f"{o['format']}" for o in ops.values())
        sq = [o.get("sqnr_db") for o in ops.values()]
        sq_num = [float(v) for v in sq if isinstance(v, (int, float))]
        err = r.get("rel_err")
        rows.append(
            [
                r["layer"],
                r["gemm"],
                fmts,
                "exact"
                if sq_num and min(sq_num) == math.inf
                else num(min(sq_num, default=None), "{:.1f} dB"),
                num(max(float(o.get("flushed") or 0) for o in ops.values()) * 100, "{:.2f}%"),
                percent(max(float(o.get("saturated") or 0) for o in ops.values())),
                num(err, "{:.3g}"),
            ]
        )
    return f"<h3>Low-precision GEMMs, measured (step {step})</h3>" + table(
        [
            "layer",
            "GEMM",
            "formats",
            "SQNR (worst operand)",
            "flushed",
            "saturated",
            "GEMM rel. error",
        ],
        rows,
    )


def attribution_table(run: Run, batches: int = 4) -> str:
    """For a failing run: its lowered layers ranked by how much of the loss each costs,
    measured on its final checkpoint (:func:`lowprec.jobs.attribution.attribute_run`)."""
    if not (run.path / CHECKPOINT).is_file():
        return ""
    try:
        rows = attribute_run(run.path, batches)
    except RunError as e:
        return f"<p>Layers that explain the gap: not measured ({html.escape(str(e))}).</p>"
    if not rows:
        return ""
    base = rows[0]["base"]
    cells = [[r["layer"], f"{r['loss']:.4f}", f"{100 * r['gain']:+.2f}%"] for r in rows[:10]]
    return (
        "<h3>Layers that explain the gap</h3><p>Validation loss on the final checkpoint "
        f"({batches} batches): {base:.4f} as trained; with only that layer in high "
        "precision (the same weights):</p>" + table(["layer", "loss", "loss recovered"], cells)
    )


def chart_formats(run: Run) -> list[str]:
    """The formats whose ranges a run's charts shade: those it stores its tensors in and
    those its low-precision GEMMs cast to (never a format the run did not use)."""
    cast = [op["format"] for _, _, op in gemm_operands(run)]
    return list(dict.fromkeys([run.compute_format, *judged_formats(run), *cast]))


def moves_table(run: Run) -> str:
    """The guard's moves (``lowprec train --guard``): step, layer, from, to, why."""
    if not run.moves:
        return ""
    rows = [[str(m["step"]), m["layer"], m["frm"], m["to"], m["reason"]] for m in run.moves]
    return "<h3>The guard's moves</h3>" + table(["after step", "layer", "from", "to", "why"], rows)


def plan_table(run: Run) -> str:
    """The per-layer rules of the run's recipe (:attr:`lowprec.recipes.Recipe.layers`)."""
    layers = run.recipe_dict.get("layers") or []
    if not layers:
        return ""
    rows = []
    for rule in layers:
        cfg = rule.get("float8")
        if cfg is None:
            what = "high precision"
        else:
            what = str(cfg.get("name") or "custom")
            gemms = cfg.get("gemms") or []
            if gemms:
                what += " (" + ", ".join(f"{g}: {c.get('name', 'custom')}" for g, c in gemms) + ")"
            hp = cfg.get("high_precision_gemms") or []
            if hp:
                what += "; high precision: " + ", ".join(hp)
        rows.append([str(rule.get("pattern")), what])
    return "<h3>Per-layer plan</h3>" + table(["layers", "float8 config"], rows)


def tensor_table(run: Run, step: int, measure: str, title: str) -> str:
    top = [t for t in worst(run, step, measure, own=True) if t[0] > 0][:8]
    if not top:
        return f"<p>{html.escape(title)}: none.</p>"
    rows = [
        [
            r["name"],
            KIND_TEXT[r["kind"]],
            fmt,
            f"{100 * share:.2f}%",
            f"{r['amax']:.3g}",
            f"{r['rms']:.3g}",
        ]
        for share, fmt, r in top
    ]
    return f"<h4>{html.escape(title)}</h4>" + table(
        ["tensor", "kind", "format", "share", "amax", "rms"], rows
    )
