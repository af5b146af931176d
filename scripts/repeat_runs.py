"""Is a straight run repeatable? The same ``lowprec train`` command run N times, no interrupt.

Issue 39's resumed runs are compared bit for bit with one uninterrupted run. If two
uninterrupted runs of the same command can differ (a kernel whose bits depend on the
thread count it gets, the load or the memory layout), a resume can differ without any
state being saved wrongly. This runs the stress test's configuration ``--runs`` times per
recipe, ``--jobs`` at a time (load on the machine, as a user's other work would give),
and counts the distinct ``metrics.jsonl`` sequences (step, loss, val loss, loss scale,
skipped): 1 means repeatable.

Usage: ``python scripts/repeat_runs.py --runs 16 --jobs 8 --out /tmp/repeat``; exit status 1
if any recipe gave more than one sequence. ``--env K=V`` sets a variable in every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interrupt_stress import _metrics, _train  # (the stress test's own run)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS (0: default)")
    ap.add_argument("--recipes", nargs="+", default=["fp16-dynamic-ls", "bf16", "fp8-delayed"])
    ap.add_argument("--env", action="append", default=[], metavar="K=V")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.runs < 2 or a.jobs < 1:
        ap.error("--runs must be >= 2 and --jobs >= 1")
    for kv in a.env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            ap.error(f"--env takes K=V, got {kv!r}")
        os.environ[k] = v
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    t0 = time.time()
    plans = [(r, a.out / f"{r}-{i:03d}") for r in a.recipes for i in range(a.runs)]

    def run(plan: tuple[str, Path]) -> tuple[str, int, list[tuple[Any, ...]]]:
        rc = _train(plan[0], plan[1], False, None, a.threads)
        return plan[0], rc, _metrics(plan[1]) if rc == 0 else []

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(run, plans))
    summary: dict[str, Any] = {}
    for recipe in a.recipes:
        seqs = [m for r, rc, m in results if r == recipe and rc == 0]
        failed = sum(1 for r, rc, _ in results if r == recipe and rc != 0)
        distinct: list[list[tuple[Any, ...]]] = []
        counts: list[int] = []
        for s in seqs:
            for j, d in enumerate(distinct):
                if d == s:
                    counts[j] += 1
                    break
            else:
                distinct.append(s)
                counts.append(1)
        first_diff = None
        if len(distinct) > 1:
            first_diff = next(
                (x, y) for x, y in zip(distinct[0], distinct[1], strict=False) if x != y
            )
        summary[recipe] = {"runs": len(seqs), "failed": failed, "distinct": len(distinct),
                           "counts": counts, "first_diff": first_diff}  # fmt: skip
        print(f"{recipe:18s} runs {len(seqs):3d}  failed {failed}  distinct sequences "
              f"{len(distinct)} {counts}" + (f"  first difference {first_diff}"
                                             if first_diff else ""))  # fmt: skip
    print(f"{len(results)} runs, {time.time() - t0:.0f} s")
    (a.out / "results.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "summary": summary},
                   indent=1, default=str))  # fmt: skip
    bad = any(s["distinct"] > 1 or s["failed"] for s in summary.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
