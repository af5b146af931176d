"""Float8 training: fwd+bwd time, accuracy and saved-activation memory of ``Float8Linear``.

Model: ``Linear(d, 4d) -> GELU -> Linear(4d, d)`` on ``--batch`` tokens (default 512) at
each ``--dims`` (default 1024). One step is ``zero_grad``, ``y = model(x)``,
``loss = (y * g).sum()``, ``loss.backward()`` with a fixed random ``g``; it is timed in
full, eager and ``torch.compile(model)``, every variant side by side in one run:

* ``fp32``: the plain model; ``bf16``: the plain model with bf16 parameters and input;
* ``lowprec <preset>``: fp32 parameters (the master weights) and input,
  ``lowprec.float8.convert_to_float8(model, Float8Config.from_name(preset, ...))``:
  ``tensorwise`` (fp32 emulation, the default), ``tensorwise bf16-emu``
  (``emulation_dtype="bf16"``), ``rowwise``, ``rowwise fp8-saved``
  (``fp8_saved_activations=True``; the preset saves the high-precision input) and
  ``mxfp8``; plus ``tensorwise bf16``: the default recipe on *bf16* parameters and input,
  as the demo's fp8 recipes run (the like-for-like memory comparison with ``bf16``);
* ``torchao tensorwise emulate``: the peer baseline,
  ``torchao.float8.convert_to_float8_training(model,
  config=Float8LinearConfig(emulate=True))`` on the fp32 model. Skipped, with a note, if
  torchao does not import.

Every variant starts from one fp32 model (``copy.deepcopy``) and uses the same ``x ~ N(0, 1)``
and ``g``. Timing: each variant's first step runs alone (compiled: ``compile s``, the first
compiled variant also paying torch.compile's start-up; inductor's on-disk caches are used
unless ``--cold-compile``), then ``_common.time_many`` (2 warm-up steps, ``--repeats``
repeats, variants interleaved round by round); the median is reported. ``x fp32`` and
``x torchao`` divide by the fp32 / torchao row of the same mode.

Accuracy (from the first step of each variant and mode) against an fp64 copy of the same
model, input and ``g``: SQNR in dB, ``10 log10(sum ref^2 / sum (v - ref)^2)``, of the
output ``y``, the input gradient ``dx`` and the first layer's weight gradient ``dW1``.

Memory: the activation memory saved for backward by one forward, measured with
``torch.autograd.graph.saved_tensors_hooks``: the bytes of the storages
(``untyped_storage().nbytes()``, de-duplicated by ``data_ptr``; tensor subclasses are
flattened to their inner tensors) of every tensor saved, *excluding* the parameters'
storages. The model input ``x`` counts when a layer saves it (the fp32 and bf16 models do;
the caller keeps ``x`` alive anyway in this benchmark). Reported for the MLP and for a pure
stack of ``STACK_DEPTH`` ``Linear(d, d)`` layers (no activation function, so only the linear
layers save activations; memory and accuracy only, not timed), eager and compiled (the
compiled graph's saved tensors are chosen by AOTAutograd's partitioner), each as a ratio to
the bf16 model of the same mode. Goal of the float8 work: FP8-saved activations at most
0.6x bf16. The GELU saves its own (fp32 or bf16) input, which bounds what the MLP can reach.

Threads: ``--threads`` defaults to 1, as in ``bench_recipes.py``: on the shared 2-core
machine of ``results/float8_cpu.json`` two OpenMP threads stall whenever another process holds
a core. A trial at d=1024 (eager, load average ~3 from other processes) measured every
variant 1.5x (fp32) to 4.6x (mxfp8) *slower* with 2 threads than with 1. On a dedicated
machine pass ``--threads`` = the number of physical cores.

``--shapes MxKxN,...`` (default none on CPU) also times one ``Linear(K, N, bias=False)`` on
``M`` tokens (fwd+bwd, 6MKN flops; same variants, accuracy and memory columns).

``--device cuda`` (run once, on an H200 at 69b0546: ``results/float8_cuda_h200.json``):
lowprec with its default ``emulate=None`` (``torch._scaled_mm`` on sm89+; the mxfp8 preset
emulates) and torchao with ``emulate=False``, on *bf16* parameters and input (the fp32 row
stays fp32; the bf16-emu row, identical to ``tensorwise`` on the hardware path, is dropped);
``--shapes`` defaults to ``1024x1024x4096,4096x4096x4096,4096x8192x16384``; the peak memory
of the second step above the memory allocated before it
(``torch.cuda.max_memory_allocated``) is reported too.

``--quick``: d=64, batch 32, one 32x64x128 shape, 2 repeats; compiled mode only for the MLP
and only for ``QUICK_COMPILED`` (compiling everything takes minutes); JSON in the temp dir.

Usage::

    python benchmarks/bench_float8.py [--dims 1024,4096] [--batch 512] [--repeats 7]
        [--modes eager,compiled] [--threads 1] [--device cpu|cuda] [--shapes MxKxN,...]
        [--cold-compile] [--out benchmarks/results/float8_cpu.json] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from _common import (
    arg_parser,
    dynamo_counts,
    fp64_reference,
    fwd_bwd_step,
    mlp,
    optional_import,
    package_version,
    parse_args,
    print_table,
    ran_compiled,
    run_record,
    setup_torch,
    sqnr_db,
    synchronize,
    time_many,
    write_json,
)
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lowprec.float8 import Float8Config, convert_to_float8

STACK_DEPTH = 4
QUICK = {"dims": [64], "batch": 32, "repeats": 2, "shapes": [(32, 64, 128)]}
QUICK_COMPILED = ("fp32", "lowprec tensorwise", "torchao tensorwise emulate", "torchao tensorwise")
CUDA_SHAPES = [(1024, 1024, 4096), (4096, 4096, 4096), (4096, 8192, 16384)]
MIB = 2**20


def _torchao() -> tuple[Any, Any] | str:
    """``(convert_to_float8_training, Float8LinearConfig)`` or why torchao is unusable."""
    ao = optional_import("torchao.float8")
    return ao if isinstance(ao, str) else (ao.convert_to_float8_training, ao.Float8LinearConfig)


# ---- variants ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One variant: ``kind`` plain / lowprec / torchao; ``dtype`` of parameters and input."""

    name: str
    kind: str
    dtype: torch.dtype
    recipe: Float8Config | None = None


