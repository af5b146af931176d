"""Overhead of the per-GEMM measurement (``lowprec.analysis.gemms``) on a training step.

The reference model at the demo's shape (``lowprec.jobs.demo.DEMO_CONFIG``: width 64,
depth 2, 4 heads, batch 32x128) trains with each ``--recipes`` recipe (default
``fp8-tensorwise``, ``fp8-rowwise``, ``nvfp4``, ``fp8-unit``) in a loop like
``lowprec train``'s (``lowprec.jobs.train``): ``train_step(prepared, x, y, lr,
grad_stats=True, skip_nonfinite=True)``, then ``RunRecorder.log`` of the step's loss and
gradient statistics (a run directory in a temp dir: ``metrics.jsonl`` and ``gemms.jsonl``
are written as in a real run). Variants, each with its own model (same seed, same
batches), per recipe:

* ``no recorder``: the loop without a ``RunRecorder`` (shows what the recorder's hooks
  cost even when nothing is measured);
* ``off``: ``RunRecorder(gemms_every=None)``: the baseline the overhead is measured
  against;
* ``every 25``: ``gemms_every=25``, ``lowprec train``'s default;
* ``every 1``: every step measured.

The recorder's numerics tracking is off in every variant (``numerics_every=None``;
``lowprec train`` samples it at the first and the last step only) and ``steps=None`` (no
extra sample at a last step), so exactly the steps whose 0-based index is a multiple of
the interval are measured.

Timing (``_common.time_many``; wall clock and the default thread count unless
``--clock thread --threads 1``: the compute thread's CPU time, which leaves out the time
other processes hold the core; on a loaded 2-core machine two OpenMP threads stall for
up to 10x a step): a timed call is a block
of ``--block`` consecutive training steps (default 100); ``--repeats`` rounds (default 3)
run every variant of every recipe once per round, interleaved, after a warm-up block of
``--warm`` steps (default 10: step 0, which every measuring variant samples, falls in the
warm-up). With 100-step blocks each timed block of ``every 25`` holds exactly 4 measured
steps, what a run pays. ``every 1`` measures every step alike, so its blocks are shorter
(``--block-every1``, default 25 steps) to save time. Result: the median over rounds of
each block's mean step time, and its ratio to ``off``.

Then ``--attribute N`` (default 4) sampled steps per recipe (every step measured, not
timed against the others) with timers around ``GemmRecorder._on_gemm`` (the sink a
GEMM calls), the statistics of its operands (``cast_stats``), the sampled GEMM error
(``gemm_rel_err``) and the write of ``gemms.jsonl``: where a measured step's extra time
goes. ``--quick``: tiny model, 2 rounds of 4 steps, JSON in the temp dir.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _common import (
    arg_parser,
    parse_args,
    print_table,
    run_record,
    setup_torch,
    time_many,
    write_json,
)

import lowprec.analysis.gemms as gemms_mod
import lowprec.jobs.recorder as recorder_mod
from lowprec.core import observe
from lowprec.jobs.demo import DEMO_CONFIG, QUICK_CONFIG
from lowprec.jobs.recorder import RunRecorder
from lowprec.jobs.train import TrainConfig, build
from lowprec.recipes.step import train_step

CLOCK: list[Callable[[], float]] = [time.perf_counter]  # the attribution's clock (--clock)
RECIPES = ("fp8-tensorwise", "fp8-rowwise", "nvfp4", "fp8-unit")
VARIANTS: dict[str, tuple[bool, int | None]] = {  # name: (recorder, gemms_every)
    "no recorder": (False, None),
    "off": (True, None),
    "every 25": (True, 25),
    "every 1": (True, 1),
}


class Loop:
    """One model trained by ``lowprec train``'s step, with or without a ``RunRecorder``."""

    def __init__(self, cfg: TrainConfig, out: Path | None, gemms_every: int | None) -> None:
        self.cfg = cfg
        self.prepared, self.data = build(cfg)
        self.recorder = None
        if out is not None:
            self.recorder = RunRecorder(
                out,
                self.prepared.model,
                recipe=self.prepared.recipe,
                config=cfg.to_dict(),
                steps=None,  # no extra sample at a last step
                numerics_every=None,
                gemms_every=gemms_every,
                count_grads=False,  # the step measures the gradients, as lowprec train's
            )
        self.step = 0
        self.losses: list[float] = []

    def run(self, n: int) -> None:
        with only_observer(self.recorder):
            self._run(n)

    def _run(self, n: int) -> None:
        for _ in range(n):
            i = self.step
            x, y = self.data.batch("train", i)
            r = train_step(
                self.prepared, x, y, self.cfg.lr_at(i), grad_stats=True, skip_nonfinite=True
            )
            loss = float(r.loss.detach())
            self.losses.append(loss)
            if self.recorder is not None:
                stats = r.grad_stats
                assert stats is not None
                self.recorder.log(
                    i + 1,
                    loss=loss,
                    grad_norm=stats["grad_norm"],
                    grad_zero_share=stats["grad_zero_share"],
                    grad_nonfinite_share=stats["grad_nonfinite_share"],
                )
            self.step += 1

    def gemm_lines(self) -> int:
        if self.recorder is None:
            return 0
        p = self.recorder.out / "gemms.jsonl"
        return sum(1 for _ in open(p)) if p.exists() else 0

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close(summary=False)


