"""Lean training state: bytes per parameter and val loss per recipe, and the study that
chose the 8-bit optimizer-state formats.

Two parts, on the demo model and configuration (``lowprec.jobs.demo.DEMO_CONFIG``: 80
steps, width 64, depth 2, AdamW lr 3e-3, warm-up and cosine decay), at each seed:

* ``recipes``: each recipe trained by the same loop as ``lowprec train``
  (:func:`lowprec.recipes.train_step`, ``cfg.lr_at``); the training state after the last
  step counted by :func:`lowprec.amp.training_state_bytes`; the final val loss (the demo's
  8 val batches) and its gap to ``fp32`` at the same seed;
* ``codecs``: FP32 parameters trained by :class:`lowprec.amp.LeanAdamW` with each pair of
  moment codecs (first moment, second moment: format, square root, rounding), so that
  only the states' storage differs from the ``fp32`` row.

Prints two tables and writes ``--out`` (machine, torch, git revision);
``benchmarks/results/lean_cpu.json`` holds the reference model's run under ``"reference"``
and the Llama run under ``"llama"``. ``--model llama`` (with ``--skip-codecs``) trains an
HF Llama of the same shape instead of the reference model.

    OMP_NUM_THREADS=1 python benchmarks/bench_lean.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lowprec.amp import LeanAdamW, StateCodec, training_state_bytes
from lowprec.jobs.demo import DEMO_CONFIG
from lowprec.jobs.train import evaluate
from lowprec.jobs.train_config import TrainConfig
from lowprec.jobs.train_setup import build
from lowprec.recipes.step import train_step

RECIPES = ["fp32", "bf16", "fp16-pure", "bf16-sr", "bf16-remainder", "bf16-8bit", "fp8-lean"]
E4 = "e4m3"
CODECS: dict[str, tuple[StateCodec, StateCodec]] = {
    "fp32 states": (StateCodec(), StateCodec()),
    "m e4m3, v e4m3": (StateCodec(E4), StateCodec(E4)),
    "m e4m3, sqrt(v) e4m3": (StateCodec(E4), StateCodec(E4, sqrt=True)),
    "m int8, v int8": (StateCodec("int8"), StateCodec("int8")),
    "m int8, sqrt(v) int8": (StateCodec("int8"), StateCodec("int8", sqrt=True)),
    "m int8, sqrt(v) e4m3": (StateCodec("int8"), StateCodec(E4, sqrt=True)),
    "m e4m3, sqrt(v) e4m3, stochastic": (
        StateCodec(E4, rounding="stochastic"),
        StateCodec(E4, sqrt=True, rounding="stochastic"),
    ),
}


def run(cfg: TrainConfig, codecs: tuple[StateCodec, StateCodec] | None = None) -> dict[str, Any]:
    """Train ``cfg`` (with ``codecs``: a LeanAdamW on FP32 parameters instead of the
    recipe's optimizer) and return the val loss, bytes and time per step."""
    prepared, data = build(cfg)
    if codecs is not None:
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        params = [p for p in prepared.model.parameters() if p.requires_grad]
        prepared.optimizer = LeanAdamW(params, lr=cfg.lr, codecs=codecs, generator=gen)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        x, y = data.batch("train", step)
        train_step(prepared, x, y, cfg.lr_at(step), skip_nonfinite=True)
    ms = (time.perf_counter() - t0) / cfg.steps * 1e3
    val = evaluate(prepared, data, cfg.eval_batches)
    return {
        "val_loss": val if math.isfinite(val) else None,
        "ms_per_step": ms,
        "bytes": training_state_bytes(prepared.model, prepared.optimizer),
    }


def _gap(v: float | None, ref: float | None) -> str:
    return "-" if v is None or ref is None else f"{100 * (v / ref - 1):+.2f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--skip-codecs", action="store_true")
    ap.add_argument("--model", default="reference", help="reference or an HF architecture")
    ap.add_argument("--out", default="benchmarks/results/lean_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"recipes": {}, "codecs": {}}
    for name in args.recipes:
        results["recipes"][name] = {
            s: run(replace(DEMO_CONFIG, recipe=name, seed=s, model=args.model)) for s in args.seeds
        }
    if not args.skip_codecs:
        for name, pair in CODECS.items():
            results["codecs"][name] = {
                s: run(replace(DEMO_CONFIG, recipe="fp32", seed=s), pair) for s in args.seeds
            }
    ref = results["recipes"].get("fp32", {})
    print(
        "| recipe | bytes/param | " + " | ".join(f"val loss s{s} (gap)" for s in args.seeds) + " |"
    )
    print("|---|---:|" + "---:|" * len(args.seeds))
    for name, per in results["recipes"].items():
        b = per[args.seeds[0]]["bytes"]["per_param"]
        cells = [
            f"{r['val_loss']:.4f} ({_gap(r['val_loss'], ref.get(s, {}).get('val_loss'))})"
            if r["val_loss"] is not None else "NaN"
            for s, r in per.items()
        ]  # fmt: skip
        print(f"| `{name}` | {b:.2f} | " + " | ".join(cells) + " |")
    ref = results["codecs"].get("fp32 states", {})
    if results["codecs"]:
        print("\n| moment codecs (FP32 params) | " + " | ".join(f"s{s}" for s in args.seeds) + " |")
        for name, per in results["codecs"].items():
            cells = [
                f"{r['val_loss']:.4f} ({_gap(r['val_loss'], ref.get(s, {}).get('val_loss'))})"
                if r["val_loss"] is not None else "NaN"
                for s, r in per.items()
            ]  # fmt: skip
            print(f"| {name} | " + " | ".join(cells) + " |")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    results["meta"] = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "git": rev.stdout.strip(),
        "config": replace(DEMO_CONFIG, model=args.model).to_dict(),
        "seeds": args.seeds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
