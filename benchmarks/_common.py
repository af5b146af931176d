"""Shared helpers for the benchmarks in this folder.

Every benchmark prints a table and writes one JSON record to ``benchmarks/results/`` with
the machine, the torch version and the git revision (see ``run_record``), so results from
different machines and commits can be compared later.

Timing: ``time_many`` (and ``time_fn`` for one function) is the one harness every
benchmark times with. Warm-up calls first (the first call of a ``torch.compile``d
function compiles, and its time is returned separately), then ``repeats`` timed repeats
of ``number`` back-to-back calls each, the functions interleaved round by round; the
median per-call time (``statistics.median``: the mean of the two middle values for an
even count) is the result. On CUDA the device is synchronised around each repeat. A
training loop whose steps differ (learning-rate schedule, batches) is timed with
``min_repeat_s=0``: one step per repeat, in order. Shared, noisy machines: compare rows of
one run (ratios), not absolute times across runs.

Command line: ``arg_parser`` adds the options the benchmarks share (``--threads``,
``--repeats``, ``--modes``, ``--device``, ``--clock``, ``--cold-compile``, ``--profile``,
``--out``, ``--quick``) and ``parse_args`` checks them and fills in ``--out``. A benchmark
on several processes restarts itself under torch's launcher with ``torchrun_self``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent

__all__ = [
    "CLOCKS",
    "MODES",
    "RESULTS_DIR",
    "StepProfile",
    "Timing",
    "arg_parser",
    "default_out",
    "dynamo_counts",
    "env",
    "fp64_reference",
    "fwd_bwd_step",
    "git_revision",
    "launched",
    "lm_step_fn",
    "lscpu",
    "machine_info",
    "mlp",
    "optional_import",
    "package_version",
    "parse_args",
    "print_mode_ratio_table",
    "print_profiles",
    "print_table",
    "profile_many",
    "ran_compiled",
    "reference_lm_setup",
    "run_record",
    "setup_torch",
    "sqnr_db",
    "synchronize",
    "time_fn",
    "time_many",
    "torchrun_self",
    "write_json",
]


# ---- environment record -----------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def lscpu() -> dict[str, Any]:
    """``lscpu``'s model name and the CPU flags that decide how BF16/FP16/FP8 arithmetic
    runs (AVX2/FMA/F16C, AVX-512 and its BF16/FP16 extensions, AMX); ``{}`` where ``lscpu``
    cannot run."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma", "f16c"))]
    return {"model": info.get("Model name", "").strip(), "flags": keep}


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """Platform, CPU model, core count, :func:`lscpu` (model and flags), torch's CPU
    capability (the vector ISA its kernels were dispatched to), torch threads, whether the
    CPU has BF16 matrix instructions (lowprec's own test,
    ``lowprec.amp.native_bf16_matmul``: without them the recipes run BF16 products in FP32)
    and (on CUDA) the GPU name."""
    from lowprec.amp import native_bf16_matmul

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "lscpu": lscpu(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16_matmul": native_bf16_matmul(),
        "torch_num_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kb = int(f.readline().split()[1])
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    dev = torch.device(device)
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["cuda"] = torch.version.cuda
    return info


def git_revision() -> dict[str, Any]:
    """``{"commit": short hash, "dirty": bool, "modified": [paths]}`` of the repository:
    ``dirty`` means tracked files differ from the commit, ``modified`` names them
    (``None`` values outside git)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    diff = git("diff", "--name-only", "HEAD")  # staged and unstaged changes to tracked files
    modified = None if diff is None else diff.splitlines()
    return {
        "commit": commit,
        "dirty": None if modified is None else bool(modified),
        "modified": modified,
    }


def run_record(name: str, device: str | torch.device, **params: Any) -> dict[str, Any]:
    """The header of a result record: benchmark name, time, machine, torch, git, params."""
    return {
        "benchmark": name,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "torch": torch.__version__,
        "git": git_revision(),
        "device": str(device),
        **params,
    }


def write_json(record: dict[str, Any], path: str | Path) -> Path:
    """Write ``record`` as indented JSON (creating the folder); return the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return p


# ---- command line -------------------------------------------------------------------------

MODES = ("eager", "compiled")
CLOCKS = ("wall", "thread")


def default_out(stem: str, quick: bool) -> str:
    """Where a benchmark writes its JSON: ``results/<stem>.json``, or a temp-dir file for
    ``--quick`` smoke runs (so they never overwrite the real results)."""
    import tempfile

    if quick:
        return str(Path(tempfile.gettempdir()) / "lowprec_bench" / f"{stem}_quick.json")
    return str(RESULTS_DIR / f"{stem}.json")


def arg_parser(
    doc: str | None,
    *,
    threads: int | None = None,
    repeats: int | None = None,
    modes: bool = False,
    devices: Sequence[str] | None = None,
    clock: bool = False,
    cold_compile: bool = False,
    profile: bool = False,
    quick: str | None = None,
) -> argparse.ArgumentParser:
    """A parser with the options the benchmarks share, each only where asked for:
    ``--threads`` (default ``threads``), ``--repeats`` (default ``repeats``), ``--modes``
    (comma list of eager, compiled), ``--device`` (the first of ``devices``), ``--clock``,
    ``--cold-compile``, ``--profile N``; always ``--out``; ``--quick`` with the help
    ``quick``. The description is the first paragraph of ``doc``. Finish with
    :func:`parse_args`."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    if threads is not None:
        p.add_argument(
            "--threads",
            type=int,
            default=threads,
            help="torch.set_num_threads (default %(default)s; on a shared 2-core "
            "machine two OpenMP threads stall whenever another process holds a "
            "core)",
        )
    if repeats is not None:
        p.add_argument(
            "--repeats",
            type=int,
            default=repeats,
            help="timed repeats per variant (default %(default)s)",
        )
    if modes:
        p.add_argument("--modes", default=",".join(MODES), help="comma list of eager, compiled")
    if devices:
        p.add_argument("--device", default=devices[0], choices=list(devices))
    if clock:
        p.add_argument(
            "--clock",
            default="wall",
            choices=CLOCKS,
            help="wall time, or the (one) compute thread's CPU time: leaves out "
            "the time a shared virtual machine's host takes the core away "
            "(needs --threads 1)",
        )
    if cold_compile:
        p.add_argument(
            "--cold-compile",
            action="store_true",
            help="disable inductor's caches so compile times are cold",
        )
    if profile:
        p.add_argument(
            "--profile",
            type=int,
            default=0,
            metavar="N",
            help="after timing, profile N steps of each variant: where the time "
            "goes (_common.profile_many)",
        )
    p.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/<name>.json; with --quick, a "
        "file in the temp dir, so a smoke run never overwrites the results)",
    )
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    return p


def parse_args(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, stem: str
) -> argparse.Namespace:
    """Parse and check the shared options of :func:`arg_parser`: ``--modes`` becomes a
    list; ``--threads`` and ``--repeats`` must be >= 1; ``--clock thread`` needs
    ``--threads 1``; ``--device cuda`` needs CUDA. ``--out`` defaults to
    ``default_out(stem, quick)``, ``stem`` formatted with the arguments (``"float8_{device}"``)."""
    a = p.parse_args(argv)
    if getattr(a, "modes", None) is not None:
        modes = [m.strip() for m in a.modes.split(",") if m.strip()]
        if not modes or any(m not in MODES for m in modes):
            p.error(f"--modes must be a comma list of {', '.join(MODES)}; got {a.modes!r}")
        a.modes = modes
    for name in ("threads", "repeats"):
        if getattr(a, name, 1) < 1:
            p.error(f"--{name} must be >= 1")
    if getattr(a, "clock", "wall") == "thread" and getattr(a, "threads", None) != 1:
        p.error("--clock thread needs --threads 1")
    if getattr(a, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if getattr(a, "profile", 0) < 0:
        p.error("--profile must be >= 0")
    if a.out is None:
        a.out = default_out(stem.format(**vars(a)), getattr(a, "quick", False))
    return a


def setup_torch(threads: int, cold_compile: bool = False) -> None:
    """Set the CPU thread count; with ``cold_compile`` disable inductor's caches so compile
    times are cold."""
    torch.set_num_threads(threads)
    if cold_compile:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True


def launched() -> bool:
    """Whether this process is a worker of torch's launcher (``lowprec.distributed``'s
    own test)."""
    from lowprec.distributed.env import launched as _launched

    return _launched()


def torchrun_self(script: str | Path, argv: Sequence[str], nproc: int = 2) -> None:
    """Run ``script argv`` again on ``nproc`` processes with torch's launcher
    (``torch.distributed.run --standalone``, one thread each: ``OMP_NUM_THREADS=1``);
    ``SystemExit`` with the launcher's exit code if it fails. The script tells its
    workers apart with :func:`launched`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), str(script), *argv]
    rc = subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if rc != 0:
        raise SystemExit(rc)


