"""Overhead of numerics tracking (``lowprec.analysis.track``) on a training step.

The reference model at the demo's shape (``lowprec.jobs.demo.DEMO_CONFIG``: width 64, depth 2,
batch 32x128) trains with a recipe (default ``fp32``); one training step is
``lowprec.recipes.step.train_step`` (the step of ``lowprec train``) at a constant lr, without
the job's logging (forward and backward inside ``prepared.compute()``, optimizer step,
zero_grad). Variants, each with its own model:
no tracking, and ``track(model, ["fp16", "bf16", "e4m3fn", "e5m2"], every=k)`` for each
``--every`` k (default 100, 10, 1): statistics of every leaf module's input, output,
weights, activation gradient and weight gradient on every k-th step.

Timing: a timed call is a block of ``--block`` steps (default 10); ``--repeats`` blocks per
variant, interleaved round by round (``_common.time_many``). Because sampling happens on
one step in k, the *mean* block time over all repeats (repeats x block steps, a multiple
of every k) is what a training run pays; the table reports it per step and as a ratio to
no tracking. ``--quick``: 2 blocks of 2 steps at a tiny shape, JSON in the temp dir.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from _common import default_out, print_table, run_record, setup_torch, time_many, write_json

from lowprec.analysis import Tracker
from lowprec.jobs.demo import DEMO_CONFIG, QUICK_CONFIG
from lowprec.jobs.train import TRACK_FORMATS, TrainConfig, build
from lowprec.recipes.step import train_step


def _stepper(cfg: TrainConfig, every: int | None) -> tuple[Any, Tracker | None]:
    prepared, data = build(cfg)
    tracker = None if every is None else Tracker(prepared.model, TRACK_FORMATS, every)
    state = {"i": 0}

    def step() -> None:
        x, y = data.batch("train", state["i"])
        state["i"] += 1
        train_step(prepared, x, y)

    return step, tracker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="fp32")
    p.add_argument("--every", type=int, nargs="+", default=[100, 10, 1])
    p.add_argument("--block", type=int, default=10, help="training steps per timed call")
    p.add_argument("--repeats", type=int, default=10, help="timed blocks per variant")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="JSON path (default results/track_cpu.json)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny, 2 blocks of 2")
    a = p.parse_args(argv)
    if any(k < 1 for k in a.every) or a.block < 1 or a.repeats < 1:
        p.error("--every, --block and --repeats must be positive")
    setup_torch(a.threads, cold_compile=False)
    cfg = replace(QUICK_CONFIG if a.quick else DEMO_CONFIG, recipe=a.recipe)
    block, repeats = (2, 2) if a.quick else (a.block, a.repeats)
    variants: dict[str, tuple[Any, Tracker | None]] = {"no tracking": _stepper(cfg, None)}
    for k in a.every:
        variants[f"every {k}"] = _stepper(cfg, k)

    def run_block(step: Any) -> Any:
        return lambda: [step() for _ in range(block)]

    t0 = time.perf_counter()
    timings = time_many(
        {n: run_block(s) for n, (s, _) in variants.items()},
        repeats=repeats,
        warmup=1,
        min_repeat_s=0.0,
    )
    base = statistics.fmean(timings["no tracking"].repeats_ms) / block
    rows, out_rows = [], []
    for name, (_, tracker) in variants.items():
        ms = statistics.fmean(timings[name].repeats_ms) / block
        n_rec = len(tracker.records) if tracker else 0
        rows.append([name, ms, ms / base, n_rec])
        out_rows.append(
            {
                "variant": name,
                "ms_per_step_mean": ms,
                "x_no_tracking": ms / base,
                "records": n_rec,
                "timing": timings[name].__dict__,
            }
        )
    caption = (
        f"{a.recipe}, width {cfg.width}, depth {cfg.depth}, batch {cfg.batch_size}x"
        f"{cfg.seq_len}; mean of {repeats} blocks of {block} steps (+1 warm-up block), "
        f"variants interleaved; {a.threads} thread(s); {time.perf_counter() - t0:.0f} s"
    )
    print_table(
        "numerics tracking overhead per training step",
        ["variant", "ms/step", "x no tracking", "records"],
        rows,
        caption,
    )
    record = run_record(
        "track",
        "cpu",
        recipe=a.recipe,
        every=a.every,
        block=block,
        repeats=repeats,
        threads=a.threads,
        config=cfg.to_dict(),
        rows=out_rows,
    )
    path = write_json(record, a.out or default_out("track_cpu", a.quick))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