def variant_specs(device: torch.device, torchao_ok: bool) -> list[Spec]:
    cuda = device.type == "cuda"
    master = torch.bfloat16 if cuda else torch.float32  # the float8 variants' parameters
    specs = [Spec("fp32", "plain", torch.float32), Spec("bf16", "plain", torch.bfloat16)]
    lp = [
        ("tensorwise", Float8Config.from_name("tensorwise")),
        ("tensorwise bf16-emu", Float8Config.from_name("tensorwise", emulation_dtype="bf16")),
        ("rowwise", Float8Config.from_name("rowwise")),
        ("rowwise fp8-saved", Float8Config.from_name("rowwise", fp8_saved_activations=True)),
        ("mxfp8", Float8Config.from_name("mxfp8")),
    ]
    specs += [
        Spec(f"lowprec {n}", "lowprec", master, r)
        for n, r in lp
        if not (cuda and n == "tensorwise bf16-emu")
    ]
    if not cuda:  # as the demo's fp8 recipes run: bf16 parameters and activations
        specs.append(
            Spec(
                "lowprec tensorwise bf16",
                "lowprec",
                torch.bfloat16,
                Float8Config.from_name("tensorwise"),
            )
        )
    if torchao_ok:
        specs.append(Spec(f"torchao tensorwise{'' if cuda else ' emulate'}", "torchao", master))
    return specs


TORCHAO: tuple[Any, Any] | str = "not checked"


def build(spec: Spec, base: nn.Module, device: torch.device) -> nn.Module:
    """A fresh copy of the fp32 ``base`` model converted to ``spec``."""
    m = copy.deepcopy(base).to(device=device, dtype=spec.dtype)
    if spec.kind == "lowprec":
        assert spec.recipe is not None
        return convert_to_float8(m, spec.recipe)
    if spec.kind == "torchao":
        assert not isinstance(TORCHAO, str)
        convert, config = TORCHAO
        converted: nn.Module = convert(m, config=config(emulate=device.type != "cuda"))
        return converted
    return m


# ---- measurements -------------------------------------------------------------------------


def _storages(t: Tensor) -> list[Tensor]:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for n in names for s in _storages(getattr(t, n))]
    return [t]


