"""Training-step time of each recipe relative to FP32, eager and ``torch.compile``d.

Each recipe is built with ``lowprec.jobs.train.build`` at the demo's shape (``DEMO_CONFIG``)
and one step is ``lowprec.recipes.step.train_step``, the step ``lowprec train`` runs,
without the job's logging (no ``GradMeter``, no ``grad_stats``): set the lr (times each
group's ``lr_mult``); forward and scaled backward inside ``prepared.compute()``;
``scaler.step``; ``scaler.update``; ``zero_grad``. Batches are pre-drawn and cycled.
Compiled: ``prepared.model = torch.compile(prepared.model)``
(optimizer, scaler and master weights stay eager). The FP16 recipes' CPU compute context,
``MatmulInFp32``, is a torch function mode that dynamo traces through; they share one
graph, so only the first compiles (the others: graphs 0, compile s ~ one step). Column
``compiled``: the first and last steps' losses came out of a compiled graph (AOT-autograd
node), so a silent eager fall-back shows (and the run exits 1).

``--native-fp16`` adds the FP16 recipes outside the mode (torch's native CPU FP16 GEMMs,
~10x slower than FP32 without AVX512-FP16/AMX-FP16; an earlier run: ~5.5x fp32's step).

Timing: each variant has its own model, optimizer and scaler; its first step runs alone
(compiled: ``compile s``, the first compiled variant also paying torch.compile's start-up),
then ``--warmup`` steps and ``--steps`` single-step repeats, all variants interleaved
round by round (``_common.time_many``); medians reported. ``--threads`` defaults to 1 (on a
shared 2-core machine two OpenMP threads stall). ``--quick``: tiny model, 3 steps, JSON in
the temp dir. Aborts if a loss is not finite or a first-step loss differs from the
recipe's eager one by more than rounding.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from _common import (
    arg_parser,
    dynamo_counts,
    parse_args,
    print_table,
    ran_compiled,
    run_record,
    setup_torch,
    time_many,
    write_json,
)
from torch import Tensor

from lowprec.jobs.demo import DEMO_CONFIG
from lowprec.jobs.train import TrainConfig, build
from lowprec.recipes import get_recipe, recipe_names
from lowprec.recipes.step import train_step

QUICK_SHAPE: dict[str, Any] = {"batch_size": 4, "seq_len": 16, "width": 32, "depth": 1, "heads": 2}
N_BATCHES = 4  # distinct batches cycled through by the timed steps
# Allowed relative first-step loss difference against the recipe's eager step (loss ~4.2):
# reassociation and fused casts move it by a few units of the compute dtype's rounding.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 5e-3}


@dataclass
class Variant:
    recipe: str
    mode: str  # eager | compiled
    native_fp16: bool = False  # FP16 recipe run outside MatmulInFp32
    step: Callable[[], None] | None = None
    loss: Tensor | None = None  # loss of the latest step, autograd graph kept
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.recipe}/{self.mode}{', native' if self.native_fp16 else ''}"

    def ran_compiled(self) -> bool:
        """Whether the latest loss holds an AOT-autograd ``CompiledFunction`` node."""
        return ran_compiled(self.loss)


def _make_step(v: Variant, cfg: TrainConfig, batches: list[tuple[Tensor, Tensor]]) -> None:
    prepared, _ = build(replace(cfg, recipe=v.recipe))
    if v.mode == "compiled":
        prepared.model = torch.compile(prepared.model)  # type: ignore[assignment]
    # FP16 recipes have no autocast, so without the mode their compute context is empty.
    compute = contextlib.nullcontext if v.native_fp16 else None
    i = 0

    def step() -> None:
        nonlocal i
        x, y = batches[i % len(batches)]
        lr = cfg.lr_at(i % cfg.steps)
        i += 1
        v.loss = train_step(prepared, x, y, lr, compute=compute).loss

    v.step = step


def _first_step(v: Variant) -> None:
    """Run (for compiled variants: compile) the first step, recording time and counters."""
    assert v.step is not None
    before, t0 = dynamo_counts(), time.perf_counter()
    v.step()
    assert v.loss is not None
    v.info = {
        "first_step_s": time.perf_counter() - t0,
        "loss_first": float(v.loss.detach()),
        "dynamo": {k: n - before[k] for k, n in dynamo_counts().items()},
        "compiled_first": v.ran_compiled(),
    }
    print(
        f"  {v.key}: first step {v.info['first_step_s']:.2f} s, {v.info['dynamo']}", file=sys.stderr
    )


def _check_loss(v: Variant, eager: Variant | None, last: float) -> float | None:
    first: float = v.info["loss_first"]
    if not (math.isfinite(first) and math.isfinite(last)):
        raise SystemExit(f"FAIL {v.key}: non-finite loss (first {first}, last {last})")
    if eager is None or eager is v:
        return None
    ref: float = eager.info["loss_first"]
    rel = abs(first - ref) / abs(ref)
    r = get_recipe(v.recipe)
    if rel > (tol := LOSS_RTOL[r.autocast or r.param_dtype]):
        raise SystemExit(
            f"FAIL {v.key}: first-step loss {first!r} differs from eager "
            f"{ref!r} by {rel:.2e} (> {tol:g})"
        )
    return rel


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = arg_parser(__doc__, threads=1, modes=True, cold_compile=True,
                   quick=f"3 steps, shape {QUICK_SHAPE}")  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    p.add_argument("--recipes", default=",".join(recipe_names()), help="comma list")
    p.add_argument(
        "--native-fp16",
        action="store_true",
        help="also time FP16 recipes outside MatmulInFp32 (slow CPU FP16 GEMM)",
    )
    args = parse_args(p, argv, "recipes_cpu")
    recipes = [s.strip() for s in args.recipes.split(",") if s.strip()]
    if not recipes or any(s not in recipe_names() for s in recipes):
        p.error(f"--recipes must be a comma list of {', '.join(recipe_names())}")
    args.recipes = recipes
    if args.quick:
        args.steps, args.warmup = 3, 1
    if min(args.steps, args.warmup) < 1:
        p.error("--steps and --warmup must be >= 1")
    args.config = replace(DEMO_CONFIG, **QUICK_SHAPE) if args.quick else DEMO_CONFIG
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    setup_torch(args.threads, args.cold_compile)
    # CharGPT.forward is one code object compiled once per dtype / autocast / mode state.
    torch._dynamo.config.recompile_limit = 64
    cfg: TrainConfig = args.config
    _, data = build(replace(cfg, recipe="fp32"))
    batches = [data.batch("train", i) for i in range(N_BATCHES)]
    fp16 = {r: args.native_fp16 and get_recipe(r).param_dtype == "fp16" for r in args.recipes}
    variants = [
        Variant(r, m, native)
        for r in args.recipes
        for native in (False, True)[: 1 + fp16[r]]
        for m in args.modes
    ]
    t_start = time.perf_counter()
    for v in variants:
        _make_step(v, cfg, batches)
        _first_step(v)
    before = dynamo_counts()["graphs"]
    timings = time_many(
        {v.key: v.step for v in variants if v.step is not None},
        "cpu",
        repeats=args.steps,
        warmup=args.warmup,
        min_repeat_s=0.0,
    )
    graphs_while_timing = dynamo_counts()["graphs"] - before
    total_s = time.perf_counter() - t_start

    ms = {k: t.median_ms for k, t in timings.items()}
    rows: list[dict[str, Any]] = []
    for v in variants:
        assert v.loss is not None
        eager = next(
            (
                e
                for e in variants
                if e.recipe == v.recipe and e.mode == "eager" and e.native_fp16 == v.native_fp16
            ),
            None,
        )
        fp32, compiled = f"fp32/{v.mode}", v.mode == "compiled"
        last = float(v.loss.detach())
        rows.append(
            {
                "recipe": v.recipe,
                "variant": v.key.split("/", 1)[1],
                "mode": v.mode,
                "native_fp16": v.native_fp16,
                "median_ms": ms[v.key],
                "min_ms": timings[v.key].min_ms,
                "ratio_to_fp32": ms[v.key] / ms[fp32] if fp32 in ms else None,
                "compiled_over_eager": ms[v.key] / ms[eager.key] if compiled and eager else None,
                "compile_s": v.info["first_step_s"] if compiled else None,
                "dynamo": v.info["dynamo"],
                "ran_compiled": v.info["compiled_first"] and v.ran_compiled() if compiled else None,
                "loss0_rel_diff": _check_loss(v, eager, last),
                "loss_first": v.info["loss_first"],
                "loss_last": last,
                "first_step_s": v.info["first_step_s"],
                "timing": timings[v.key].as_dict(),
            }
        )
    record = run_record(
        "recipes",
        "cpu",
        config=cfg.to_dict(),
        recipes=args.recipes,
        modes=args.modes,
        steps=args.steps,
        warmup=args.warmup,
        threads=torch.get_num_threads(),
        native_fp16=args.native_fp16,
        cold_compile=args.cold_compile,
        step_body="lowprec.recipes.step.train_step (without GradMeter and grad_stats)",
        graphs_compiled_while_timing=graphs_while_timing,
        total_s=total_s,
        rows=rows,
    )
    path = write_json(record, args.out)
    _print(record, rows, path)
    silent = [r["recipe"] + "/" + r["variant"] for r in rows if r["ran_compiled"] is False]
    if silent or graphs_while_timing:
        print(
            f"FAIL: not compiled: {silent}; graphs compiled while timing: {graphs_while_timing}",
            file=sys.stderr,
        )
        return 1
    return 0


def _print(record: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    table = [
        [
            r["recipe"],
            r["variant"],
            r["median_ms"],
            r["min_ms"],
            r["ratio_to_fp32"],
            r["compiled_over_eager"],
            r["compile_s"],
            f"{r['dynamo']['graphs']}/{r['dynamo']['graph_breaks']}"
            if r["mode"] == "compiled"
            else "-",
            r["ran_compiled"],
            r["loss0_rel_diff"],
        ]
        for r in rows
    ]
    c, git = record["config"], record["git"]
    cache = "off (--cold-compile)" if record["cold_compile"] else "on (compile s may be warm)"
    caption = "\n".join(
        [
            f"CharGPT width {c['width']}, depth {c['depth']}, heads {c['heads']}; batch "
            f"{c['batch_size']}x{c['seq_len']}; AdamW. CPU, {record['threads']} thread(s), torch "
            f"{record['torch']}, git {git['commit']}{' (dirty)' if git['dirty'] else ''}; median "
            f"of {record['steps']} steps after {record['warmup']} warm-up, variants interleaved "
            f"({record['total_s']:.0f} s). Inductor caches {cache}.",
            "x fp32: vs fp32 in the same mode. compiled/eager: vs the recipe's eager step on the "
            "same matmul path. compile s: first step (compilation). graphs/breaks: new dynamo "
            "graphs / graph breaks in the first step (0 graphs: reuses an earlier recipe's "
            "graph). compiled: first and last step ran compiled code."
            + (
                " native: FP16 recipe outside MatmulInFp32 (torch's CPU FP16 GEMMs)."
                if record["native_fp16"]
                else ""
            ),
            f"JSON: {path}",
        ]
    )
    print_table(
        "Training step time per recipe",
        [
            "recipe",
            "step",
            "ms/step",
            "best ms",
            "x fp32",
            "compiled/eager",
            "compile s",
            "graphs/breaks",
            "compiled",
            "loss0 rel. diff",
        ],
        table,
        caption=caption,
    )


if __name__ == "__main__":
    raise SystemExit(main())
