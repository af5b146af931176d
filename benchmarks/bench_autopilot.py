"""Evidence for the autopilot: tuned plans against every uniform recipe, and on outliers.

Part 1. For each model (default: the demo's reference CharGPT, and the HF architectures
``llama`` and ``qwen2`` of ``lowprec train --model``), ``lowprec tune --target T`` writes a
plan per target (default ``b200`` and ``h100``; tuned once, at seed 0, on 2 batches of 8
sequences: the command's defaults), then ``lowprec train`` trains the model with every
uniform recipe (``fp32``, ``bf16``, ``fp8-tensorwise``, ``fp8-rowwise``, ``fp8-blockwise``,
``mxfp8``, ``mxfp4``, ``nvfp4``) and with each plan (``--recipe plan.json``) at each seed
(default 0, 1, 2). The training configuration is the demo's (``DEMO_CONFIG``: 80 steps,
batch 32x128, width 64, depth 2, 4 heads, lr 3e-3, 16 warm-up steps, val loss over 8
batches); ``--hf-steps`` / ``--hf-batch-size`` / ``--hf-seq-len`` shrink the HF runs if
needed. Every run is a subprocess (``OMP_NUM_THREADS=1``), ``--jobs`` (default 2) at a time.

Recorded per run: the final val loss, and the median step time of the steady steps (after
the first 10, before the last: ``lowprec.jobs.demo.steady_step_ms``). Per recipe: the val
loss per seed, its mean, the gap to ``fp32`` per seed (paired: same seed) with its mean and
sample standard deviation over the seeds, and fp32's own seed spread. The modelled GEMM
cost on each target (``lowprec.autopilot.cost.gemm_cost``: all-BF16 = 1) counts the FLOPs
of every linear layer of the model (``counting_flops`` on one training batch) and lowers
the GEMMs of the layers the recipe really converts (``prepare``, then the float8 linears
found in the model): the head that the uniform recipes keep in BF16 is counted at BF16. A
plan's cost is recomputed the same way from its per-GEMM formats, on both targets.

Part 2 (outliers, ``lowprec.jobs.outliers``): per seed, the reference model (width 64,
depth 2, 4 heads, 64 characters, batch 16, as ``tests/autopilot/test_outliers_cli.py``) is
trained 60 FP32 steps at lr 3e-3, given outlier channels (``add_outliers``: 10³, one per
16-element block, at the inputs of each block's ``attn.qkv`` and ``fc``; the function is
unchanged), tuned for each target, and evaluated (val loss over 8 batches, no further
training: ``add_outliers`` advises against training on with Adam) in ``fp32``, ``bf16``,
``fp8-tensorwise``, ``mxfp4``, ``nvfp4`` and each plan. Recorded: the val losses, and which
layers' GEMMs each plan keeps out of FP4.

All CPU times are emulation on the CPU (no FP8/FP4 hardware): the ms/step are not the speed
of any format, only what the benchmark cost. Run from a ``git archive`` snapshot with
``LOWPREC_SNAPSHOT_OF=<commit>`` set, the JSON records that commit as the revision.
``--quick``: a tiny model, 6 steps, 1 seed,
the reference model only, JSON in the temp dir.
"""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _common import arg_parser, parse_args, print_table, run_record, write_json

from lowprec.autopilot import Plan
from lowprec.autopilot.cost import GEMMS, counting_flops, gemm_cost
from lowprec.jobs.data import CharData
from lowprec.jobs.demo import DEMO_CONFIG, steady_step_ms
from lowprec.jobs.model import ModelConfig, build_model
from lowprec.jobs.rundir import read_metrics
from lowprec.jobs.train import TrainConfig
from lowprec.recipes import prepare

UNIFORM = (
    "fp32",
    "bf16",
    "fp8-tensorwise",
    "fp8-rowwise",
    "fp8-blockwise",
    "mxfp8",
    "mxfp4",
    "nvfp4",
)
OUTLIER_RECIPES = ("fp32", "bf16", "fp8-tensorwise", "mxfp4", "nvfp4")
FP4 = ("mxfp4", "nvfp4")
LOWPREC = [str(Path(sys.executable).with_name("lowprec"))]
TRAIN_FLAGS = ("steps", "batch_size", "seq_len", "width", "depth", "heads", "lr", "warmup",
               "eval_every", "eval_batches", "ckpt_every")  # fmt: skip


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


