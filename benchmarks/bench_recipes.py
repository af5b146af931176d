"""Training-step time of each recipe relative to FP32 on the reference model, eager and
``torch.compile``d.

Every recipe is built with ``lowprec.train.build(TrainConfig(recipe=...))`` at the demo's
shape (``lowprec.demo.DEMO_CONFIG``: batch, sequence length, width, depth, heads), and a
full training step is timed: set the lr, forward and scaled backward inside
``prepared.compute()``, ``scaler.step(optimizer)``, ``scaler.update()``, ``zero_grad()``.
That is the body of ``lowprec.train._train_step`` *without* its logging: no ``GradMeter``
hooks (a hook per ``nn.Linear`` output, a host sync per gradient) and no ``grad_stats``.
Batches are drawn once before timing and cycled. ``--modes ...,train-step`` adds rows that
call ``lowprec.train._train_step`` itself (meter and stats included), eager.

Compiled steps compile the model (``prepared.model = torch.compile(prepared.model)``):
forward and backward run inductor code; optimizer, loss scaler and master weights stay
eager. On CPU the FP16 recipes run forward and backward under the ``Fp16MatmulInFp32``
``TorchDispatchMode``, and dynamo does not trace while a non-infra dispatch mode is
active: it skips every frame and the "compiled" step runs eagerly, silently. Worse, dynamo
marks each skipped code object as skipped for good, so one such call also turns off the
compiled code of *every* compiled CharGPT in the process (any recipe, compiled before or
after) until ``torch._dynamo.reset()``. So the benchmark runs in phases:

1. FP16 recipes, compiled model under the mode (``compiled, mode on``): first step only,
   recording that nothing compiled; then ``torch._dynamo.reset()``.
2. Everything else, interleaved: eager steps; compiled steps; for FP16 recipes the compiled
   model called without the mode (``compiled, native fp16``: inductor code with torch's
   native CPU FP16 matmuls, a different and, on CPUs without AVX512-FP16/AMX-FP16, ~10x
   slower matmul path) and the same path eager (``eager, native fp16``; skip it with
   ``--no-native-eager``) for a like-for-like compiled/eager ratio.
3. The ``compiled, mode on`` steps, interleaved with their recipe's eager step; then one
   forward of each model compiled in phase 2 shows whether it still runs compiled code.

Timing: every variant is a separate model/optimizer/scaler; the first step is timed alone
(for compiled variants: compilation, reported as ``compile s``), then ``--warmup`` steps,
then ``--steps`` single-step repeats, the variants of a phase interleaved round by round
(``_common.time_many``); the result is the median. Threads default to 1: on a 2-core
machine shared with other jobs two OpenMP threads stall on each other (steps up to 30x
slower); pass ``--threads 2`` on an idle machine.

Usage::

    python benchmarks/bench_recipes.py [--steps N] [--warmup W] [--modes eager,compiled]
        [--recipes fp32,bf16,...] [--batch-size B] [--seq-len T] [--width D] [--depth L]
        [--heads H] [--threads T] [--no-native-eager] [--cold-compile] [--out PATH] [--quick]

It aborts (non-zero exit) if a loss is not finite, if the first-step loss of a variant
differs from the eager one of its recipe by more than rounding allows, or if a compiled
step of phase 2 stops running compiled code.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from _common import RESULTS_DIR, Timing, print_table, run_record, time_many, write_json
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lowprec.demo import DEMO_CONFIG
from lowprec.recipes import Prepared, get_recipe, recipe_names
from lowprec.train import GradMeter, TrainConfig, _train_step, build

MODES = ("eager", "compiled", "train-step")
QUICK_SHAPE = {"batch_size": 4, "seq_len": 16, "width": 32, "depth": 1, "heads": 2}
N_BATCHES = 4  # distinct batches cycled through by the timed steps
# Relative first-step loss difference allowed against the eager step of the same recipe:
# the loss is ~ln(65) = 4.2 at initialisation; reassociation (inductor fusion, FP32
# intermediates kept by inductor in bf16/fp16 code, another GEMM) moves it by a few
# units of the compute dtype's rounding, far below these bounds.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 5e-3}
NOTES = [
    "step: the body of lowprec.train._train_step without GradMeter hooks and grad_stats "
    "(set lr; forward + scaler.scale(loss).backward() inside prepared.compute(); "
    "scaler.step; scaler.update; zero_grad). Batches pre-drawn and cycled.",
    "train-step rows (if run): lowprec.train._train_step itself, eager, with GradMeter "
    "and grad_stats, as the training job and demo run it (batch drawn inside).",
    "compiled: prepared.model = torch.compile(prepared.model) (default backend inductor); "
    "optimizer, loss scaler and master-weight copies run eager.",
    "compiled, mode on: FP16 recipes on CPU run forward/backward under the "
    "Fp16MatmulInFp32 TorchDispatchMode; dynamo skips frames while a non-infra dispatch "
    "mode is active ('not supported today in torch.compile'), so nothing is compiled and "
    "the step runs eager (graphs 0). Dynamo also marks the skipped code objects as "
    "skipped for good, which turns off every other compiled CharGPT in the process until "
    "torch._dynamo.reset() (summary.dispatch_mode_turns_off_compiled_code): these rows "
    "are first-stepped before everything else, then reset, and timed last (phase 3) "
    "against their recipe's eager step.",
    "compiled, native fp16: the compiled model called without the mode: inductor code "
    "with torch's native CPU FP16 matmuls (slow on CPUs without AVX512-FP16/AMX-FP16).",
    "eager, native fp16: eager without the mode, the same matmul path.",
    "ms/step: median single-step time over the timed steps, the variants of a phase "
    "interleaved round by round; best ms: the fastest step.",
    "x fp32: ms/step over the fp32 recipe's ms/step in the same mode (eager rows vs fp32 "
    "eager, compiled rows vs fp32 compiled, train-step rows vs fp32 train-step); not "
    "given for 'compiled, mode on' (timed in another phase than fp32).",
    "compiled/eager: compiled ms/step over the eager ms/step of the same recipe on the "
    "same matmul path ('compiled, native fp16' vs 'eager, native fp16'; 'compiled, mode "
    "on' vs 'eager' timed with it in phase 3); < 1: compile is faster. JSON "
    "compiled_over_recipe_eager: vs the recipe's own eager step (mode on for FP16).",
    "compile s: time of the first step of a compiled variant (dynamo + AOT autograd + "
    "inductor for forward and backward, plus one step); the first compiled variant also "
    "pays torch.compile's start-up, and a model with the dtype and shape of one compiled "
    "before reuses its graph (graphs 0, compile s ~ one step). Inductor's on-disk caches "
    "are used unless the run says cold_compile (fx cache hits/misses recorded per row).",
    "graphs/breaks: dynamo graphs compiled and graph breaks during the first step.",
    "loss0 rel. diff: |first-step loss - eager first-step loss| / eager loss, same recipe, "
    "same initial weights and batch.",
]


# ---- variants -----------------------------------------------------------------------------


@dataclass
class Variant:
    """One timed configuration: a recipe, run eager or compiled, with or without the mode."""

    recipe: str
    mode: str  # eager | compiled | train-step
    label: str  # the step column of the table
    native_fp16: bool = False  # call the model without prepared.compute()'s dispatch mode
    under_mode: bool = False  # a compiled model called under a dispatch mode (own phase)
    prepared: Prepared | None = None
    step: Callable[[], None] | None = None
    last_loss: Tensor | None = None  # loss of the latest step, with its autograd graph
    losses: list[float] = field(default_factory=list)  # first and last step
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.recipe}/{self.label}"

    def ran_compiled(self) -> bool:
        """Whether the latest step ran compiled code (its loss came from a compiled graph)."""
        return self.last_loss is not None and _has_compiled_node(self.last_loss)


def _has_compiled_node(t: Tensor) -> bool:
    """True if ``t``'s autograd graph holds an AOT-autograd ``CompiledFunction`` node."""
    todo, seen = [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "CompiledFunction" in type(fn).__name__:
            return True
        todo.extend(nxt for nxt, _ in fn.next_functions)
    return False


def _dispatch_modes(prepared: Prepared) -> list[str]:
    """Names of the TorchDispatchModes that ``prepared.compute()`` enters."""
    with prepared.compute():
        return [type(m).__name__ for m in _get_current_dispatch_mode_stack()]


@contextlib.contextmanager
def _compute_without_mode(prepared: Prepared) -> Iterator[None]:
    """``prepared.compute()`` minus its dispatch mode. Only for recipes whose compute
    context is the dispatch mode alone (FP16 parameters: autocast is not allowed there)."""
    assert prepared.recipe.autocast is None, "native fp16 path only for non-autocast recipes"
    yield


def _make_step(v: Variant, cfg: TrainConfig, batches: list[tuple[Tensor, Tensor]]) -> None:
    """Build ``v.prepared`` and ``v.step`` (one training step; keeps the loss)."""
    prepared, data = build(cfg)
    if v.mode == "compiled":
        prepared.model = torch.compile(prepared.model)  # type: ignore[assignment]
    v.prepared = prepared
    i = 0

    if v.mode == "train-step":
        meter = GradMeter(prepared.model)

        def train_step() -> None:
            nonlocal i
            rec = _train_step(prepared, data, i % cfg.steps, cfg, meter)
            i += 1
            v.info["steps_run"] = i
            v.last_loss = torch.tensor(rec["loss"])

        v.step = train_step
        return

    compute = (lambda: _compute_without_mode(prepared)) if v.native_fp16 else prepared.compute

    def step() -> None:
        nonlocal i
        x, y = batches[i % len(batches)]
        for group in prepared.optimizer.param_groups:
            group["lr"] = cfg.lr_at(i % cfg.steps)
        i += 1
        v.info["steps_run"] = i
        with compute():
            _, loss = prepared.model(x, y)
            assert loss is not None
            prepared.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        prepared.scaler.step(prepared.optimizer)
        prepared.scaler.update()
        prepared.zero_grad()
        v.last_loss = loss

    v.step = step


def _variants(recipes: list[str], modes: list[str], native_eager: bool) -> list[Variant]:
    """The variants to time, per recipe: eager, compiled (for a recipe whose compute context
    enters a dispatch mode: compiled under the mode, and compiled without it), and with
    ``native_eager`` also eager without the mode."""
    out: list[Variant] = []
    tiny = {"batch_size": 1, "seq_len": 2, "width": 8, "depth": 1, "heads": 1}
    order = ["eager", "compiled", "compiled, mode on", "eager, native fp16",
             "compiled, native fp16", "train-step"]
    for r in recipes:
        probe, _ = build(replace(DEMO_CONFIG, recipe=r, **tiny))
        has_mode = bool(_dispatch_modes(probe))
        mine: list[Variant] = []
        for mode in modes:
            if mode == "compiled" and has_mode:
                mine.append(Variant(r, mode, "compiled, mode on", under_mode=True))
                mine.append(Variant(r, mode, "compiled, native fp16", native_fp16=True))
            else:
                mine.append(Variant(r, mode, mode))
            if mode == "eager" and has_mode and native_eager:
                mine.append(Variant(r, mode, "eager, native fp16", native_fp16=True))
        out += sorted(mine, key=lambda v: order.index(v.label))
    return out


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "frames_ok": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": counters["graph_break"].total(),
        "fx_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
    }