# ---- timing -------------------------------------------------------------------------------


def synchronize(device: str | torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass(frozen=True)
class Timing:
    """Per-call times in milliseconds: the median and all repeats."""

    median_ms: float
    min_ms: float
    first_call_ms: float  # first warm-up call (includes compilation if not yet compiled)
    number: int  # calls per timed repeat
    repeats_ms: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["repeats_ms"] = list(self.repeats_ms)
        return d


def _timed(
    fn: Callable[[], object], device: str | torch.device, number: int, clock: str = "wall"
) -> float:
    """Seconds per call of ``number`` back-to-back calls of ``fn``: wall time, or with
    ``clock="thread"`` the calling thread's CPU time (``time.thread_time``)."""
    now = time.thread_time if clock == "thread" else time.perf_counter
    synchronize(device)
    t0 = now()
    for _ in range(number):
        fn()
    synchronize(device)
    return (now() - t0) / number


def time_many(
    calls: Mapping[str, Callable[[], object]],
    device: str | torch.device = "cpu",
    repeats: int = 7,
    warmup: int = 2,
    min_repeat_s: float = 0.1,
    clock: str = "wall",
) -> dict[str, Timing]:
    """Time several no-argument functions side by side; return per-call times in ms.

    ``clock``: ``"wall"`` (``time.perf_counter``) or ``"thread"``: the calling thread's CPU
    time, for CPU runs with one intra-op thread (``torch.set_num_threads(1)``: every kernel,
    compiled ones included, then runs on the calling thread). On a shared virtual machine
    the wall clock also counts the time the host takes the core away (steal), which moves
    a 0.4 s step by ±10 % between repeats; the thread's CPU time leaves that out.

    Each function gets ``warmup`` untimed calls (the first is reported as
    ``first_call_ms``: for a fresh ``torch.compile``d function it includes compilation).
    Then ``repeats`` rounds run every function once per round, *interleaved*, so that load
    from other processes on a shared machine hits all of them alike. A repeat is ``number``
    back-to-back calls, ``number`` chosen from the last warm-up call so that a repeat lasts
    about ``min_repeat_s`` (short calls are otherwise dominated by timer and scheduling
    jitter). The result is the median over repeats.
    """
    if repeats < 1 or warmup < 1:
        raise ValueError(f"repeats and warmup must be >= 1, got {repeats} and {warmup}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    if clock == "thread" and (torch.device(device).type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("clock='thread' needs a CPU run with torch.set_num_threads(1)")
    first: dict[str, float] = {}
    number: dict[str, int] = {}
    for name, fn in calls.items():
        warm = [_timed(fn, device, 1, clock) for _ in range(warmup)]
        first[name] = warm[0]
        number[name] = max(1, round(min_repeat_s / max(min(warm[1:] or warm), 1e-9)))
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            per_call[name].append(_timed(fn, device, number[name], clock) * 1e3)
    return {
        name: Timing(
            median_ms=statistics.median(ts),
            min_ms=min(ts),
            first_call_ms=first[name] * 1e3,
            number=number[name],
            repeats_ms=tuple(ts),
        )
        for name, ts in per_call.items()
    }


def time_fn(
    fn: Callable[[], object],
    device: str | torch.device = "cpu",
    repeats: int = 7,
    warmup: int = 2,
    min_repeat_s: float = 0.1,
    clock: str = "wall",
) -> Timing:
    """Time one function (see :func:`time_many`). With ``min_repeat_s=0`` it is called
    exactly ``warmup + repeats`` times, in order: the steps of a training loop."""
    return time_many({"fn": fn}, device, repeats, warmup, min_repeat_s, clock)["fn"]


# ---- where the time goes ------------------------------------------------------------------

GEMM_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::_int_mm"}
)


@dataclass(frozen=True)
class StepProfile:
    """Where one call's time goes, per call, in ms, from ``torch.profiler`` (self CPU time).

    ``gemm_ms``: the matrix products (:data:`GEMM_OPS`; inductor calls them as aten ops).
    ``kernels_ms``: inductor's generated C++ kernels (``cpp_fused_*``, named in the profile
    because they are compiled with ``cpp.enable_kernel_profile``), those of a
    ``torch.compile``d model and lowprec's own eager kernels alike. ``ops_ms``: every other
    recorded op and wrapper (aten ops, autograd nodes, compiled-graph wrappers; a custom
    ``autograd.Function``'s own Python counts under its node). ``python_ms``: the rest of the
    call's wall time, outside any recorded op (Python, dispatch; the profiler's own cost).
    ``top``: the largest entries, ``(name, calls per call, ms per call)``."""

    step_ms: float
    gemm_ms: float
    kernels_ms: float
    ops_ms: float
    python_ms: float
    top: tuple[tuple[str, float, float], ...]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["top"] = [list(t) for t in self.top]
        return d


def profile_many(
    calls: Mapping[str, Callable[[], object]], steps: int = 3, top: int = 8
) -> dict[str, StepProfile]:
    """Profile each function for ``steps`` calls (after two warm-up calls) on the CPU.

    Dynamo's caches are reset first and every call runs with inductor's kernel profiling
    on, so compiled functions (and lowprec's kernels) are recompiled here with their kernels
    named in the profile: run this after the timing, never around it (the profiler and the
    recompilation change what is timed)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    out: dict[str, StepProfile] = {}
    torch._dynamo.reset()
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        for name, fn in calls.items():
            fn()
            fn()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    fn()
                wall = (time.perf_counter() - t0) * 1e3 / steps
            events = [(e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps)
                      for e in prof.key_averages()]  # fmt: skip
            gemm = sum(ms for k, _, ms in events if k in GEMM_OPS)
            kern = sum(ms for k, _, ms in events if "cpp_fused" in k)
            recorded = sum(ms for _, _, ms in events)
            out[name] = StepProfile(
                step_ms=wall,
                gemm_ms=gemm,
                kernels_ms=kern,
                ops_ms=recorded - gemm - kern,
                python_ms=max(0.0, wall - recorded),
                top=tuple(sorted(events, key=lambda e: -e[2])[:top]),
            )
    torch._dynamo.reset()
    return out


def print_profiles(title: str, profiles: Mapping[str, StepProfile]) -> None:
    """Print :func:`profile_many`'s results, one row per function, and each one's top entries."""
    rows = [
        [k, p.step_ms, p.gemm_ms, p.kernels_ms, p.ops_ms, p.python_ms,
         "; ".join(f"{n[:48]} {ms:.2f}" for n, _, ms in p.top[:4])]
        for k, p in profiles.items()
    ]  # fmt: skip
    print_table(
        title,
        ["variant", "ms/step", "GEMM", "kernels", "other ops", "python", "largest self CPU (ms)"],
        rows,
    )


@contextlib.contextmanager
def env(var: str, value: str) -> Iterator[None]:
    """The environment variable ``var`` set to ``value`` inside (restored, or removed, on
    exit): lowprec reads its switches at each call, so a variant's steps can run with one
    switched, side by side with the others in one process."""
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old


# ---- accuracy -----------------------------------------------------------------------------


def fp64_reference(model: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, dx, dW)`` of an FP64 copy of ``model`` (on ``x``'s device) on ``x`` with the
    output gradient ``g`` (the loss ``(y * g).sum()``): the output, the input gradient and
    the first weight's gradient, what :func:`fwd_bwd_step`'s results are measured against."""
    ref = copy.deepcopy(model).to(device=x.device, dtype=torch.float64)
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    y = ref(x64)
    (y * g.to(torch.float64)).sum().backward()
    w = next(p for n, p in ref.named_parameters() if n.endswith("weight"))
    assert x64.grad is not None and w.grad is not None
    return y.detach(), x64.grad, w.grad


def sqnr_db(v: torch.Tensor, ref: torch.Tensor) -> float | None:
    """``10 log10(Σ ref² / Σ (v − ref)²)`` in float64 (``None`` when ``v == ref`` exactly)."""
    r = ref.detach().double()
    err = float(((v.detach().double() - r) ** 2).sum())
    return 10 * math.log10(float((r**2).sum()) / err) if err > 0 else None


# ---- output -------------------------------------------------------------------------------


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    caption: str | None = None,
) -> None:
    """Print ``rows`` under ``columns`` as a rich table (numbers right-aligned)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption=caption, caption_justify="left")
    for i, col in enumerate(columns):
        numeric = bool(rows) and isinstance(rows[0][i], (int, float))
        table.add_column(col, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*(_fmt_cell(v) for v in row))
    Console(width=max(140, len(title))).print(table)


def print_mode_ratio_table(
    title: str, timings: Mapping[str, Timing], baseline: str, ratio_header: str
) -> None:
    """Print step times keyed ``"<variant>/<mode>"`` with each one's ratio to
    ``"<baseline>/<mode>"`` (the same mode: eager against eager, compiled against compiled)."""
    rows = []
    for k, v in timings.items():
        base_ms = timings[f"{baseline}/{k.split('/')[1]}"].median_ms
        rows.append([k, v.median_ms, v.median_ms / base_ms, v.first_call_ms / 1e3])
    print_table(title, ["variant", "ms/step", ratio_header, "first call s"], rows)


def _fmt_cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-4 or abs(v) >= 1e6):
            return f"{v:.3e}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def ran_compiled(out: torch.Tensor | None) -> bool:
    """Whether ``out``'s autograd graph holds an AOTAutograd ``CompiledFunction`` node, i.e.
    it came out of a compiled graph (a silent eager fall-back would not)."""
    todo, seen = [out.grad_fn if out is not None else None], set()
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            if "CompiledFunction" in type(fn).__name__:
                return True
            seen.add(fn)
            todo.extend(nxt for nxt, _ in fn.next_functions)
    return False


def dynamo_counts() -> dict[str, int]:
    """Dynamo's running counts: graphs compiled, graph breaks, inductor FX-graph cache hits
    and misses (differences around a call show what it compiled)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": counters["graph_break"].total(),
        "fx_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
    }