@contextmanager
def only_observer(recorder: RunRecorder | None) -> Iterator[None]:
    """``recorder``'s GEMM observer the only one on this thread inside (none: no observer).

    A ``RunRecorder`` installs its observer for its lifetime on its thread, and the
    innermost (the last created) is the one a GEMM asks (``lowprec.core.observe``): with
    several recorders alive in one process, as here, the last one would shadow the others.
    """
    stack = observe._stack()
    saved = stack[:]
    stack[:] = [] if recorder is None else [recorder._gemms]
    try:
        yield
    finally:
        stack[:] = saved


def block_fn(loop: Loop, warm: int, block: int) -> Callable[[], None]:
    """A timed call: ``warm`` steps the first time (time_many's warm-up call), then
    ``block`` steps per call."""
    calls = [0]

    def fn() -> None:
        loop.run(warm if calls[0] == 0 else block)
        calls[0] += 1

    return fn


@contextmanager
def timers() -> Iterator[dict[str, float]]:
    """Seconds spent in the measurement's parts while inside (patched module attributes)."""
    acc: dict[str, float] = defaultdict(float)
    saved = (
        gemms_mod.cast_stats,
        gemms_mod.gemm_rel_err,
        gemms_mod.GemmRecorder._on_gemm,
        recorder_mod.append_jsonl,
    )

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = CLOCK[0]()
            try:
                return fn(*args, **kw)
            finally:
                acc[key] += CLOCK[0]() - t0

        return wrapper

    def append(path: Path, records: Any) -> Any:
        key = "write gemms.jsonl" if Path(path).name == "gemms.jsonl" else "write other"
        return timed(key, saved[3])(path, records)

    gemms_mod.cast_stats = timed("cast_stats", saved[0])  # type: ignore[assignment]
    gemms_mod.gemm_rel_err = timed("rel_err", saved[1])  # type: ignore[assignment]
    gemms_mod.GemmRecorder._on_gemm = timed("sink (_on_gemm)", saved[2])  # type: ignore[method-assign]
    recorder_mod.append_jsonl = append  # type: ignore[assignment]
    try:
        yield acc
    finally:
        (
            gemms_mod.cast_stats,
            gemms_mod.gemm_rel_err,
            gemms_mod.GemmRecorder._on_gemm,
            recorder_mod.append_jsonl,
        ) = saved  # type: ignore[assignment]


