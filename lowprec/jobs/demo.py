"""The demo: train the reference model once per recipe and compare.

Every recipe gets the same seed, data, model shape, optimizer and steps. The demo prints a
table (final train and val loss, bits per character, skipped steps, share of zero gradient
values, step time, val-loss gap to FP32), writes a loss-curve PNG and ``results.json``.

The demo is the composition of two jobs through their public functions: the training job
(:func:`lowprec.jobs.train.train`, once per recipe into ``out/<recipe>``) and the report
job (:func:`lowprec.jobs.report.write_report` over those run directories). It shares
nothing else with them but the run directory's layout (:mod:`lowprec.jobs.rundir`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lowprec.jobs.report import plot_runs, write_report
from lowprec.jobs.rundir import make_new_dir, summary_cells
from lowprec.jobs.train import TrainConfig, train
from lowprec.recipes import get_recipe

__all__ = ["DEMO_CONFIG", "DEMO_RECIPES", "GAP_REFERENCES", "QUICK_CONFIG", "run_demo"]

DEMO_RECIPES = (
    "fp32",
    "bf16",
    "amp-bf16",
    "fp16",
    "fp16-static-ls",
    "fp16-dynamic-ls",
    "fp8-tensorwise",
    "fp8-delayed",
    "fp8-rowwise",
    "mxfp8",
    "fp32-unit",
    "fp16-unit",
    "bf16-unit",
    "fp8-unit",
    "fp16-scalify",
    "fp8-scalify",
)
# Each recipe's loss gap is shown against these references, where the run has them: fp32
# for all, bf16 for the float8 recipes (BF16 master compute), fp32-unit for the unit-scaled.
GAP_REFERENCES = ("fp32", "bf16", "fp32-unit")

# 4096 characters a batch: the mean loss makes each logit's gradient about p/4096, so
# with a width of 64 most FP16 activation gradients are subnormal (see the README).
DEMO_CONFIG = TrainConfig(
    steps=300,
    batch_size=32,
    seq_len=128,
    width=64,
    depth=2,
    heads=4,
    lr=3e-3,
    warmup=20,
    eval_every=50,
    eval_batches=16,
    ckpt_every=100,
)
QUICK_CONFIG = replace(
    DEMO_CONFIG, steps=40, batch_size=8, seq_len=64, eval_every=20, eval_batches=2
)


def run_demo(
    out: str | Path,
    quick: bool = False,
    recipes: Sequence[str] = DEMO_RECIPES,
    console: Console | None = None,
    progress: bool = True,
    config: TrainConfig | None = None,
) -> list[dict[str, Any]]:
    """Train each recipe into ``out/<recipe>``; print the table, write the plot, the JSON
    and the HTML report (``out/report.html``, :func:`lowprec.jobs.report.write_report`).

    ``out`` must not exist or be empty (nothing on disk is overwritten). ``config``
    replaces the demo's configuration (its ``recipe`` field is ignored).
    """
    out = Path(out)
    for r in recipes:
        get_recipe(r)
    make_new_dir(out, "choose another --out")
    console = console or Console()
    base = config or (QUICK_CONFIG if quick else DEMO_CONFIG)
    results = []
    t0 = time.perf_counter()
    for r in recipes:
        results.append(train(replace(base, recipe=r), out / r, progress=progress))
    for base_name in GAP_REFERENCES:
        ref = next((s["val_loss"] for s in results if s["recipe"] == base_name), None)
        for s in results:
            s[f"val_gap_to_{base_name}"] = None if ref is None else s["val_loss"] / ref - 1.0
    console.print(results_table(results, base, time.perf_counter() - t0))
    png = out / "loss_curves.png"
    plot_runs([out / r for r in recipes], png)
    (out / "results.json").write_text(
        json.dumps({"config": base.to_dict(), "results": results}, indent=2)
    )
    report = write_report(
        [out / r for r in recipes],
        out / "report.html",
        title=f"lowprec demo ({len(recipes)} recipes)",
    )
    console.print(f"loss curves: {png}\nresults: {out / 'results.json'}")
    console.print(f"report: {report}  (open it in a browser)")
    return results


def results_table(results: list[dict[str, Any]], cfg: TrainConfig, seconds: float) -> Table:
    table = Table(
        title=(
            f"lowprec demo: {cfg.steps} steps, batch {cfg.batch_size}x{cfg.seq_len}, "
            f"width {cfg.width}, depth {cfg.depth}, lr {cfg.lr}, seed {cfg.seed} "
            f"({seconds:.0f} s)"
        )
    )
    cols = ["recipe", "train loss", "val loss", "val bpc"]
    tail = ["skipped", "act-grad underflow", "act-grad zeros", "ms/step"]
    for col in (*cols, *(f"gap to {r}" for r in GAP_REFERENCES), *tail):
        if col == "recipe":  # never wrapped or cut: the name is what a reader looks for
            table.add_column(col, no_wrap=True, min_width=max(len(s["recipe"]) for s in results))
        else:
            table.add_column(col, justify="right")
    for s in results:
        cells = summary_cells(s)
        gaps = [s.get(f"val_gap_to_{r}") for r in GAP_REFERENCES]
        table.add_row(
            *(cells[c] for c in cols),
            *("-" if g is None or not math.isfinite(g) else f"{100 * g:+.2f}%" for g in gaps),
            *(cells[c] for c in tail),
        )
    return table
