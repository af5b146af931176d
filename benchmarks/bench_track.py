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

import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from _common import (
    arg_parser,
    parse_args,
    print_table,
    run_record,
    setup_torch,
    time_many,
    write_json,
)

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
    p = arg_parser(__doc__, threads=1, repeats=10, quick="tiny, 2 blocks of 2")
    p.add_argument("--recipe", default="fp32")
    p.add_argument("--every", type=int, nargs="+", default=[100, 10, 1])
    p.add_argument("--block", type=int, default=10, help="training steps per timed call")
    a = parse_args(p, argv, "track_cpu")
    if any(k < 1 for k in a.every) or a.block < 1:
        p.error("--every and --block must be positive")
    setup_torch(a.threads)
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
    # the mean, not the median: one block in 100/block holds the every-100 tracking step
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
                "timing": timings[name].as_dict(),
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
    path = write_json(record, a.out)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