def saved_activations(
    fn: Callable[[Tensor], Tensor], model: nn.Module, x: Tensor
) -> dict[str, Any]:
    """Bytes of the non-parameter storages saved for backward by one forward ``fn(x)``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}

    def pack(t: Tensor) -> Tensor:
        for s in _storages(t):
            ptr = s.untyped_storage().data_ptr()
            if ptr not in params and ptr not in seen:
                dtype = str(s.dtype).removeprefix("torch.")
                seen[ptr] = (s.untyped_storage().nbytes(), f"{dtype}{list(s.shape)}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    del y  # frees the graph and the saved tensors
    return {
        "bytes": sum(b for b, _ in seen.values()),
        "tensors": sorted((d for _, d in seen.values()), key=str),
    }


def _dynamo_counts() -> tuple[int, int]:
    c = dynamo_counts()
    return c["graphs"], c["graph_breaks"]


@dataclass
class Case:
    """A model and its data: ``x`` (fp32) and ``g`` on the device; ``timed``: run time_many."""

    name: str
    dim: int
    base: nn.Module
    x: Tensor
    g: Tensor
    timed: bool
    flops: float | None = None  # per fwd+bwd step, for TFLOP/s
    modes: list[str] | None = None  # overrides --modes (``--quick``: the extra cases eager)


def run_case(
    case: Case,
    specs: list[Spec],
    modes: list[str],
    repeats: int,
    device: torch.device,
    compile_only: tuple[str, ...] | None = None,
) -> list[dict[str, Any]]:
    """Build, first-step (compile), check accuracy and memory of every variant; time them.
    ``compile_only``: the variants run in compiled mode (default all)."""
    cuda = device.type == "cuda"
    modes = case.modes or modes
    y_ref, dx_ref, dw_ref = fp64_reference(case.base, case.x, case.g)

    rows: list[dict[str, Any]] = []
    calls: dict[str, Callable[[], Any]] = {}
    for spec in specs:
        try:
            model = build(spec, case.base, device)
        except Exception as e:
            print(f"  {case.name} {spec.name}: build FAILED: {e}", file=sys.stderr)
            rows += [
                {
                    "case": case.name,
                    "dim": case.dim,
                    "variant": spec.name,
                    "mode": m,
                    "error": f"build: {type(e).__name__}: {e}",
                }
                for m in modes
            ]
            continue
        x = case.x.detach().to(spec.dtype).clone().requires_grad_(True)
        g = case.g.to(spec.dtype)
        w1 = next(p for n, p in model.named_parameters() if n.endswith("weight"))
        for mode in modes:
            if mode == "compiled" and compile_only is not None and spec.name not in compile_only:
                continue
            fn: Callable[[Tensor], Tensor] = torch.compile(model) if mode == "compiled" else model
            step = fwd_bwd_step(fn, model, x, g)
            row: dict[str, Any] = {
                "case": case.name,
                "dim": case.dim,
                "variant": spec.name,
                "mode": mode,
                "dtype": str(spec.dtype).removeprefix("torch."),
            }
            if spec.recipe is not None:
                row["recipe"] = spec.recipe.to_dict()
            try:
                graphs0, breaks0 = _dynamo_counts()
                t0 = time.perf_counter()
                y = step()
                synchronize(device)
                first_s = time.perf_counter() - t0
                graphs1, breaks1 = _dynamo_counts()
                assert x.grad is not None and w1.grad is not None
                row.update(
                    {
                        "first_step_s": first_s,
                        "compile_s": first_s if mode == "compiled" else None,
                        "graphs": graphs1 - graphs0 if mode == "compiled" else None,
                        "graph_breaks": breaks1 - breaks0 if mode == "compiled" else None,
                        "ran_compiled": ran_compiled(y) if mode == "compiled" else None,
                        "sqnr_y_db": sqnr_db(y.detach(), y_ref),
                        "sqnr_dx_db": sqnr_db(x.grad, dx_ref),
                        "sqnr_dw1_db": sqnr_db(w1.grad, dw_ref),
                    }
                )
                del y
                if cuda:  # peak of a second (compiled: warm) step above what is allocated
                    model.zero_grad(set_to_none=True)
                    x.grad = None
                    synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    mem0 = torch.cuda.memory_allocated(device)
                    step()
                    synchronize(device)
                    row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - mem0) / MIB
                mem = saved_activations(fn, model, x)
                row["saved_bytes"], row["saved_tensors"] = mem["bytes"], mem["tensors"]
                model.zero_grad(set_to_none=True)
                x.grad = None
                if case.timed:
                    calls[f"{spec.name}/{mode}"] = step
            except Exception as e:
                tb = traceback.format_exc(limit=-3)
                print(f"  {case.name} {spec.name} {mode}: FAILED\n{tb}", file=sys.stderr)
                row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            rows.append(row)
            print(
                f"  {case.name} {spec.name} {mode}: first step "
                f"{row.get('first_step_s', float('nan')):.2f} s",
                file=sys.stderr,
            )

    if calls:
        graphs0, _ = _dynamo_counts()
        timings = time_many(calls, device, repeats=repeats, warmup=2)
        graphs_while_timing = _dynamo_counts()[0] - graphs0
        for row in rows:
            t = timings.get(f"{row['variant']}/{row['mode']}")
            if t is not None:
                row["median_ms"], row["timing"] = t.median_ms, t.as_dict()
                row["graphs_while_timing"] = graphs_while_timing
                if case.flops:
                    row["tflops"] = case.flops / (t.median_ms * 1e-3) / 1e12
    _ratios(rows)
    return rows


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Time ratios to fp32 / bf16 / torchao and saved-memory ratio to bf16, per mode."""
    by = {(r["variant"], r["mode"]): r for r in rows}
    for r in rows:
        for key, other in (("x_fp32", "fp32"), ("x_bf16", "bf16"), ("x_torchao", None)):
            name = other or next(
                (v for v, m in by if v.startswith("torchao") and m == r["mode"]), None
            )
            o = by.get((name, r["mode"])) if name else None
            if "median_ms" in r and o is not None and "median_ms" in o:
                r[key] = r["median_ms"] / o["median_ms"]
        o = by.get(("bf16", r["mode"]))
        if "saved_bytes" in r and o is not None and o.get("saved_bytes"):
            r["saved_x_bf16"] = r["saved_bytes"] / o["saved_bytes"]


