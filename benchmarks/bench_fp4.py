"""Evidence for FP4 training (issue 31): plain NVFP4 against the published recipe's parts,
each switched on alone, and against FP8, BF16 and FP32.

Rows, each a :class:`~lowprec.recipes.Recipe` built from the presets by replacing fields
(:func:`recipes`), so that every row but ``nvfp4-train`` differs from ``nvfp4`` in one part:

* ``fp32``, ``bf16``, ``fp8-tensorwise``, ``nvfp4``: the presets as they are;
* ``nvfp4 +2d-weight``: the weight cast on 16x16 blocks (``granularity="nv:16x16"``);
* ``nvfp4 +sr-grad``: the gradient cast rounded stochastically (``rounding="stochastic"``;
  the stream seed is the config's, 0, in every run, as in the preset);
* ``nvfp4 +hadamard-wgrad``: a random Hadamard transform of 16 on the weight-gradient
  GEMM's two operands (``hadamard=("weight_grad",)``, ``hadamard_block=16``);
* ``nvfp4 +bf16-last``: the linears of the last 15% of the blocks in BF16 (``layers`` of
  ``nvfp4-train``: ``LayerRule("*.{last:15%}.*", None)``; with 4 blocks, the last one);
* ``nvfp4-train``: the preset as it is (2-D weight scales, stochastic gradients, Hadamard
  weight gradient, the last 15% of the blocks in BF16).

Each (row, seed) is one ``lowprec train --recipe <row>.json --seed S`` subprocess (the
project's training loop; ``OMP_NUM_THREADS=1``, ``--jobs`` at a time) on the reference
model; defaults: width 64, depth 4, 4 heads, batch 16x64 characters, 300 steps, AdamW lr
1e-2 (30 warm-up steps, cosine to lr/10; the demo's 3e-3 gave nvfp4 a smaller gap to
bf16), the val loss over 16 val batches at the end, the low-precision GEMMs measured every
50 steps (``--gemms-every``; the run's ``gemms.jsonl``, :mod:`lowprec.analysis.gemms`).

Measured per run: the final val loss; from ``gemms.jsonl``, per GEMM kind (``forward``,
``input_grad``, ``weight_grad``) pooled over the float8 layers (the BF16 ones are not
measured) and the measured steps: the GEMM's output SQNR ``-10 log10(mean rel_err²)``
(``rel_err`` the sampled relative error of the product against the unquantized operands'
product) and each operand's cast SQNR (mean of ``sqnr_db``, in dB) and flushed share.
Per row: val loss per seed, mean, sample sd; the paired gaps (same seed) to ``bf16``,
``fp32`` and ``nvfp4``: mean and sample sd over the seeds; the per-GEMM numbers averaged
over the seeds.

Prints the tables and writes ``--out`` (default ``benchmarks/results/fp4_cpu.json``:
machine, lscpu model and flags, torch, git revision, the configuration and every run).
Finished runs in ``--runs`` are reused (``summary.json`` exists). ``--quick``: a tiny model,
6 steps, 1 seed, JSON in the temp dir.

    OMP_NUM_THREADS=1 python benchmarks/bench_fp4.py --jobs 2 --budget-s 4200 --runs /tmp/fp4_runs

The recorded run, its provenance and the findings: ``benchmarks/README.md``, "FP4
training: the parts of nvfp4-train".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from _common import arg_parser, lscpu, parse_args, print_table, run_record, write_json

from lowprec.jobs.rundir import read_metrics
from lowprec.recipes import Recipe, get_recipe

LOWPREC = [str(Path(sys.executable).with_name("lowprec"))]
GEMM_KINDS = ("forward", "input_grad", "weight_grad")
OPERANDS = {
    "forward": ("input", "weight"),
    "input_grad": ("grad_output", "weight"),
    "weight_grad": ("grad_output", "input"),
}


def recipes() -> dict[str, Recipe]:
    """The rows: presets, and ``nvfp4`` with one part switched on (module docstring)."""
    nv = get_recipe("nvfp4")
    f = nv.float8
    assert f is not None

    def part(name: str, what: str, **fields: Any) -> Recipe:
        cfg = f.replace(name=f"nvfp4+{name}", **fields)
        return replace(nv, name=f"nvfp4+{name}", description=what, technique=(cfg,))

    rows = {r: get_recipe(r) for r in ("fp32", "bf16", "fp8-tensorwise", "nvfp4")}
    rows["nvfp4 +2d-weight"] = part(
        "2d-weight", "nvfp4, weights on 16x16 blocks",
        weight=replace(f.weight, granularity="nv:16x16"),
    )  # fmt: skip
    rows["nvfp4 +sr-grad"] = part(
        "sr-grad", "nvfp4, gradients rounded stochastically",
        grad_output=replace(f.grad_output, rounding="stochastic"),
    )  # fmt: skip
    rows["nvfp4 +hadamard-wgrad"] = part(
        "hadamard-wgrad", "nvfp4, random Hadamard (16) on the weight-gradient GEMM",
        hadamard=("weight_grad",), hadamard_block=16,
    )  # fmt: skip
    train = get_recipe("nvfp4-train")  # as it is: its layer rules are the BF16 blocks
    rows["nvfp4 +bf16-last"] = replace(
        nv, name="nvfp4+bf16-last", description="nvfp4, nvfp4-train's BF16 blocks",
        layers=train.layers,
    )  # fmt: skip
    rows["nvfp4-train"] = train
    return rows


# ---- runs -----------------------------------------------------------------------------------


TRAIN_KEYS = ("steps", "batch_size", "seq_len", "width", "depth", "heads", "lr", "warmup",
              "eval_batches")  # fmt: skip
# --quick: a tiny model, 6 steps
QUICK = {
    "steps": 6,
    "batch_size": 4,
    "seq_len": 32,
    "width": 32,
    "depth": 2,
    "heads": 2,
    "warmup": 2,
    "eval_batches": 2,
}


def add_train_args(
    p: argparse.ArgumentParser, *, steps: int, batch_size: int, lr: float, warmup: int,
    eval_batches: int, budget: bool = True,
) -> None:  # fmt: skip
    """The ``lowprec train`` options of the training benchmarks (their defaults per script;
    sequence 64, width 64, depth 4, 4 heads for all), ``--jobs``, ``--runs`` and, with
    ``budget``, ``--budget-s`` (:data:`DEADLINE`)."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--eval-batches", type=int, default=eval_batches)
    p.add_argument("--jobs", type=int, default=2, help="training subprocesses at a time")
    p.add_argument("--runs", default=None, help="folder for the runs (default: a temp dir)")
    if budget:
        late = "start no run after this many seconds (those left out: rc -1)"
        p.add_argument("--budget-s", type=float, default=None, help=late)