def _first_step(v: Variant) -> None:
    """Run the first step of ``v`` (compiling a compiled variant), recording what happened."""
    assert v.step is not None and v.last_loss is None
    before = _counters()
    t0 = time.perf_counter()
    v.step()
    v.info["first_step_s"] = time.perf_counter() - t0
    after = _counters()
    v.info["dynamo"] = {k: after[k] - before[k] for k in after}
    assert v.last_loss is not None
    v.losses.append(float(v.last_loss.detach()))
    if v.mode != "compiled":
        return
    v.info["ran_compiled"] = v.ran_compiled()
    graphs, breaks = v.info["dynamo"]["graphs"], v.info["dynamo"]["graph_breaks"]
    if v.info["ran_compiled"] and graphs == 0:
        v.info["note"] = "compiled (reuses a graph already compiled for the same dtype/shape)"
    elif v.info["ran_compiled"]:
        v.info["note"] = f"compiled: {graphs} graph(s), {breaks} graph break(s)"
    else:
        modes = _dispatch_modes(v.prepared) if v.prepared is not None else []
        why = f" ({', '.join(modes)} active)" if modes and v.under_mode else ""
        v.info["note"] = (
            f"NOT compiled: dynamo skipped every frame{why}, the step runs eager"
        )


def _time(variants: list[Variant], steps: int, warmup: int) -> dict[str, Timing]:
    """Interleaved timing (``_common.time_many``) of single steps; records the last loss."""
    calls = {v.key: v.step for v in variants if v.step is not None}
    timings = time_many(calls, "cpu", repeats=steps, warmup=warmup, min_repeat_s=0.0)
    for v in variants:
        assert v.last_loss is not None
        v.losses.append(float(v.last_loss.detach()))
    return timings