# ---- driver -----------------------------------------------------------------------------


def _stack(d: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(d, d) for _ in range(STACK_DEPTH)))


def cases(
    dims: list[int],
    batch: int,
    shapes: list[tuple[int, int, int]],
    device: torch.device,
    extra_modes: list[str] | None = None,
) -> list[Case]:
    """The MLP and the Linear stack at each dim, then the ``shapes``; ``extra_modes``
    overrides the modes of all but the MLP cases."""
    out: list[Case] = []

    def data(rows: int, d_in: int, d_out: int, seed: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, d_in, generator=gen)
        g = torch.randn(rows, d_out, generator=gen)
        return x.to(device), g.to(device)

    for d in dims:
        torch.manual_seed(d)
        x, g = data(batch, d, d, d + 1)
        out.append(
            Case(f"mlp d={d}", d, mlp(d), x, g, timed=True, flops=6.0 * batch * d * 4 * d * 2)
        )
        torch.manual_seed(d + 2)
        out.append(
            Case(
                f"stack {STACK_DEPTH}x linear d={d}",
                d,
                _stack(d),
                x,
                g,
                timed=False,
                modes=extra_modes,
            )
        )
    for m, k, n in shapes:
        torch.manual_seed(m + k + n)
        x, g = data(m, k, n, k + n)
        out.append(
            Case(
                f"linear {m}x{k}x{n}",
                k,
                nn.Linear(k, n, bias=False),
                x,
                g,
                timed=True,
                flops=6.0 * m * k * n,
                modes=extra_modes,
            )
        )
    return out


