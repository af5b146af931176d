"""Shared helpers for the benchmarks in this folder.

Every benchmark prints a table and writes one JSON record to ``benchmarks/results/`` with
the machine, the torch version and the git revision (see ``run_record``), so results from
different machines and commits can be compared later.

Timing (``time_many``, ``time_fn``): warm-up calls first (the first call of a
``torch.compile``d function compiles, and its time is returned separately), then
``repeats`` timed repeats of ``number`` back-to-back calls each, the functions interleaved
round by round; the median per-call time is the result. On CUDA the device is synchronised
around each repeat. Shared, noisy machines: compare rows of one run (ratios), not absolute
times across runs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
REPO_ROOT = BENCH_DIR.parent

__all__ = [
    "RESULTS_DIR",
    "StepProfile",
    "Timing",
    "env",
    "git_revision",
    "machine_info",
    "print_profiles",
    "print_table",
    "profile_many",
    "ran_compiled",
    "run_record",
    "sqnr_db",
    "synchronize",
    "time_fn",
    "time_many",
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


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """Platform, CPU model, core count, torch threads and (on CUDA) the GPU name."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
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


# ---- timing -------------------------------------------------------------------------------


def default_out(stem: str, quick: bool) -> str:
    """Where a benchmark writes its JSON: ``results/<stem>.json``, or a temp-dir file for
    ``--quick`` smoke runs (so they never overwrite the real results)."""
    import tempfile

    if quick:
        return str(Path(tempfile.gettempdir()) / "lowprec_bench" / f"{stem}_quick.json")
    return str(RESULTS_DIR / f"{stem}.json")


def setup_torch(threads: int, cold_compile: bool) -> None:
    """Set the CPU thread count; with ``cold_compile`` disable inductor's caches so compile
    times are cold."""
    torch.set_num_threads(threads)
    if cold_compile:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True


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


CLOCKS = ("wall", "thread")


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
) -> Timing:
    """Time one function (see :func:`time_many`)."""
    return time_many({"fn": fn}, device, repeats, warmup, min_repeat_s)["fn"]


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
    cfg = ModelConfig(width=shape["width"], depth=shape["depth"], heads=shape["heads"],
                      seq_len=shape["seq"])  # fmt: skip
    data = CharData(shape["seq"], shape["batch"])
    return shape, cfg, [data.batch("train", i) for i in range(4)]