DEADLINE = [math.inf]  # perf_counter time after which no new run starts (--budget-s)


def run_cmd(cmd: list[str], log: Path, done: Path | None = None) -> tuple[int, float]:
    """Run ``cmd`` with one OpenMP thread, its output to ``log``; (exit code, seconds).
    Not run where ``done`` exists (a finished run of an earlier invocation: rc 0, NaN
    seconds) or past the deadline (rc -1)."""
    if done is not None and done.exists():
        return 0, math.nan
    t0 = time.perf_counter()
    if t0 > DEADLINE[0]:
        return -1, 0.0
    with open(log, "w") as f:
        rc = subprocess.call(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    return rc, time.perf_counter() - t0


# ---- costs ------------------------------------------------------------------------------


def model_flops(model_name: str, cfg: TrainConfig) -> dict[tuple[str, str], float]:
    """FLOPs of every GEMM of every linear layer on one training batch."""
    torch.manual_seed(0)
    data = CharData(cfg.seq_len, cfg.batch_size, seed=0)
    model = build_model(model_name, cfg.model_config(data.vocab_size))
    with counting_flops(model) as flops, torch.no_grad():
        model(*data.batch("train", 0))
    return flops


def converted_layers(model_name: str, cfg: TrainConfig, recipe: str) -> list[str]:
    """The linear layers ``prepare(model, recipe)`` turns into float8 linears."""
    from lowprec.float8 import Float8Linear

    torch.manual_seed(0)
    model = build_model(model_name, cfg.model_config(65))
    prepared = prepare(copy.deepcopy(model), recipe)
    return [n for n, m in prepared.model.named_modules() if isinstance(m, Float8Linear)]


def uniform_cost(
    flops: dict[tuple[str, str], float], layers: list[str], recipe: str, target: str
) -> float | None:
    if recipe == "fp32":
        return None  # the reference: FP32 GEMMs are not in the cost model
    if recipe == "bf16":
        return 1.0
    missing = [fqn for fqn in layers if (fqn, "forward") not in flops]
    if missing:
        raise RuntimeError(f"{recipe}: converted layers not counted: {missing}")
    return gemm_cost(flops, {(fqn, g): recipe for fqn in layers for g in GEMMS}, target)


def plan_choice(plan: Plan) -> dict[tuple[str, str], str]:
    return {(fqn, g): str(d["gemms"][g]["format"]) for fqn, d in plan.layers.items()
            for g in GEMMS}  # fmt: skip


def kept_out_of_fp4(plan: Plan) -> dict[str, list[str]]:
    """``{layer: [its GEMMs not in an FP4 format]}`` for the layers with any."""
    out: dict[str, list[str]] = {}
    for fqn, d in plan.layers.items():
        kept = [f"{g}={d['gemms'][g]['format']}" for g in GEMMS
                if d["gemms"][g]["format"] not in FP4]  # fmt: skip
        if kept:
            out[fqn] = kept
    return out


# ---- part 2: one outlier seed (run as a subprocess: --outlier-worker) -------------------


def outlier_worker(seed: int, targets: list[str], out: Path, quick: bool) -> None:
    from lowprec.autopilot import tune
    from lowprec.jobs.model import CharGPT
    from lowprec.jobs.outliers import add_outliers
    from lowprec.recipes.step import train_step

    torch.set_num_threads(1)
    seq, batch, width, steps, evals = (16, 4, 32, 4, 2) if quick else (64, 16, 64, 60, 8)
    data = CharData(seq, batch, seed=seed)
    torch.manual_seed(seed)
    model = CharGPT(ModelConfig(data.vocab_size, width, 2, 4, seq))
    run = prepare(model, "fp32", lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    for step in range(steps):
        train_step(run, *data.batch("train", step), 3e-3)
    add_outliers(model)

    def val_loss(recipe: Any) -> float:
        p = prepare(copy.deepcopy(model), recipe)
        p.model.eval()
        with torch.no_grad(), p.compute():
            return sum(float(p.model(*data.batch("val", i))[1]) for i in range(evals)) / evals

    res: dict[str, Any] = {"seed": seed, "val_loss": {}, "plans": {}}
    for r in OUTLIER_RECIPES:
        res["val_loss"][r] = val_loss(r)
    batches = [data.batch("train", 1000 + i) for i in range(2)]
    for target in targets:
        t0 = time.perf_counter()
        plan = tune(model, batches, loss_fn=lambda m, b: m(*b)[1], target=target, seed=seed)
        tune_s = time.perf_counter() - t0
        name = f"plan-{target}"
        res["val_loss"][name] = val_loss(plan.recipe)
        res["plans"][name] = {
            "cost": plan.cost,
            "tune_s": tune_s,
            "formats": plan.formats(),
            "kept_out_of_fp4": kept_out_of_fp4(plan),
            "measured": plan.measured,
        }
    out.write_text(json.dumps(res, indent=1, default=str))


# ---- the main benchmark -------------------------------------------------------------------


def stats(all_vals: list[float | None], all_ref: list[float | None]) -> dict[str, Any]:
    """Over the seeds where both runs ran (``None``: left out by --budget-s)."""
    pairs = [(v, r) for v, r in zip(all_vals, all_ref, strict=True)
             if v is not None and r is not None]  # fmt: skip
    vals, ref = [v for v, _ in pairs], [r for _, r in pairs]
    if not vals:
        return {"val_loss": all_vals, "mean": None, "gap": [], "gap_mean": None,
                "gap_sd": None, "n": 0}  # fmt: skip
    gaps = [v / r - 1 for v, r in zip(vals, ref, strict=True)]
    finite = all(math.isfinite(v) for v in vals)
    sd = statistics.stdev(gaps) if len(gaps) > 1 and finite else None
    return {
        "val_loss": all_vals,
        "n": len(vals),
        "mean": statistics.fmean(vals) if finite else math.nan,
        "gap": gaps,
        "gap_mean": statistics.fmean(gaps) if finite else math.nan,
        "gap_sd": sd,
    }


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(__doc__, quick="tiny model, 6 steps, 1 seed, reference model only")
    p.add_argument("--models", nargs="+", default=["reference", "llama", "qwen2"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--targets", nargs="+", default=["b200", "h100"])
    p.add_argument("--jobs", type=int, default=2, help="training subprocesses at a time")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no run after this many seconds (those left out: rc -1)")  # fmt: skip
    p.add_argument("--hf-steps", type=int, default=None, help="steps of the HF runs")
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--hf-seq-len", type=int, default=None)
    p.add_argument("--outlier-seeds", type=int, nargs="*", default=None,
                   help="seeds of part 2 (default: --seeds)")  # fmt: skip
    p.add_argument("--runs", default=None, help="folder for the runs (default: a temp dir)")
    p.add_argument("--outlier-worker", type=int, default=None, help=argparse_hidden())
    p.add_argument("--worker-out", default=None, help=argparse_hidden())
    a = parse_args(p, argv, "autopilot_cpu")
    if a.outlier_worker is not None:
        outlier_worker(a.outlier_worker, a.targets, Path(a.worker_out), a.quick)
        return 0
    t_start = time.perf_counter()
    if a.budget_s is not None:
        DEADLINE[0] = t_start + a.budget_s
    base = DEMO_CONFIG
    models, seeds = a.models, a.seeds
    if a.quick:
        base = replace(base, steps=6, batch_size=4, seq_len=32, width=32, depth=1,
                       heads=2, warmup=2, eval_every=6, eval_batches=2, ckpt_every=6)  # fmt: skip
        models, seeds = ["reference"], seeds[:1]
    outlier_seeds = seeds if a.outlier_seeds is None else a.outlier_seeds
    cfgs = {m: base for m in models}
    for m in models:
        if m != "reference":
            cfgs[m] = replace(base, steps=a.hf_steps or base.steps,
                              batch_size=a.hf_batch_size or base.batch_size,
                              seq_len=a.hf_seq_len or base.seq_len)  # fmt: skip
            if cfgs[m].eval_every > cfgs[m].steps:
                cfgs[m] = replace(cfgs[m], eval_every=cfgs[m].steps)
    root = Path(a.runs) if a.runs else Path(tempfile.mkdtemp(prefix="bench_autopilot_"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"runs in {root}")
    # the uniform recipes' costs, before any subprocess starts
    torch.set_num_threads(1)
    costs: dict[str, dict[str, dict[str, float | None]]] = {}
    for m in models:
        flops = model_flops(m, cfgs[m])
        costs[m] = {}
        for r in UNIFORM:
            layers = [] if r in ("fp32", "bf16") else converted_layers(m, cfgs[m], r)
            costs[m][r] = {t: uniform_cost(flops, layers, r, t) for t in a.targets}
    pool = ThreadPoolExecutor(max(1, a.jobs))

    # tune (each model, each target) and the outlier seeds first
    tune_jobs = {}
    for m in models:
        c = cfgs[m]
        for t in a.targets:
            cmd = [*LOWPREC, "tune", "--target", t, "--model", m, "--width", str(c.width),
                   "--depth", str(c.depth), "--heads", str(c.heads), "--seq-len",
                   str(c.seq_len), "--out", str(root / m / f"plan-{t}.json")]  # fmt: skip
            (root / m).mkdir(parents=True, exist_ok=True)
            log, plan = root / m / f"tune-{t}.log", root / m / f"plan-{t}.json"
            tune_jobs[m, t] = (cmd, pool.submit(run_cmd, cmd, log, plan))
    recipes = [*UNIFORM, *(f"plan-{t}" for t in a.targets)]
    train_jobs: dict[tuple[str, str, int], Any] = {}

    def submit_train(m: str, r: str, s: int) -> None:
        c = cfgs[m]
        rec = str(root / m / f"{r}.json") if r.startswith("plan-") else r
        out = root / m / f"seed{s}" / r
        cmd = [*LOWPREC, "train", "--recipe", rec, "--model", m, "--seed", str(s),
               "--out", str(out), "--no-progress"]  # fmt: skip
        for f in TRAIN_FLAGS:
            cmd += [flag(f), str(getattr(c, f))]
        out.parent.mkdir(parents=True, exist_ok=True)
        log = out.parent / f"{r}.log"
        train_jobs[m, r, s] = (cmd, out, pool.submit(run_cmd, cmd, log, out / "summary.json"))

    outlier_jobs = {}

    def submit_outliers() -> None:
        for s in outlier_seeds:
            out = root / "outliers" / f"seed{s}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, "--outlier-worker", str(s), "--worker-out",
                   str(out), "--targets", *a.targets]  # fmt: skip
            cmd += ["--quick"] if a.quick else []
            outlier_jobs[s] = (out, pool.submit(run_cmd, cmd, out.with_suffix(".log"), out))

    tune_s = {}
    for (m, t), (cmd, fut) in tune_jobs.items():
        rc, secs = fut.result()
        if rc != 0:
            raise SystemExit(f"tune failed ({rc}): {' '.join(cmd)}; see {root / m}")
        tune_s[f"{m}/{t}"] = secs
        print(f"tuned {m} for {t} in {secs:.0f} s")

    # the plans' costs on every target, from their per-GEMM formats and FLOPs
    plans: dict[str, dict[str, Any]] = {}
    for m in models:
        plans[m] = {}
        for t in a.targets:
            plan = Plan.load(root / m / f"plan-{t}.json")
            choice = plan_choice(plan)
            pflops = {k: float(plan.layers[k[0]]["gemms"][k[1]]["flops"]) for k in choice}
            costs[m][f"plan-{t}"] = {tt: gemm_cost(pflops, choice, tt) for tt in a.targets}
            plans[m][f"plan-{t}"] = {
                "cost": plan.cost,
                "formats": plan.formats(),
                "kept_out_of_fp4": kept_out_of_fp4(plan),
                "measured": plan.measured,
                "moved": list(plan.moved),
            }

    # seed by seed, every model, the plans first (a run past --budget-s is left out); the
    # outlier seeds after the first seed
    order = [*(f"plan-{t}" for t in a.targets), "fp32", "bf16", "nvfp4", "mxfp4",
             "fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "mxfp8"]  # fmt: skip
    for i, s in enumerate(seeds):
        for m in models:
            for r in order:
                submit_train(m, r, s)
        if i == 0:
            submit_outliers()

    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for (m, r, s), (cmd, out, fut) in train_jobs.items():
        rc, secs = fut.result()
        entry: dict[str, Any] = {"rc": rc, "wall_s": secs, "command": " ".join(cmd[1:])}
        if rc == -1:  # left out: past --budget-s
            entry.update(val_loss=None, ms_per_step=None)
            runs.setdefault(m, {}).setdefault(r, {})[str(s)] = entry
            continue
        try:
            recs = read_metrics(out)
            vals = [x["val_loss"] for x in recs if "val_loss" in x]
            entry["val_loss"] = float(vals[-1]) if vals and len(recs) == cfgs[m].steps else math.nan
            entry["ms_per_step"] = steady_step_ms(recs)
        except Exception as e:  # a failed run: NaN, with the reason
            entry.update(val_loss=math.nan, ms_per_step=math.nan, error=repr(e))
        runs.setdefault(m, {}).setdefault(r, {})[str(s)] = entry
    outliers = {}
    for s, (out, fut) in outlier_jobs.items():
        rc, secs = fut.result()
        outliers[str(s)] = (json.loads(out.read_text()) if rc == 0
                            else {"rc": rc, "log": str(out.with_suffix(".log"))})  # fmt: skip
        outliers[str(s)]["wall_s"] = secs
    pool.shutdown()

    # tables
    summary: dict[str, dict[str, Any]] = {}
    for m in models:
        ref = [runs[m]["fp32"][str(s)]["val_loss"] for s in seeds]
        summary[m] = {}
        rows = []
        for r in recipes:
            vals = [runs[m][r][str(s)]["val_loss"] for s in seeds]
            ms = [x for s in seeds if (x := runs[m][r][str(s)]["ms_per_step"]) is not None]
            st = stats(vals, ref)
            st["ms_per_step_median"] = statistics.median(ms) if ms else None
            st["cost"] = costs[m][r]
            summary[m][r] = st
            sd = None if st["gap_sd"] is None else 100 * st["gap_sd"]
            cost = [costs[m][r][t] for t in a.targets]
            gap = None if st["gap_mean"] is None else 100 * st["gap_mean"]
            rows.append([r, *vals, st["mean"], gap, sd, *cost, st["ms_per_step_median"]])
        done = [v for v in ref if v is not None]
        summary[m]["fp32"]["seed_sd"] = statistics.stdev(done) if len(done) > 1 else None
        c = cfgs[m]
        print_table(
            f"{m}: val loss per seed, gap to fp32 (paired), modelled GEMM cost, CPU ms/step",
            [
                "recipe",
                *(f"seed {s}" for s in seeds),
                "mean",
                "gap %",
                "gap sd %",
                *(f"cost {t}" for t in a.targets),
                "ms/step (emulated)",
            ],
            rows,
            f"{c.steps} steps, batch {c.batch_size}x{c.seq_len}, width {c.width}, depth "
            f"{c.depth}, heads {c.heads}; fp32 seed sd {summary[m]['fp32']['seed_sd']}",
        )
    orows = []
    for s, o in outliers.items():
        if "val_loss" in o:
            names = [*OUTLIER_RECIPES, *(f"plan-{t}" for t in a.targets)]
            pcost = [o["plans"][f"plan-{t}"]["cost"] for t in a.targets]
            orows.append([s, *(o["val_loss"].get(r) for r in names), *pcost])
    if orows:
        print_table(
            "outlier model: val loss (no training after add_outliers)",
            [
                "seed",
                *OUTLIER_RECIPES,
                *(f"plan-{t}" for t in a.targets),
                *(f"cost plan-{t}" for t in a.targets),
            ],
            orows,
        )
    total_s = time.perf_counter() - t_start
    print(f"total {total_s:.0f} s")
    record = run_record(
        "autopilot",
        "cpu",
        models=models,
        seeds=seeds,
        targets=a.targets,
        jobs=a.jobs,
        threads_per_job=1,
        configs={m: cfgs[m].to_dict() for m in models},
        tune_s=tune_s,
        costs=costs,
        plans=plans,
        summary=summary,
        runs=runs,
        outliers=outliers,
        total_s=total_s,
        argv=sys.argv[1:] if argv is None else argv,
    )
    snap = os.environ.get("LOWPREC_SNAPSHOT_OF")
    if snap:  # run from a `git archive` of this commit (PYTHONPATH), outside any repository
        record["git"] = {"commit": snap, "dirty": False, "modified": [], "source": "git archive"}
    path = write_json(record, a.out)
    print(f"JSON: {path}")
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