def _ints(s: str, flag: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        v = [int(t) for t in s.split(",") if t.strip()]
    except ValueError:
        p.error(f"--{flag} must be a comma list of integers, got {s!r}")
    if not v or min(v) < 1:
        p.error(f"--{flag} must be a comma list of integers >= 1, got {s!r}")
    return v


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    quick = "d=64, batch 32, one 32x64x128 shape, 2 repeats"
    p = arg_parser(__doc__, threads=1, repeats=7, modes=True, devices=("cpu", "cuda"),
                   cold_compile=True, quick=quick)  # fmt: skip
    p.add_argument("--dims", default="1024", help="comma list of model widths d (MLP d->4d->d)")
    p.add_argument("--batch", type=int, default=512, help="tokens per step (default 512)")
    p.add_argument(
        "--shapes",
        default=None,
        help="comma list of MxKxN single-Linear shapes (default: none on CPU, "
        + ",".join("x".join(map(str, s)) for s in CUDA_SHAPES)
        + " on CUDA)",
    )
    args = parse_args(p, argv, "float8_{device}")
    args.dims = _ints(args.dims, "dims", p)
    shapes: list[tuple[int, int, int]] = []
    if args.shapes is not None:
        for s in args.shapes.split(","):
            if s.strip():
                dims = _ints(s.strip().replace("x", ","), "shapes", p)
                if len(dims) != 3:
                    p.error(f"--shapes: {s!r} is not MxKxN")
                shapes.append((dims[0], dims[1], dims[2]))
    elif args.device == "cuda":
        shapes = list(CUDA_SHAPES)
    args.shapes = shapes
    if args.quick:
        args.dims, args.batch, args.repeats = QUICK["dims"], QUICK["batch"], QUICK["repeats"]
        args.shapes = QUICK["shapes"]
    if args.batch < 1:
        p.error("--batch must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    global TORCHAO
    args = _parse_args(argv)
    setup_torch(args.threads, args.cold_compile)
    # Sequential.forward is one code object, compiled once per variant (module, dtype).
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    device = torch.device(args.device)
    TORCHAO = _torchao()
    notes: list[str] = []
    if isinstance(TORCHAO, str):
        notes.append(f"torchao not importable, its rows are skipped ({TORCHAO})")
        print(f"note: {notes[-1]}", file=sys.stderr)
    specs = variant_specs(device, not isinstance(TORCHAO, str))
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    extra_modes = ["eager"] if args.quick else None  # compiling them all takes minutes
    for case in cases(args.dims, args.batch, args.shapes, device, extra_modes):
        print(f"{case.name}:", file=sys.stderr)
        rows += run_case(
            case, specs, args.modes, args.repeats, device, QUICK_COMPILED if args.quick else None
        )
    total_s = time.perf_counter() - t_start

    summary = _summary(rows)
    record = run_record(
        "float8",
        device,
        dims=args.dims,
        batch=args.batch,
        shapes=args.shapes,
        stack_depth=STACK_DEPTH,
        modes=args.modes,
        repeats=args.repeats,
        threads=torch.get_num_threads(),
        cold_compile=args.cold_compile,
        variants=[s.name for s in specs],
        torchao=package_version("torchao"),
        step="zero_grad; y = model(x); (y * g).sum().backward()",
        notes=notes,
        total_s=total_s,
        summary=summary,
        rows=rows,
    )
    path = write_json(record, args.out)
    _print(record, rows, path)
    for d in summary:
        if d["same_recipe"]:
            deltas = ", ".join(
                f"{k.removeprefix('sqnr_').removesuffix('_db_minus_torchao')} {v:+.3f}"
                for k, v in d.items()
                if k.endswith("_minus_torchao")
            )
            print(
                f"{d['case']}, {d['mode']}: {d['lowprec']} / torchao time "
                f"{d['time_x_torchao']:.3f}; SQNR minus torchao's (dB): {deltas}"
            )
    failed = [f"{r['case']} {r['variant']} {r['mode']}" for r in rows if "error" in r]
    silent = [f"{r['case']} {r['variant']}" for r in rows if r.get("ran_compiled") is False]
    if failed or silent:
        print(f"FAILED: {failed}; not compiled: {silent}", file=sys.stderr)
        return 1
    return 0


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per timed case and mode: each lowprec variant against torchao (time, SQNR deltas).

    ``same_recipe``: the lowprec variant is tensorwise like the torchao row (the others
    differ in recipe, so their SQNR deltas are recipe differences). ``at_least_as_accurate``:
    no SQNR more than 0.05 dB below torchao's."""
    out = []
    by = {(r["case"], r["variant"], r["mode"]): r for r in rows}
    for r in rows:
        if not r["variant"].startswith("lowprec") or "median_ms" not in r:
            continue
        ao = next(
            (
                o
                for (c, v, m), o in by.items()
                if c == r["case"]
                and m == r["mode"]
                and v.startswith("torchao")
                and "median_ms" in o
            ),
            None,
        )
        if ao is None:
            continue
        d: dict[str, Any] = {
            "case": r["case"],
            "mode": r["mode"],
            "lowprec": r["variant"],
            "same_recipe": r["variant"].startswith("lowprec tensorwise"),
            "time_x_torchao": r["median_ms"] / ao["median_ms"],
            "faster": r["median_ms"] < ao["median_ms"],
        }
        for k in ("sqnr_y_db", "sqnr_dx_db", "sqnr_dw1_db"):
            if r.get(k) is not None and ao.get(k) is not None:
                d[f"{k}_minus_torchao"] = r[k] - ao[k]
        d["at_least_as_accurate"] = all(
            d.get(f"{k}_minus_torchao", 0) >= -0.05
            for k in ("sqnr_y_db", "sqnr_dx_db", "sqnr_dw1_db")
        )
        out.append(d)
    return out


def _print(record: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    cuda = record["device"].startswith("cuda")
    git = record["git"]
    head = (
        f"{record['device']}, {record['threads']} thread(s), torch {record['torch']}, "
        f"torchao {record['torchao']}, git {git['commit']}"
        f"{' (dirty)' if git['dirty'] else ''}; {record['total_s']:.0f} s in all."
    )
    for case in dict.fromkeys(r["case"] for r in rows):
        cr = [r for r in rows if r["case"] == case]
        err = [f"{r['variant']} {r['mode']}: {r['error'][:300]}" for r in cr if "error" in r]
        if any("median_ms" in r for r in cr):
            cols = [
                "variant",
                "mode",
                "ms",
                "x fp32",
                "x torchao",
                "compile s",
                "graphs/breaks",
                "SQNR y",
                "SQNR dx",
                "SQNR dW1",
            ]
            if cuda:
                cols += ["TFLOP/s", "peak MiB"]
            table = []
            for r in cr:
                line = [
                    r["variant"],
                    r["mode"],
                    r.get("median_ms"),
                    r.get("x_fp32"),
                    r.get("x_torchao"),
                    r.get("compile_s"),
                    f"{r['graphs']}/{r['graph_breaks']}" if r.get("graphs") is not None else "-",
                    r.get("sqnr_y_db"),
                    r.get("sqnr_dx_db"),
                    r.get("sqnr_dw1_db"),
                ]
                if cuda:
                    line += [r.get("tflops"), r.get("peak_mib")]
                table.append(line)
            caption = "\n".join(
                [
                    head + f" Batch {record['batch']}; median of {record['repeats']} repeats, "
                    "variants interleaved.",
                    "ms: one fwd+bwd step (zero_grad, forward, (y*g).sum(), backward). x fp32 / "
                    "x torchao: time over the fp32 / torchao row of the same mode. compile s: "
                    "first step of the compiled variant (inductor caches "
                    + ("off). " if record["cold_compile"] else "on: may be warm). ")
                    + "SQNR (dB) vs fp64 of the same model and "
                    "data: output y, input grad dx, first layer weight grad dW1.",
                    *err,
                    f"JSON: {path}",
                ]
            )
            print_table(f"float8 fwd+bwd: {case}", cols, table, caption=caption)
        # memory: one line per variant, eager and compiled side by side
        mem = []
        for v in dict.fromkeys(r["variant"] for r in cr):
            mline: list[object] = [v]
            for mode in record["modes"]:
                r = next((r for r in cr if r["variant"] == v and r["mode"] == mode), {})
                b = r.get("saved_bytes")
                mline += [None if b is None else b / MIB, r.get("saved_x_bf16")]
            mem.append(mline)
        cols = ["variant"]
        for mode in record["modes"]:
            cols += [f"saved MiB {mode}", f"x bf16 {mode}"]
        print_table(
            f"Activation memory saved for backward: {case}",
            cols,
            mem,
            caption=(
                "Bytes of non-parameter storages saved by one forward (saved_tensors_hooks, "
                "de-duplicated); x bf16: over the bf16 model of the same mode. Goal: float8 "
                "with FP8-saved activations <= 0.6x bf16."
                + ("\n" + "\n".join(err) if err and not any("median_ms" in r for r in cr) else "")
            ),
        )


if __name__ == "__main__":
    raise SystemExit(main())
