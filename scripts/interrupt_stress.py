"""Interrupt stress test: placed SIGINT/SIGTERM/SIGKILL inside training steps, then resume,
compared bit for bit with an uninterrupted run (issue 39).

Each trial runs ``lowprec train`` (the configuration of issue 39: 24 steps, width 96,
depth 2, 2 heads, sequence 64, batch 16, eval every 6, checkpoint every 3, seed 3) as a
chain of processes: up to ``--chain`` processes, each with one placed fault
(``LOWPREC_FAULT="<point>:<k>:<how>"``, :mod:`lowprec._faults`: a point of the step, its
k-th occurrence in that process, the signal), each continuing the run with ``--resume``
(a process killed before the first checkpoint is restarted the same way), then one
without a fault that finishes it. Its ``metrics.jsonl`` (step, loss, val loss, loss
scale, skipped) must equal the uninterrupted run's exactly.

Usage: ``python scripts/interrupt_stress.py --trials 500 --out /tmp/stress`` prints a
line per trial as it ends, then a table per recipe, and writes ``results.json``; exit
status 1 if any resumed run differs. ``--threads 0`` keeps torch's default thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("fp16-dynamic-ls", "bf16", "fp8-delayed", "fp8-static", "fp8-unit", "fp16-scalify")
POINTS = ("startup", "forward", "backward", "optimizer", "scaler", "writeback", "checkpoint",
          "metrics")  # fmt: skip
ARGS = (
    "--steps 24 --width 96 --depth 2 --heads 2 --seq-len 64 --batch-size 16 --eval-every 6 "
    "--ckpt-every 3 --seed 3 --no-progress"
).split()
KEYS = ("step", "loss", "val_loss", "loss_scale", "skipped")


def _train(recipe: str, out: Path, resume: bool, fault: str | None, threads: int) -> int:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("LOWPREC_FAULT", None)
    if fault:
        env["LOWPREC_FAULT"] = fault
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "lowprec", "train", "--recipe", recipe, *ARGS, "--out", str(out)]
    if resume:
        cmd.append("--resume")
    with open(out.with_name(out.name + ".log"), "a") as log:
        log.write(f"$ LOWPREC_FAULT={fault or ''} {' '.join(cmd[2:])}\n")
        log.flush()
        return subprocess.run(cmd, env=env, stdout=log, stderr=log, timeout=600).returncode


def _metrics(out: Path) -> list[tuple[Any, ...]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [tuple(r.get(k) for k in KEYS) for r in recs]


def _trial(
    recipe: str, faults: list[str], out: Path, ref: list[Any], threads: int
) -> dict[str, Any]:
    fired = 0
    for fault in faults:
        if (out / "summary.json").exists():
            break
        rc = _train(recipe, out, out.exists() and (out / "config.json").exists(), fault, threads)
        fired += rc != 0
    for _ in range(3):  # finish without faults
        if (out / "summary.json").exists():
            break
        _train(recipe, out, (out / "config.json").exists(), None, threads)
    got = _metrics(out) if (out / "metrics.jsonl").exists() else []
    diffs = [(a, b) for a, b in zip(got, ref, strict=False) if a != b]
    exact = got == ref
    return {"recipe": recipe, "faults": faults, "fired": fired, "exact": exact,
            "first_diff": diffs[0] if diffs else None, "steps": len(got)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--points", nargs="+", default=list(POINTS), choices=POINTS)
    ap.add_argument("--hows", nargs="+", default=["int", "term", "kill"],
                    choices=["int", "term", "kill"])  # fmt: skip
    ap.add_argument("--chain", type=int, default=2, help="faulted processes per trial")
    ap.add_argument("--max-k", type=int, default=24, help="occurrences to place a fault at")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS (0: default)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    for sig in (signal.SIGINT, signal.SIGTERM):  # an ignored signal stays ignored in the
        if signal.getsignal(sig) is signal.SIG_IGN:  # children (a background job's SIGINT):
            signal.signal(sig, signal.SIG_DFL)  # their placed "int"/"term" faults would not fire
    rng = random.Random(a.seed)
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    t0 = time.time()
    refs: dict[str, Any] = {}
    for recipe in a.recipes:
        straight = a.out / f"straight-{recipe}"
        _train(recipe, straight, False, None, a.threads)
        refs[recipe] = _metrics(straight)
    plans = []
    for i in range(a.trials):
        recipe = a.recipes[i % len(a.recipes)]
        faults = []
        for _ in range(a.chain):
            p = rng.choice(a.points)
            k = 1 if p == "startup" else rng.randint(1, a.max_k if p != "checkpoint" else 8)
            faults.append(f"{p}:{k}:{rng.choice(a.hows)}")
        plans.append((recipe, faults, a.out / f"trial-{i:04d}"))

    def run(plan: tuple[str, list[str], Path]) -> dict[str, Any]:
        r = _trial(plan[0], plan[1], plan[2], refs[plan[0]], a.threads)
        status = "exact" if r["exact"] else f"INEXACT, first difference {r['first_diff']}"
        print(f"{plan[2].name} {r['recipe']} {' '.join(r['faults'])}: {r['fired']} fired, "
              f"{status}", flush=True)  # fmt: skip
        return r

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(run, plans))
    summary: dict[str, dict[str, int]] = {}
    for r in results:
        s = summary.setdefault(r["recipe"], {"trials": 0, "interrupts": 0, "inexact": 0})
        s["trials"] += 1
        s["interrupts"] += r["fired"]
        s["inexact"] += not r["exact"]
    for recipe, s in summary.items():
        print(f"{recipe:18s} trials {s['trials']:4d}  placed interrupts that fired "
              f"{s['interrupts']:4d}  inexact {s['inexact']}")  # fmt: skip
    bad = [r for r in results if not r["exact"]]
    for r in bad:
        print("INEXACT", r["recipe"], r["faults"], r["first_diff"], f"({r['steps']} steps)")
    total = sum(s["interrupts"] for s in summary.values())
    print(
        f"{len(results)} trials, {total} interrupts, {len(bad)} inexact, {time.time() - t0:.0f} s"
    )
    (a.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(a).items()}, "summary": summary,
         "interrupts": total, "inexact": bad, "trials": results}, indent=1))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