# ---- driver -------------------------------------------------------------------------------


def _csv(text: str, valid: list[str] | tuple[str, ...], flag: str, p: Any) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in valid]
    if not items or bad:
        p.error(f"{flag} must be a comma list of {', '.join(valid)}; got {text!r}")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    p.add_argument("--modes", default="eager,compiled", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--recipes", default=",".join(recipe_names()), help="comma list")
    for name in ("batch_size", "seq_len", "width", "depth", "heads"):
        flag = "--" + name.replace("_", "-")
        default = getattr(DEMO_CONFIG, name)
        p.add_argument(flag, type=int, default=None,
                       help=f"model/batch shape (default: the demo's, {default})")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--no-native-eager", dest="native_eager", action="store_false",
                   help="skip the eager FP16 steps without Fp16MatmulInFp32 (slow: ~5x fp32 "
                   "at the demo shape on a CPU without AVX512-FP16)")
    p.add_argument("--cold-compile", action="store_true",
                   help="disable inductor's caches so compile times are cold")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/recipes_cpu.json; with --quick, "
                   "a file in the temp dir so a smoke test never overwrites the real results)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny model (batch 4, seq 16, width 32, depth 1), 3 steps")
    args = p.parse_args(argv)
    args.modes = _csv(args.modes, MODES, "--modes", p)
    args.recipes = _csv(args.recipes, recipe_names(), "--recipes", p)
    if args.quick:
        args.steps, args.warmup = 3, 1
        for k, v in QUICK_SHAPE.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    if args.steps < 1 or args.warmup < 1 or args.threads < 1:
        p.error("--steps, --warmup and --threads must be >= 1")
    shape = {k: getattr(args, k) for k in QUICK_SHAPE if getattr(args, k) is not None}
    try:
        args.config = replace(DEMO_CONFIG, **shape)
    except ValueError as e:
        p.error(str(e))
    if args.out is None:
        folder = Path(tempfile.gettempdir()) / "lowprec_bench" if args.quick else RESULTS_DIR
        args.out = str(folder / f"recipes_cpu{'_quick' if args.quick else ''}.json")
    return args


