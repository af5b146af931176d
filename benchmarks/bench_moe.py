"""MoE models in low precision (issue 33 item 6): for each HF MoE model of ``lowprec train``
and each recipe, the share of the forward FLOPs that float8 modules execute, the val-loss
gap to BF16 and the emulated step time relative to BF16.

Models: ``qwen3moe`` and ``mixtral`` (:mod:`lowprec.jobs.hf_models`: Llama-style
attention, every MLP 8 experts of hidden ``2·width`` as 3-D weights, top-2 routing, the
load-balancing loss added). Rows, each a :class:`~lowprec.recipes.Recipe`: the presets
``bf16`` (the baseline), ``fp8-tensorwise``, ``fp8-rowwise``, ``fp8-delayed``, ``mxfp8``,
``nvfp4``, and ``fp8-tensorwise +attn``: the preset with ``Float8Config.attention =
"tensorwise"`` (attention's QKᵀ and PV in FP8 too), written as a recipe JSON as
``bench_fp4`` writes its rows.

Each (model, row, seed) is one ``lowprec train --model M --recipe <row>.json --seed S``
subprocess (``bench_fp4.run_cmd``: ``OMP_NUM_THREADS=1``, ``--jobs`` at a time); defaults:
width 64, depth 4, 4 heads, batch 8x64 characters, 120 steps, AdamW lr 3e-3 (12 warm-up
steps, cosine to lr/10), the val loss over 8 val batches at the end.

Measured:

* **FP8 FLOP share** (from the shapes, no run): the forward GEMM FLOPs of one step's
  ``N = batch·seq`` tokens, ``2·m·k·n`` per product: every module's own 2-D ``weight``
  that multiplies activations (linears, attention projections, routers, the LM head; the
  token embedding, a lookup, is not a product) ``2·N·out·in``; every 3-D expert weight
  ``(E, a, b)`` ``2·(N·top_k)·a·b`` (the experts receive ``N·top_k`` token rows in all,
  whatever the routing); attention ``2·2·batch·heads·seq²·head_dim`` per layer (QKᵀ and
  PV, the dense products SDPA computes, causal mask included). Biases and elementwise
  work are not counted. The FP8 part: the weights of float8 modules (``Float8Linear``,
  ``Float8Router``, ``Float8Experts``) of the model the recipe's ``prepare`` makes, and
  attention where ``Float8Config.attention`` is set.
* **loss gap**: the final val loss per seed; per row the paired gap (same seed) to
  ``bf16``, ``v / v_bf16 - 1``: mean and sample sd over the seeds, and the seed spread of
  ``bf16`` itself (sample sd / mean); a row is *within the seed spread of BF16* where
  ``|mean gap| <= bf16 spread``.
* **step time**: each run's median step time (``summary.json``); per row the paired ratio
  to ``bf16`` (same model, same seed), mean over the seeds. The runs share the machine
  (with each other and other work): compare ratios, not absolute times. Everything runs
  emulated on the CPU (float8 casts are extra work here, never a speed-up).

Prints the table and writes ``--out`` (default ``benchmarks/results/moe_cpu.json``:
machine, lscpu model and flags, torch, git revision, the configuration and every run).
Finished runs in ``--runs`` are reused (``summary.json`` exists). ``--quick``: a tiny
model, 6 steps, 1 seed, JSON in the temp dir.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py --jobs 2 --runs /tmp/moe_runs

The recorded run and the findings: ``benchmarks/README.md``, "MoE models in low precision".
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from _common import arg_parser, parse_args, print_table, run_record, write_json
from bench_fp4 import (
    DEADLINE,
    LOWPREC,
    add_train_args,
    lscpu,
    paired,
    pct,
    run_cmd,
    train_config,
)
from torch import nn

from lowprec.float8 import Float8Experts, Float8Linear
from lowprec.jobs.rundir import read_metrics
from lowprec.jobs.train_config import TrainConfig
from lowprec.jobs.train_setup import build
from lowprec.recipes import Recipe, get_recipe

MODELS = ("qwen3moe", "mixtral")
BASE = "bf16"
PRESETS = ("bf16", "fp8-tensorwise", "fp8-rowwise", "fp8-delayed", "mxfp8", "nvfp4")
ATTN = "fp8-tensorwise +attn"


def recipes() -> dict[str, Recipe]:
    """The rows: the presets, and fp8-tensorwise with FP8 attention (module docstring)."""
    rows = {n: get_recipe(n) for n in PRESETS}
    tw = get_recipe("fp8-tensorwise")
    assert tw.float8 is not None
    cfg = tw.float8.replace(name="fp8-tensorwise+attn", attention="tensorwise")
    rows[ATTN] = replace(tw, name="fp8-tensorwise+attn",
                         description="fp8-tensorwise, attention's QKᵀ and PV in FP8 (tensorwise)",
                         technique=(cfg,))  # fmt: skip
    return rows


# ---- FLOPs ------------------------------------------------------------------------------------


def flop_share(model: str, recipe: Recipe, train: dict[str, Any]) -> dict[str, Any]:
    """The forward GEMM FLOPs of one step of ``model`` prepared with ``recipe`` and the
    share float8 modules execute, by kind (module docstring's formula)."""
    cfg = TrainConfig(model=model, recipe=recipe, width=train["width"], depth=train["depth"],
                      heads=train["heads"], seq_len=train["seq_len"],
                      batch_size=train["batch_size"])  # fmt: skip
    prepared, _ = build(cfg)
    net = prepared.model
    hf = net.model.config
    n_tok = train["batch_size"] * train["seq_len"]
    top_k = int(getattr(hf, "num_experts_per_tok", 1))
    kinds: dict[str, list[float]] = {}  # kind -> [total, in fp8]

    def add(kind: str, flops: float, fp8: bool) -> None:
        k = kinds.setdefault(kind, [0.0, 0.0])
        k[0] += flops
        k[1] += flops if fp8 else 0.0

    for name, mod in net.named_modules():
        if isinstance(mod, nn.Embedding):
            continue
        fp8 = isinstance(mod, (Float8Linear, Float8Experts))
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() == 3:  # (E, a, b) expert weights: N·top_k rows in all
                add("experts", 2.0 * n_tok * top_k * p.shape[1] * p.shape[2], fp8)
            elif p.dim() == 2 and pname == "weight":
                kind = ("router" if name.endswith(("gate", "router")) else
                        "lm_head" if name.endswith("lm_head") else "attention proj")  # fmt: skip
                add(kind, 2.0 * n_tok * p.numel(), fp8)
    heads = int(hf.num_attention_heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    f8 = recipe.float8
    attn = 2 * 2.0 * train["batch_size"] * heads * train["seq_len"] ** 2 * head_dim
    add("attention QKᵀ/PV", attn * int(hf.num_hidden_layers),
        f8 is not None and f8.attention is not None)  # fmt: skip
    total = sum(k[0] for k in kinds.values())
    fp8_total = sum(k[1] for k in kinds.values())
    return {
        "gflops": total / 1e9,
        "fp8_share": fp8_total / total,
        "by_kind": {k: {"gflops": v[0] / 1e9, "share_of_total": v[0] / total,
                        "fp8_share": v[1] / v[0]} for k, v in kinds.items()},
    }  # fmt: skip


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(__doc__, quick="tiny model, 6 steps, 1 seed, JSON in the temp dir")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rows", nargs="+", default=None, help="row names (default: all)")
    add_train_args(p, steps=120, batch_size=8, lr=3e-3, warmup=12, eval_batches=8)
    a = parse_args(p, argv, "moe_cpu")
    seeds = a.seeds[:1] if a.quick else a.seeds
    train_cfg = train_config(a)
    rows = recipes()
    names = a.rows or list(rows)
    unknown = [n for n in names if n not in rows]
    if unknown:
        p.error(f"--rows: unknown {unknown}; valid: {list(rows)}")
    if BASE not in names:
        names.insert(0, BASE)
    root = Path(a.runs) if a.runs else Path(tempfile.mkdtemp(prefix="bench_moe_"))
    (root / "recipes").mkdir(parents=True, exist_ok=True)
    print(f"runs in {root}")
    t_start = time.perf_counter()
    if a.budget_s is not None:
        DEADLINE[0] = t_start + a.budget_s
    files: dict[str, Path] = {}
    for n in names:
        files[n] = root / "recipes" / f"{n.replace(' ', '_')}.json"
        files[n].write_text(json.dumps(rows[n].to_dict(), indent=1) + "\n")
    flops = {m: {n: flop_share(m, rows[n], train_cfg) for n in names} for m in a.models}
    pool = ThreadPoolExecutor(max(1, a.jobs))
    jobs: dict[tuple[str, str, int], tuple[list[str], Path, Any]] = {}
    slow = ("nvfp4", "mxfp8")  # the slowest emulations first: the pool ends on short runs
    for s in seeds:
        for n in sorted(names, key=lambda n: n not in slow):
            for m in a.models:
                out = root / m / f"seed{s}" / n.replace(" ", "_")
                cmd = [*LOWPREC, "train", "--model", m, "--recipe", str(files[n]),
                       "--seed", str(s), "--out", str(out), "--no-progress"]  # fmt: skip
                for k, v in train_cfg.items():
                    cmd += ["--" + k.replace("_", "-"), str(v)]
                out.parent.mkdir(parents=True, exist_ok=True)
                log = out.parent / f"{out.name}.log"
                jobs[m, n, s] = (cmd, out, pool.submit(run_cmd, cmd, log, out / "summary.json"))
    runs: dict[str, dict[str, dict[str, Any]]] = {m: {n: {} for n in names} for m in a.models}
    for (m, n, s), (cmd, out, fut) in jobs.items():
        rc, secs = fut.result()
        entry: dict[str, Any] = {"rc": rc, "wall_s": secs, "command": " ".join(cmd[1:])}
        try:
            recs = read_metrics(out)
            vals = [x["val_loss"] for x in recs if "val_loss" in x]
            done = len(recs) == train_cfg["steps"] and vals and math.isfinite(vals[-1])
            entry["val_loss"] = float(vals[-1]) if done else None
            entry["step_time_ms"] = json.loads((out / "summary.json").read_text())["step_time_ms"]
        except Exception as e:  # a failed or left-out run: no value, with the reason
            entry.update(val_loss=None, step_time_ms=None, error=repr(e))
        runs[m][n][str(s)] = entry
    pool.shutdown()

    summary: dict[str, dict[str, Any]] = {}
    table = []
    for m in a.models:

        def col(n: str, key: str, m: str = m) -> list[Any]:
            return [runs[m][n][str(s)].get(key) for s in seeds]

        base_v = [x for x in col(BASE, "val_loss") if x is not None]
        spread = (statistics.stdev(base_v) / statistics.fmean(base_v)
                  if len(base_v) > 1 else None)  # fmt: skip
        summary[m] = {"bf16_seed_spread": spread, "rows": {}}
        for n in names:
            v = col(n, "val_loss")
            ok = [x for x in v if x is not None]
            t, tb = col(n, "step_time_ms"), col(BASE, "step_time_ms")
            ratios = [x / y for x, y in zip(t, tb, strict=True) if x and y]
            gap = paired(v, col(BASE, "val_loss"))
            within = (None if gap["mean"] is None or spread is None or n == BASE
                      else abs(gap["mean"]) <= spread)  # fmt: skip
            sm = {
                "fp8_flop_share": flops[m][n]["fp8_share"],
                "val_loss": v,
                "mean": statistics.fmean(ok) if ok else None,
                "sd": statistics.stdev(ok) if len(ok) > 1 else None,
                "gap_bf16": gap,
                "within_bf16_seed_spread": within,
                "step_time_ms": t,
                "step_time_ratio": statistics.fmean(ratios) if ratios else None,
            }
            summary[m]["rows"][n] = sm
            table.append([m, n, pct(sm["fp8_flop_share"]), sm["mean"], pct(gap["mean"]),
                          pct(gap["sd"]), pct(spread), sm["step_time_ratio"]])  # fmt: skip
    c = train_cfg
    print_table(
        "MoE models: FP8 FLOP share, val loss and step time against bf16",
        ["model", "row", "FP8 FLOPs %", "val loss", "gap %", "sd", "bf16 spread %",
         "step time x bf16"],
        table,
        f"{c['steps']} steps, batch {c['batch_size']}x{c['seq_len']}, width {c['width']}, "
        f"depth {c['depth']}, heads {c['heads']}, lr {c['lr']}, seeds {seeds}; gap: paired "
        "(same seed) mean and sample sd; bf16 spread: its sd / mean; emulated on the CPU",
    )  # fmt: skip
    total_s = time.perf_counter() - t_start
    print(f"total {total_s:.0f} s")
    record = run_record(
        "moe", "cpu", lscpu=lscpu(), seeds=seeds, jobs=a.jobs, threads_per_job=1,
        models=a.models, train=train_cfg, rows={n: rows[n].to_dict() for n in names},
        flops=flops, summary=summary, runs=runs, total_s=total_s,
        argv=sys.argv[1:] if argv is None else argv,
    )  # fmt: skip
    print(f"JSON: {write_json(record, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