def attribute(cfg: TrainConfig, root: Path, steps: int) -> dict[str, Any]:
    """ms per measured step in each part of the measurement (every step measured), and
    the step time of the same model with the measurement off, run alternately."""
    on, off = Loop(cfg, root / "attr_on", 1), Loop(cfg, root / "attr_off", None)
    on.run(2)
    off.run(2)
    t_on = t_off = 0.0
    with timers() as acc:
        for _ in range(steps):
            t0 = CLOCK[0]()
            on.run(1)
            t_on += CLOCK[0]() - t0
            acc_snapshot = dict(acc)
            t0 = CLOCK[0]()
            off.run(1)
            t_off += CLOCK[0]() - t0
            for k in acc:  # the off model's own writes are not the measurement's
                acc[k] = acc_snapshot.get(k, 0.0)
    records = on.gemm_lines()  # over all its steps, the 2 warm-up steps included
    on.close()
    off.close()
    parts = {k: v * 1e3 / steps for k, v in sorted(acc.items())}
    out = {
        "steps": steps,
        "step_ms_measured": t_on * 1e3 / steps,
        "step_ms_off": t_off * 1e3 / steps,
        "parts_ms": parts,
        "gemm_records_per_step": records / (steps + 2),
    }
    sink = parts.get("sink (_on_gemm)", 0.0)
    out["parts_ms"]["sink other (records, dicts)"] = (
        sink - parts.get("cast_stats", 0.0) - parts.get("rel_err", 0.0)
    )
    out["parts_ms"]["outside the sink (operand re-casts, hooks)"] = (
        out["step_ms_measured"] - out["step_ms_off"] - sink - parts.get("write gemms.jsonl", 0.0)
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(
        __doc__,
        threads=torch.get_num_threads(),
        repeats=3,
        clock=True,
        quick="tiny, 2 rounds of 4 steps",
    )
    p.add_argument("--recipes", nargs="+", default=list(RECIPES))
    p.add_argument("--block", type=int, default=100, help="training steps per timed call")
    p.add_argument("--block-every1", type=int, default=25,
                   help="training steps per timed call of the every-1 variant")  # fmt: skip
    p.add_argument("--warm", type=int, default=10, help="warm-up steps per variant")
    p.add_argument("--attribute", type=int, default=4, metavar="N",
                   help="measured steps per recipe timed part by part (0: none)")  # fmt: skip
    a = parse_args(p, argv, "gemms_cpu")
    if min(a.block, a.block_every1, a.warm) < 1 or a.attribute < 0:
        p.error("--block and --warm must be positive, --attribute >= 0")
    setup_torch(a.threads)
    if a.clock == "thread":
        CLOCK[0] = time.thread_time
    base = QUICK_CONFIG if a.quick else DEMO_CONFIG
    block, warm, repeats = (4, 2, 2) if a.quick else (a.block, a.warm, a.repeats)
    blocks = {n: block for n in VARIANTS}
    blocks["every 1"] = 2 if a.quick else a.block_every1
    total = warm + block * repeats
    root = Path(tempfile.mkdtemp(prefix="bench_gemms_"))
    loops: dict[tuple[str, str], Loop] = {}
    calls: dict[str, Callable[[], None]] = {}
    for recipe in a.recipes:
        cfg = replace(base, recipe=recipe, steps=total, warmup=min(base.warmup, total))
        for name, (rec, every) in VARIANTS.items():
            out = root / recipe / name.replace(" ", "_") if rec else None
            loop = loops[recipe, name] = Loop(cfg, out, every)
            calls[f"{recipe}/{name}"] = block_fn(loop, warm, blocks[name])

    t0 = time.perf_counter()
    timings = time_many(calls, repeats=repeats, warmup=1, min_repeat_s=0.0, clock=a.clock)
    timing_s = time.perf_counter() - t0

    rows, out_rows = [], []
    for recipe in a.recipes:
        per_round = {n: [ms / blocks[n] for ms in timings[f"{recipe}/{n}"].repeats_ms]
                     for n in VARIANTS}  # fmt: skip
        med = {n: statistics.median(v) for n, v in per_round.items()}
        for name in VARIANTS:
            loop = loops[recipe, name]
            ratios = [x / o for x, o in zip(per_round[name], per_round["off"], strict=True)]
            rows.append([recipe, name, med[name], med[name] / med["off"], min(ratios),
                         max(ratios), loop.gemm_lines()])  # fmt: skip
            out_rows.append(
                {
                    "recipe": recipe,
                    "variant": name,
                    "gemms_every": VARIANTS[name][1],
                    "recorder": VARIANTS[name][0],
                    "ms_per_step_median_of_rounds": med[name],
                    "x_off": med[name] / med["off"],
                    "x_off_per_round": ratios,
                    "ms_per_step_per_round": per_round[name],
                    "gemm_records": loop.gemm_lines(),
                    "steps_run": loop.step,
                    "final_loss": loop.losses[-1],
                    "timing": timings[f"{recipe}/{name}"].as_dict(),
                }
            )
            loop.close()
    caption = (
        f"width {base.width}, depth {base.depth}, batch {base.batch_size}x{base.seq_len}; "
        f"{repeats} rounds of {block} steps per variant ({blocks['every 1']} for every 1; "
        f"+{warm} warm-up), interleaved; "
        f"median over rounds of the mean step time; {a.threads} thread(s), {a.clock} clock; "
        f"{timing_s:.0f} s. Emulated low precision on the CPU."
    )
    print_table(
        "per-GEMM measurement overhead per training step",
        ["recipe", "variant", "ms/step", "x off", "x off min", "x off max", "GEMM records"],
        rows,
        caption,
    )

    attribution: dict[str, Any] = {}
    if a.attribute:
        arows = []
        for recipe in a.recipes:
            cfg = replace(base, recipe=recipe, steps=total, warmup=min(base.warmup, total))
            r = attribution[recipe] = attribute(cfg, root / "attr" / recipe, a.attribute)
            for part, ms in r["parts_ms"].items():
                arows.append([recipe, part, ms, ms / r["step_ms_off"]])
            extra = r["step_ms_measured"] - r["step_ms_off"]
            arows.append([recipe, "measured step - off step", extra, extra / r["step_ms_off"]])
        print_table(
            "where a measured step's extra time goes (every step measured)",
            ["recipe", "part", "ms per measured step", "share of an off step"],
            arows,
            f"{a.attribute} measured steps per recipe, alternating with an unmeasured model",
        )

    record = run_record(
        "gemms",
        "cpu",
        recipes=a.recipes,
        variants={k: {"recorder": r, "gemms_every": e} for k, (r, e) in VARIANTS.items()},
        block=block,
        blocks=blocks,
        warm=warm,
        repeats=repeats,
        threads=a.threads,
        clock=a.clock,
        config=replace(base, steps=total).to_dict(),
        timing_s=timing_s,
        rows=out_rows,
        attribution=attribution,
        argv=sys.argv[1:] if argv is None else argv,
    )
    path = write_json(record, a.out)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
