"""The demo: train the reference model once per recipe and compare.

Every recipe gets the same seed, data, model shape, optimizer and steps. The demo prints a
table (final train and val loss, bits per character, skipped steps, share of zero gradient
values, step time, val-loss gap to FP32), writes a loss-curve PNG and ``results.json``.
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

from lowprec.recipes import get_recipe
from lowprec.train import RunError, TrainConfig, read_metrics, train

__all__ = ["DEMO_CONFIG", "DEMO_RECIPES", "QUICK_CONFIG", "plot_runs", "run_demo"]

DEMO_RECIPES = (
    "fp32", "bf16", "amp-bf16", "fp16", "fp16-static-ls", "fp16-dynamic-ls",
    "fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8",
)

# 4096 characters a batch: the mean loss makes each logit's gradient about p/4096, so
# with a width of 64 most FP16 activation gradients are subnormal (see the README).
DEMO_CONFIG = TrainConfig(
    steps=300, batch_size=32, seq_len=128, width=64, depth=2, heads=4, lr=3e-3, warmup=20,
    eval_every=50, eval_batches=16, ckpt_every=100,
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
    """Train each recipe into ``out/<recipe>``; print the table, write the plot and JSON.

    ``out`` must not exist or be empty (nothing on disk is overwritten). ``config``
    replaces the demo's configuration (its ``recipe`` field is ignored).
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunError(f"output directory {out} already exists; choose another --out")
    for r in recipes:
        get_recipe(r)
    console = console or Console()
    base = config or (QUICK_CONFIG if quick else DEMO_CONFIG)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    for r in recipes:
        results.append(train(replace(base, recipe=r), out / r, progress=progress))
    for base_name in ("fp32", "bf16"):  # bf16 is the float8 recipes' reference
        ref = next((s["val_loss"] for s in results if s["recipe"] == base_name), None)
        for s in results:
            s[f"val_gap_to_{base_name}"] = None if ref is None else s["val_loss"] / ref - 1.0
    console.print(results_table(results, base, time.perf_counter() - t0))
    png = out / "loss_curves.png"
    plot_runs([out / r for r in recipes], png)
    (out / "results.json").write_text(
        json.dumps({"config": base.to_dict(), "results": results}, indent=2)
    )
    console.print(f"loss curves: {png}\nresults: {out / 'results.json'}")
    return results


def results_table(results: list[dict[str, Any]], cfg: TrainConfig, seconds: float) -> Table:
    table = Table(
        title=(
            f"lowprec demo: {cfg.steps} steps, batch {cfg.batch_size}x{cfg.seq_len}, "
            f"width {cfg.width}, depth {cfg.depth}, lr {cfg.lr}, seed {cfg.seed} "
            f"({seconds:.0f} s)"
        )
    )
    for col in (
        "recipe", "train loss", "val loss", "val bpc", "gap to fp32", "gap to bf16", "skipped",
        "act-grad underflow", "act-grad zeros", "ms/step",
    ):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    for s in results:
        gaps = [s.get("val_gap_to_fp32"), s.get("val_gap_to_bf16")]
        table.add_row(
            s["recipe"],
            f"{s['train_loss']:.4f}",
            f"{s['val_loss']:.4f}",
            f"{s['val_bpc']:.3f}",
            *("-" if g is None or not math.isfinite(g) else f"{100 * g:+.2f}%" for g in gaps),
            str(s["skipped_steps"]),
            f"{100 * s['act_grad_underflow']:.1f}%",
            f"{100 * s['act_grad_zero']:.2f}%",
            f"{s['step_time_ms']:.0f}",
        )
    return table


def plot_runs(runs: Sequence[str | Path], path: str | Path) -> None:
    """Four panels for several runs: loss curves (train EMA, val dots), the val-loss gap to
    the first run, the share of activation gradients below their dtype's smallest normal,
    and the loss scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 7.5), dpi=110)
    FigureCanvasAgg(fig)
    (ax, ax_gap), (ax_uf, ax_s) = fig.subplots(2, 2)
    ref: dict[int, float] = {}
    for k, run in enumerate(runs):
        recs = read_metrics(run)
        name = Path(run).name
        steps = [r["step"] for r in recs]
        (line,) = ax.plot(steps, _ema([r["loss"] for r in recs], 0.9), lw=1.3, label=name)
        color = line.get_color()
        vals = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
        if vals:
            ax.plot(list(vals), list(vals.values()), "o", ms=3, color=color)
        if k == 0:
            ref = vals
        common = [s for s in vals if s in ref]
        ax_gap.plot(common, [100 * (vals[s] / ref[s] - 1) for s in common], "o-", ms=3,
                    lw=1.2, color=color, label=name)
        uf = [(r["step"], 100 * r["act_grad_underflow"]) for r in recs if "act_grad_underflow" in r]
        if uf:
            ax_uf.plot(*zip(*uf, strict=True), lw=1.2, color=color, label=name)
        ax_s.plot(steps, [r["loss_scale"] for r in recs], lw=1.3, color=color, label=name)
    first = Path(runs[0]).name if runs else ""
    ax.set(xlabel="step", ylabel="loss (nats/char)", title="train loss (EMA 0.9) and val (dots)")
    ax_gap.axhline(0.0, color="black", lw=0.8)
    ax_gap.axhspan(-1.0, 1.0, color="green", alpha=0.08, label="±1%")
    ax_gap.set(xlabel="step", ylabel="%", title=f"val loss gap to {first}")
    ax_uf.set(xlabel="step", ylabel="% of values", ylim=(-2, 102),
              title="activation gradients below the smallest normal (underflow)")
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
