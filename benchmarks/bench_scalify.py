"""Step time (forward + backward + AdamW) of the scalify'd CharGPT (fp16 and fp8 data)
against the plain FP32 CharGPT at the demo shape, eager and ``torch.compile``d, and the
ratios.

Issue 6's goals: scalify eager <= 1.5x plain eager, compiled <= 1.1x plain compiled.
Eager scalify runs every aten op through a Python ``__torch_dispatch__`` rule and rounds
each output to FP16 (CPU GEMMs run in FP32 on the FP16 values), so its overhead is the
dispatch plus the casts; compiled, the rules are traced away and inductor fuses the casts.
``--threads`` defaults to 1 (shared 2-core machine); ``--quick``: tiny shape, temp JSON;
``--no-compile`` skips the compiled rows; ``--fused`` adds eager rows with scalify's
fused rule kernels on (``LOWPREC_SCALIFY_FUSED=1`` during their steps) and
``--kernels-off`` rows with every compiled eager kernel off (``LOWPREC_EAGER_KERNELS=0``),
interleaved with the others: their effect in one run; ``--train-steps 300`` also trains FP32,
fp16-scalify and fp8-scalify at the demo config and records their val losses (issue 6's
goal: within 1% of FP32); ``--profile N`` profiles N steps of each row after the timing
(``_common.profile_many``: GEMMs, inductor's kernels, other ops, Python). Compiled models
are compiled (and checked to run their compiled graph) before timing: their "first call"
column excludes compilation, recorded as ``compile_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from _common import (
    arg_parser,
    env,
    lm_step_fn,
    parse_args,
    print_mode_ratio_table,
    print_profiles,
    print_table,
    profile_many,
    ran_compiled,
    reference_lm_setup,
    run_record,
    setup_torch,
    time_fn,
    time_many,
    write_json,
)

from lowprec.jobs.model import CharGPT
from lowprec.jobs.train import build, evaluate
from lowprec.recipes.step import train_step
from lowprec.scalify import apply, coverage, reset_coverage


def train_val_loss(recipe: str, steps: int) -> dict[str, Any]:
    """Train CharGPT with ``recipe`` (``fp32``, ``fp16-scalify``, ``fp8-scalify``) at the demo
    config (lowprec.jobs.demo.DEMO_CONFIG: width 64, depth 2, heads 4, seq 128, batch 32,
    AdamW lr 3e-3, warm-up 20 + cosine; ``steps`` steps): the training job's model, data,
    seed (``lowprec.jobs.train.build``), step and validation loss (``evaluate``); each
    step timed by ``_common.time_fn`` (one step per repeat, in order)."""
    from lowprec.jobs.demo import DEMO_CONFIG

    cfg = replace(DEMO_CONFIG, recipe=recipe)
    prepared, data = build(cfg)
    state: dict[str, Any] = {"step": 0, "loss": None}

    def step() -> None:
        i = state["step"]
        x, y = data.batch("train", i)
        lr = cfg.lr_at(i) if steps == cfg.steps else cfg.lr
        state["loss"] = train_step(prepared, x, y, lr).loss
        state["step"] = i + 1

    t = time_fn(step, repeats=steps - 1, warmup=1, min_repeat_s=0.0)
    return {"val_loss": evaluate(prepared, data, cfg.eval_batches),
            "train_loss": float(state["loss"].detach()),
            "median_ms_per_step": t.median_ms}  # fmt: skip


def _with_env(step: Callable[[], None], var: str, value: str) -> Callable[[], None]:
    """``step`` run with the environment variable ``var`` set to ``value``."""

    def run() -> None:
        with env(var, value):
            step()

    return run


def main() -> None:
    ap = arg_parser(__doc__, threads=1, repeats=5, clock=True, profile=True,
                    quick="tiny shape")  # fmt: skip
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--fused", action="store_true",
                    help="also time fp16/fp8 eager with LOWPREC_SCALIFY_FUSED=1 during "
                    "their steps (scalify's fused rule kernels on): an in-process A/B")  # fmt: skip
    ap.add_argument("--kernels-off", action="store_true",
                    help="also time fp16/fp8 eager with LOWPREC_EAGER_KERNELS=0 during "
                    "their steps (no compiled eager kernels): an in-process A/B")  # fmt: skip
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also train fp32/fp16/fp8 at the demo config (300: the demo)")  # fmt: skip
    a = parse_args(ap, None, "scalify_cpu")
    if a.train_steps == 1:
        ap.error("--train-steps must be 0 or >= 2 (the first step is not timed)")
    setup_torch(a.threads, cold_compile=False)
    import torch._inductor.config as inductor_config

    # Compiled scalify rounds every op's output to FP16 as eager does (inductor otherwise
    # keeps fused FP16 round trips in FP32: faster, but not the numerics of the format).
    inductor_config.emulate_precision_casts = True
    shape, cfg, batches = reference_lm_setup(a.quick)
    modes = ("eager",) if a.no_compile else ("eager", "compiled")
    calls, compiled_ok, compile_s = {}, {}, {}
    for name in ("plain", "fp16-scalify", "fp8-scalify"):
        for mode in modes:
            torch.manual_seed(0)
            base = CharGPT(cfg)
            m = base if name == "plain" else apply(base, name.split("-")[0])
            opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
            run = torch.compile(m) if mode == "compiled" else m
            calls[f"{name}/{mode}"] = lm_step_fn(run, opt, batches)
            if mode == "compiled":  # compile now, and check the graph really is used
                t0 = time.perf_counter()
                _, loss = run(*batches[0])
                compile_s[name] = time.perf_counter() - t0
                compiled_ok[name] = ran_compiled(loss)
    extra = [("fused", "LOWPREC_SCALIFY_FUSED", "1")] if a.fused else []
    extra += [("kernels off", "LOWPREC_EAGER_KERNELS", "0")] if a.kernels_off else []
    for label, var, value in extra:
        for name in ("fp16-scalify", "fp8-scalify"):
            torch.manual_seed(0)
            base = CharGPT(cfg)
            m = apply(base, name.split("-")[0])
            opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
            step = _with_env(lm_step_fn(m, opt, batches), var, value)
            calls[f"{name} {label}/eager"] = step
    reset_coverage()
    t = time_many(calls, repeats=a.repeats, warmup=3, min_repeat_s=0.3, clock=a.clock)
    print_mode_ratio_table("scalify'd vs plain FP32 CharGPT step (fwd+bwd+AdamW)", t,
                           "plain", "x plain (same mode)")  # fmt: skip
    rec = run_record("bench_scalify", "cpu", shape=shape, threads=a.threads, clock=a.clock)
    rec["timings"] = {k: v.as_dict() for k, v in t.items()}
    for fmt in ("fp16", "fp8"):
        for mode in modes:
            rec[f"ratio_{fmt}_{mode}"] = (
                t[f"{fmt}-scalify/{mode}"].median_ms / t[f"plain/{mode}"].median_ms
            )
        for label, _, _ in extra:
            rec[f"ratio_{fmt}_eager_{label.replace(' ', '_')}"] = (
                t[f"{fmt}-scalify {label}/eager"].median_ms / t["plain/eager"].median_ms
            )
    rec["goal_ratio_eager"], rec["goal_ratio_compiled"] = 1.5, 1.1
    rec["compiled_graph_used"] = compiled_ok
    rec["compile_s"] = compile_s
    rec["inductor_emulate_precision_casts"] = True
    rec["fallbacks"] = coverage().fallbacks
    if a.profile:
        profiles = profile_many(calls, a.profile)
        print_profiles(f"self CPU ms per step, {a.profile} profiled steps", profiles)
        rec["profile_steps"] = a.profile
        rec["profiles"] = {k: v.as_dict() for k, v in profiles.items()}
    print({k: round(v, 3) for k, v in rec.items() if k.startswith("ratio_")})
    if a.train_steps:
        recipes = {"fp32": "fp32", "fp16": "fp16-scalify", "fp8": "fp8-scalify"}
        runs = {f: train_val_loss(r, a.train_steps) for f, r in recipes.items()}
        ref = runs["fp32"]["val_loss"]
        for r in runs.values():
            r["val_gap_vs_fp32"] = r["val_loss"] / ref - 1.0
        rec["demo_training"] = {"steps": a.train_steps, "goal_val_gap": 0.01, "runs": runs}
        print_table(f"demo-config training, {a.train_steps} steps",
                    ["run", "val loss", "gap vs fp32", "ms/step"],
                    [[f, r["val_loss"], r["val_gap_vs_fp32"], r["median_ms_per_step"]]
                     for f, r in runs.items()])  # fmt: skip
    write_json(rec, a.out)


if __name__ == "__main__":
    main()