def train_config(
    a: argparse.Namespace, extra: tuple[str, ...] = (), quick: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``lowprec train`` options of every run: :data:`TRAIN_KEYS` and ``extra`` from the
    parsed ``a``; with ``--quick``, :data:`QUICK` updated by ``quick``; one evaluation and
    one checkpoint, at the last step."""
    cfg = {k: getattr(a, k) for k in TRAIN_KEYS + extra}
    if a.quick:
        cfg.update(QUICK, **(quick or {}))
    cfg.update(eval_every=cfg["steps"], ckpt_every=cfg["steps"])
    return cfg


DEADLINE = [math.inf]  # perf_counter time after which no new run starts (--budget-s)


def run_cmd(cmd: list[str], log: Path, done: Path) -> tuple[int, float]:
    """Run ``cmd`` with one OpenMP thread, its output to ``log``; (exit code, seconds).
    Not run where ``done`` exists (an earlier invocation's finished run: rc 0, NaN s) or
    past the deadline (rc -1)."""
    if done.exists():
        return 0, math.nan
    t0 = time.perf_counter()
    if t0 > DEADLINE[0]:
        return -1, 0.0
    with open(log, "w") as fh:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    return rc, time.perf_counter() - t0


def gemm_numbers(path: Path) -> dict[str, Any]:
    """Per GEMM kind, pooled over layers and measured steps: output SQNR from the sampled
    relative errors, and each operand's mean cast SQNR (dB) and flushed share."""
    acc: dict[str, dict[str, list[float]]] = {}
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        kind = r["gemm"].split("#")[0]
        a = acc.setdefault(kind, {})
        if r.get("rel_err") is not None:
            a.setdefault("rel_err2", []).append(float(r["rel_err"]) ** 2)
        for role, op in r["operands"].items():
            if op.get("high_precision"):
                continue
            s = op.get("sqnr_db")
            if s is not None and math.isfinite(float(s)):
                a.setdefault(f"{role}.sqnr_db", []).append(float(s))
            a.setdefault(f"{role}.flushed", []).append(float(op["flushed"]))
    out: dict[str, Any] = {}
    for kind, a in acc.items():
        e2 = a.pop("rel_err2", [])
        m = statistics.fmean(e2) if e2 else None
        d: dict[str, Any] = {"sqnr_db": None if not m else -10 * math.log10(m), "n": len(e2)}
        for k, v in a.items():
            role, what = k.split(".")
            d.setdefault("operands", {}).setdefault(role, {})[what] = statistics.fmean(v)
        out[kind] = d
    return out


def paired(vals: list[float | None], ref: list[float | None]) -> dict[str, Any]:
    """Relative gaps ``v / r - 1`` over the seeds where both finished: per seed, mean, sd."""
    gaps = [None if v is None or r is None else v / r - 1 for v, r in zip(vals, ref, strict=True)]
    ok = [g for g in gaps if g is not None and math.isfinite(g)]
    return {
        "gap": gaps,
        "mean": statistics.fmean(ok) if ok else None,
        "sd": statistics.stdev(ok) if len(ok) > 1 else None,
        "n": len(ok),
    }


def pct(x: float | None) -> float | None:
    """``x`` in percent (``None`` stays ``None``)."""
    return None if x is None else 100 * x


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(__doc__, quick="tiny model, 6 steps, 1 seed, JSON in the temp dir")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rows", nargs="+", default=None, help="row names (default: all)")
    add_train_args(p, steps=300, batch_size=16, lr=1e-2, warmup=30, eval_batches=16)
    p.add_argument("--gemms-every", type=int, default=50)
    a = parse_args(p, argv, "fp4_cpu")
    seeds = a.seeds[:1] if a.quick else a.seeds
    train_cfg = train_config(a, ("gemms_every",), {"depth": 4, "gemms_every": 3})
    rows = recipes()
    names = a.rows or list(rows)
    unknown = [n for n in names if n not in rows]
    if unknown:
        p.error(f"--rows: unknown {unknown}; valid: {list(rows)}")
    root = Path(a.runs) if a.runs else Path(tempfile.mkdtemp(prefix="bench_fp4_"))
    (root / "recipes").mkdir(parents=True, exist_ok=True)
    print(f"runs in {root}")
    t_start = time.perf_counter()
    if a.budget_s is not None:
        DEADLINE[0] = t_start + a.budget_s
    files: dict[str, Path] = {}
    for n in names:
        files[n] = root / "recipes" / f"{n.replace(' ', '_')}.json"
        files[n].write_text(json.dumps(rows[n].to_dict(), indent=1) + "\n")
    pool = ThreadPoolExecutor(max(1, a.jobs))
    jobs: dict[tuple[str, int], tuple[list[str], Path, Any]] = {}
    slow: Callable[[str], bool] = lambda n: "sr" in n or n == "nvfp4-train"  # noqa: E731
    for s in seeds:  # the slow (stochastic) rows first, so the pool ends on short runs
        for n in sorted(names, key=lambda n: not slow(n)):
            out = root / f"seed{s}" / n.replace(" ", "_")
            cmd = [*LOWPREC, "train", "--recipe", str(files[n]), "--seed", str(s),
                   "--out", str(out), "--no-progress"]  # fmt: skip
            for k, v in train_cfg.items():
                cmd += ["--" + k.replace("_", "-"), str(v)]
            out.parent.mkdir(parents=True, exist_ok=True)
            log = out.parent / f"{out.name}.log"
            jobs[n, s] = (cmd, out, pool.submit(run_cmd, cmd, log, out / "summary.json"))
    runs: dict[str, dict[str, dict[str, Any]]] = {n: {} for n in names}
    for (n, s), (cmd, out, fut) in jobs.items():
        rc, secs = fut.result()
        entry: dict[str, Any] = {"rc": rc, "wall_s": secs, "command": " ".join(cmd[1:])}
        if rc == -1:  # left out: past --budget-s
            entry["val_loss"] = None
            runs[n][str(s)] = entry
            continue
        try:
            recs = read_metrics(out)
            vals = [x["val_loss"] for x in recs if "val_loss" in x]
            done = len(recs) == train_cfg["steps"] and vals and math.isfinite(vals[-1])
            entry["val_loss"] = float(vals[-1]) if done else None
            entry["gemms"] = gemm_numbers(out / "gemms.jsonl")
        except Exception as e:  # a failed run: no value, with the reason
            entry.update(val_loss=None, error=repr(e))
        runs[n][str(s)] = entry
    pool.shutdown()

    # summaries
    def vals(n: str) -> list[float | None]:
        return [runs[n][str(s)]["val_loss"] for s in seeds] if n in runs else [None] * len(seeds)

    summary: dict[str, dict[str, Any]] = {}
    for n in names:
        v = vals(n)
        ok = [x for x in v if x is not None]
        g: dict[str, Any] = {}
        for kind in GEMM_KINDS:
            per = [runs[n][str(s)].get("gemms", {}).get(kind) for s in seeds]
            per = [x for x in per if x and x["sqnr_db"] is not None]
            if not per:
                continue
            g[kind] = {"sqnr_db": statistics.fmean(x["sqnr_db"] for x in per), "operands": {}}
            for role in OPERANDS[kind]:
                ops = [x["operands"][role] for x in per if role in x.get("operands", {})]
                if ops:
                    g[kind]["operands"][role] = {
                        k: statistics.fmean(o[k] for o in ops if k in o)
                        for k in ("sqnr_db", "flushed") if any(k in o for o in ops)
                    }  # fmt: skip
        summary[n] = {
            "val_loss": v,
            "mean": statistics.fmean(ok) if ok else None,
            "sd": statistics.stdev(ok) if len(ok) > 1 else None,
            "gap_bf16": paired(v, vals("bf16")),
            "gap_fp32": paired(v, vals("fp32")),
            "gap_nvfp4": paired(v, vals("nvfp4")),
            "gemms": g,
        }
    c = train_cfg
    caption = (f"{c['steps']} steps, batch {c['batch_size']}x{c['seq_len']}, width {c['width']}, "
               f"depth {c['depth']}, heads {c['heads']}, lr {c['lr']}; gap: paired (same seed), "
               "mean and sample sd over the seeds, in %")  # fmt: skip
    trows = []
    for n in names:
        sm = summary[n]
        trows.append([n, *sm["val_loss"], sm["mean"], sm["sd"],
                      *(pct(sm[k][m]) for k in ("gap_bf16", "gap_nvfp4") for m in ("mean", "sd"))
                      ])  # fmt: skip
    print_table(
        "FP4 training: val loss per seed",
        ["row", *(f"seed {s}" for s in seeds), "mean", "sd", "vs bf16 %", "sd", "vs nvfp4 %",
         "sd"],
        trows, caption,
    )  # fmt: skip
    grows = []
    for n in names:
        g = summary[n]["gemms"]
        if not g:
            continue
        cells: list[Any] = []
        for kind in GEMM_KINDS:
            k = g.get(kind, {})
            cells.append(k.get("sqnr_db"))
            cells += [k.get("operands", {}).get(r, {}).get("sqnr_db") for r in OPERANDS[kind]]
        flushed = g.get("weight_grad", {}).get("operands", {}).get("grad_output", {})
        grows.append([n, *cells, pct(flushed.get("flushed"))])
    print_table(
        "per-GEMM SQNR (dB): output, then each operand's cast",
        ["row", "fwd", "fwd x", "fwd W", "dgrad", "dgrad g", "dgrad W", "wgrad", "wgrad g",
         "wgrad x", "wgrad g flushed %"],
        grows,
        "pooled over the float8 layers and the measured steps, averaged over the seeds",
    )  # fmt: skip
    total_s = time.perf_counter() - t_start
    print(f"total {total_s:.0f} s")
    record = run_record(
        "fp4",
        "cpu",
        lscpu=lscpu(),
        seeds=seeds,
        jobs=a.jobs,
        threads_per_job=1,
        train=train_cfg,
        rows={n: rows[n].to_dict() for n in names},
        summary=summary,
        runs=runs,
        total_s=total_s,
        argv=sys.argv[1:] if argv is None else argv,
    )
    path = write_json(record, a.out)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