def optional_import(name: str) -> ModuleType | str:
    """The module ``name`` (a peer package such as ``torchao.float8``), or why it does not
    import (``"<error type>: <message>"``; any exception, a broken install included), so
    that its rows are skipped with the reason."""
    try:
        return importlib.import_module(name)
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def package_version(pkg: str) -> str | None:
    """The installed version of the distribution ``pkg``, or ``None``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


# ---- models and steps ---------------------------------------------------------------------


def mlp(d: int) -> nn.Sequential:
    """``Linear(d, 4d) -> GELU -> Linear(4d, d)``, the float8 benchmarks' model."""
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


def fwd_bwd_step(
    fn: Callable[[Tensor], Tensor],
    model: nn.Module,
    x: Tensor,
    g: Tensor,
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Callable[[], Tensor]:
    """One forward and backward per call: ``zero_grad``; ``y = fn(x)``;
    ``(y * g).sum().backward()`` inside ``context()``; returns ``y`` (``x`` must require
    gradients; ``fn`` is ``model`` or its compiled form)."""

    def step() -> Tensor:
        model.zero_grad(set_to_none=True)
        x.grad = None
        with context():
            y = fn(x)
            (y * g).sum().backward()
        return y

    return step


def lm_step_fn(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[Any]
) -> Callable[[], None]:
    """One training step of a ``model(x, y) -> (logits, loss)`` language model per call,
    cycling through ``batches``: ``lowprec.recipes.step.train_step`` of ``Plain(model, opt)``
    (forward, backward, optimizer step, zero_grad; no loss scaling, lr left as set)."""
    from lowprec.recipes.step import Plain, train_step

    run, i = Plain(model, opt), [0]

    def step() -> None:
        x, y = batches[i[0] % len(batches)]
        i[0] += 1
        train_step(run, x, y)

    return step


def reference_lm_setup(quick: bool) -> tuple[dict[str, int], Any, list[Any]]:
    """The reference CharGPT at the demo's training shape (batch 32 x 128, width 64, depth 2,
    4 heads; ``quick``: a tiny one): ``(shape, ModelConfig, four training batches)``."""
    from lowprec.jobs.data import CharData
    from lowprec.jobs.model import ModelConfig

    shape = dict(batch=32, seq=128, width=64, depth=2, heads=4)
    if quick:
        shape = dict(batch=4, seq=16, width=32, depth=1, heads=2)
    cfg = ModelConfig(
        width=shape["width"], depth=shape["depth"], heads=shape["heads"], seq_len=shape["seq"]
    )
    data = CharData(shape["seq"], shape["batch"])
    return shape, cfg, [data.batch("train", i) for i in range(4)]