def _check(v: Variant, eager: Variant | None) -> str:
    if not all(math.isfinite(x) for x in v.losses):
        raise SystemExit(f"FAIL {v.key}: non-finite loss {v.losses}")
    if eager is None or eager is v:
        return "-"
    rel = abs(v.losses[0] - eager.losses[0]) / abs(eager.losses[0])
    v.info["loss0_rel_diff"] = rel
    tol = LOSS_RTOL[get_recipe(v.recipe).autocast or get_recipe(v.recipe).param_dtype]
    if rel > tol:
        raise SystemExit(
            f"FAIL {v.key}: first-step loss {v.losses[0]!r} differs from eager "
            f"{eager.losses[0]!r} by {rel:.2e} (> {tol:g})"
        )
    return f"{rel:.1e}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    if args.cold_compile:
        inductor_config.force_disable_caches = True
    # One code object (CharGPT.forward) is compiled once per dtype/autocast state: keep
    # dynamo from falling back to eager after its default recompile limit.
    torch._dynamo.config.recompile_limit = 64
    cfg0: TrainConfig = args.config
    _, data = build(replace(cfg0, recipe="fp32"))
    batches = [data.batch("train", i) for i in range(N_BATCHES)]
    variants = _variants(args.recipes, args.modes, args.native_eager)
    t_start = time.perf_counter()

    def build_and_first_step(v: Variant) -> None:
        _make_step(v, replace(cfg0, recipe=v.recipe), batches)
        _first_step(v)
        note = f" - {v.info['note']}" if "note" in v.info else ""
        print(f"  built {v.key}: first step {v.info['first_step_s']:.2f} s{note}",
              file=sys.stderr)

    # Phase 1: compiled models called under a dispatch mode. Dynamo marks every code object
    # it skips there as "skip" for good, which also turns off code compiled before (any
    # CharGPT instance, any dtype) until torch._dynamo.reset(): probe them first, reset.
    under_mode = [v for v in variants if v.under_mode]
    main_vs = [v for v in variants if not v.under_mode]
    for v in under_mode:
        build_and_first_step(v)
    if under_mode:
        torch._dynamo.reset()

    # Phase 2: everything else, interleaved.
    for v in main_vs:
        build_and_first_step(v)
    timings = _time(main_vs, args.steps, args.warmup)
    for v in main_vs:
        if v.mode == "compiled" and v.info["ran_compiled"] and not v.ran_compiled():
            raise SystemExit(f"FAIL {v.key}: compiled at the first step, eager at the last")

    # Phase 3: the compiled-under-mode variants, interleaved with their recipe's eager step
    # (the comparison that matters for them), then check whether they turned off the
    # compiled code of the others.
    if under_mode:
        partners = [_partner(v, variants) for v in under_mode]
        extra = [p for p in partners if p is not None]
        t3 = _time(under_mode + extra, args.steps, args.warmup)
        for v, p in zip(under_mode, partners, strict=True):
            timings[v.key] = t3[v.key]
            v.info["eager_same_phase_ms"] = t3[p.key].median_ms if p is not None else None
    poison = _poison_check(main_vs, batches[0]) if under_mode else None
    total_s = time.perf_counter() - t_start

    rows = _rows(variants, timings)
    summary = _summary(args.recipes, rows)
    if poison is not None:
        summary["dispatch_mode_turns_off_compiled_code"] = poison

    record = run_record(
        "recipes",
        "cpu",
        config=cfg0.to_dict(),
        shape={k: getattr(cfg0, k) for k in QUICK_SHAPE},
        recipes=args.recipes,
        modes=args.modes,
        steps=args.steps,
        warmup=args.warmup,
        threads=torch.get_num_threads(),
        cold_compile=args.cold_compile,
        step_body="replicated lowprec.train._train_step without GradMeter and grad_stats",
        total_s=total_s,
        notes=NOTES,
        summary=summary,
        rows=rows,
    )
    path = write_json(record, args.out)
    _print(record, rows, path)
    return 0


def _partner(v: Variant, variants: list[Variant]) -> Variant | None:
    """The eager variant of ``v``'s recipe on the same matmul path (mode on / native)."""
    return next((e for e in variants if e.recipe == v.recipe and e.mode == "eager"
                 and e.native_fp16 == v.native_fp16), None)


def _rows(variants: list[Variant], timings: dict[str, Timing]) -> list[dict[str, Any]]:
    fp32_of = {v.mode: timings[v.key].median_ms for v in variants
               if v.recipe == "fp32" and not v.native_fp16 and not v.under_mode}
    rows: list[dict[str, Any]] = []
    for v in variants:
        t = timings[v.key]
        recipe_eager = next((e for e in variants if e.recipe == v.recipe and e.label == "eager"),
                            None)
        partner = _partner(v, variants)
        # Compiled under the mode: timed in phase 3, against the eager step timed with it.
        fp32_ms = None if v.under_mode else fp32_of.get(v.mode)
        same_ms = recipe_ms = None
        if v.mode == "compiled" and v.under_mode:
            same_ms = recipe_ms = v.info.get("eager_same_phase_ms")
        elif v.mode == "compiled":
            same_ms = timings[partner.key].median_ms if partner is not None else None
            recipe_ms = timings[recipe_eager.key].median_ms if recipe_eager else None
        rows.append({
            "recipe": v.recipe,
            "mode": v.mode,
            "variant": v.label,
            "native_fp16": v.native_fp16,
            "timed_in_phase": 3 if v.under_mode else 2,
            "median_ms": t.median_ms,
            "min_ms": t.min_ms,
            "ratio_to_fp32": t.median_ms / fp32_ms if fp32_ms else None,
            "compiled_over_eager": t.median_ms / same_ms if same_ms else None,
            "compiled_over_recipe_eager": t.median_ms / recipe_ms if recipe_ms else None,
            "compile_s": v.info["first_step_s"] if v.mode == "compiled" else None,
            "first_step_s": v.info["first_step_s"],
            "ran_compiled": v.info.get("ran_compiled"),
            "dynamo": v.info["dynamo"],
            "note": v.info.get("note", ""),
            "check": _check(v, recipe_eager),
            "loss_first": v.losses[0],
            "loss_last": v.losses[-1],
            "steps_run": v.info["steps_run"],
            "timing": t.as_dict(),
        })
    return rows


def _summary(recipes: list[str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per recipe: the eager step and the compiled step that really ran compiled code."""
    summary: dict[str, Any] = {}
    for r in recipes:
        mine = [row for row in rows if row["recipe"] == r]
        e = next((row for row in mine if row["variant"] == "eager"), None)
        c = [row for row in mine if row["mode"] == "compiled"]
        real = next((row for row in c if row["ran_compiled"]), None)
        summary[r] = {
            "eager_ms": e and e["median_ms"],
            "eager_ratio_to_fp32": e and e["ratio_to_fp32"],
            "compiled_ms": real and real["median_ms"],
            "compiled_variant": real and real["variant"],
            "compiled_ratio_to_fp32": real and real["ratio_to_fp32"],
            "compiled_over_eager_same_matmul_path": real and real["compiled_over_eager"],
            "compiled_over_recipe_eager": real and real["compiled_over_recipe_eager"],
            "compile_s": real and real["compile_s"],
            "compile_note": "; ".join(f"{row['variant']}: {row['note']}" for row in c) or None,
        }
    return summary


def _poison_check(main_vs: list[Variant], batch: tuple[Tensor, Tensor]) -> dict[str, Any]:
    """After phase 3: does a model compiled in phase 2 still run compiled code? One
    forward (no step) of each compiled phase-2 variant that did."""
    still: dict[str, bool] = {}
    for v in main_vs:
        if v.mode != "compiled" or not v.info["ran_compiled"] or v.prepared is None:
            continue
        ctx = _compute_without_mode(v.prepared) if v.native_fp16 else v.prepared.compute()
        with ctx:
            _, loss = v.prepared.model(*batch)
        assert loss is not None
        still[v.key] = _has_compiled_node(loss)
    return {
        "question": "after the compiled-under-mode steps, do the models compiled before "
        "still run compiled code?",
        "still_compiled": still,
        "answer": "no, all turned off" if still and not any(still.values()) else
        "yes" if still and all(still.values()) else "some" if still else "n/a",
    }


def _print(record: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    table_rows = [
        [
            r["recipe"], r["variant"], r["median_ms"], r["min_ms"], r["ratio_to_fp32"],
            r["compiled_over_eager"], r["compile_s"],
            (f"{r['dynamo']['graphs']}/{r['dynamo']['graph_breaks']}"
             if r["mode"] == "compiled" else "-"),
            r["check"],
        ]
        for r in rows
    ]
    git = record["git"]
    c = record["config"]
    caption = [
        f"CharGPT width {c['width']}, depth {c['depth']}, heads {c['heads']}; batch "
        f"{c['batch_size']}x{c['seq_len']}; AdamW. CPU, {record['threads']} thread(s), torch "
        f"{record['torch']}, git {git['commit']}{' (dirty)' if git['dirty'] else ''}; "
        f"median of {record['steps']} steps after {record['warmup']} warm-up, interleaved "
        f"({record['total_s']:.0f} s).",
        "Step = train.py's step without GradMeter hooks and grad_stats. x fp32: vs fp32 in "
        "the same mode; compiled/eager: vs the recipe's eager step on the same matmul path.",
    ]
    if any(r["native_fp16"] for r in rows):
        caption.append(
            "FP16 recipes: 'mode on' = under Fp16MatmulInFp32, where dynamo compiles nothing "
            "(timed in a separate phase against eager); 'native fp16' = without the mode "
            "(torch's CPU FP16 GEMMs)."
        )
    compiled = [r for r in rows if r["mode"] == "compiled"]
    if compiled:
        hits = sum(r["dynamo"]["fx_cache_hit"] for r in compiled)
        misses = sum(r["dynamo"]["fx_cache_miss"] for r in compiled)
        cache = "disabled (--cold-compile)" if record["cold_compile"] else (
            f"on: {hits} hit(s), {misses} miss(es); a warm cache makes 'compile s' much "
            "shorter than a first compile")
        caption.append(f"Inductor FX graph cache {cache}.")
    poison = record["summary"].get("dispatch_mode_turns_off_compiled_code")
    if poison is not None:
        caption.append(
            "After the 'mode on' steps, do the models compiled in phase 2 still run compiled "
            f"code? {poison['answer']} ({sum(poison['still_compiled'].values())}/"
            f"{len(poison['still_compiled'])} still compiled)."
        )
    caption.append(f"JSON: {path}")
    print_table(
        "Training step time per recipe",
        ["recipe", "step", "ms/step", "best ms", "x fp32", "compiled/eager", "compile s",
         "graphs/breaks", "loss0 rel. diff"],
        table_rows,
        caption="\n".join(caption),
    )


if __name__ == "__main__":
    raise SystemExit(main())
