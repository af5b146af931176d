"""Why a CPU runs lowprec's emulation slower than another: the facts of one host, one run.

Issue 37: on an Intel Xeon (AVX512-FP16, AMX) the float8 emulation step cost 1.4-1.7x FP32
where an AMD EPYC measured 1.1x, and one compiled quantize graph took 12.5 ms a call. This
probe records what differs between hosts and times the suspects side by side:

- the host: ``lscpu -e`` (which logical CPUs share a core), the C++ compiler inductor
  builds with and the vector ISA it picked, torch's build configuration;
- 16.8M float32 elements, at 1 and 2 threads, with float32 subnormals kept and flushed
  (``torch.set_flush_denormal``): ``copy_``, eager ``aminmax``, eager and compiled
  ``quantize_scaled`` (e4m3, per-tensor scale), compiled ``abs().amax()``;
- inductor's generated C++ of those graphs and their built kernels (``--code-dir``), to
  read and disassemble offline;
- repeatability (issue 39: a resumed fp16 run once differed by 1 ulp at step 2 on that
  Xeon): the matrix products of issue 39's model shapes in float32, float16 and bfloat16,
  at 1 and 2 threads, computed again from copies of the operands at other memory
  alignments (storage offsets 1-31 elements); any bit that moves is counted. A library
  whose kernels depend on the operands' alignment gives a process that allocates
  differently (a resumed one) other bits.

Usage: ``python benchmarks/host_probe.py --out probe.json --code-dir /tmp/probe_code``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import print_table, run_record, time_many, write_json

from lowprec.core.tensor import quantize_scaled


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {e}"


def host_facts() -> dict[str, Any]:
    """What differs between hosts beyond the CPU model (lscpu is in run_record)."""
    facts: dict[str, Any] = {
        "lscpu_e": _sh(["lscpu", "-e"]),
        "affinity": sorted(os.sched_getaffinity(0)),
        "cxx": _sh([os.environ.get("CXX", "g++"), "--version"]).splitlines()[:1],
        "torch_config": torch.__config__.show(),
        "torch_parallel": torch.__config__.parallel_info(),
    }
    try:
        from torch._inductor import cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()
        facts["inductor_vec_isa"] = str(isa)
        facts["inductor_isa_flags"] = getattr(isa, "build_arch_flags", lambda: "?")()
    except Exception as e:  # a torch without that module: record why
        facts["inductor_vec_isa"] = f"unavailable: {e}"
    return facts


def _at_offset(t: torch.Tensor, off: int) -> torch.Tensor:
    """A copy of ``t`` whose storage starts ``off`` elements into a fresh buffer."""
    buf = torch.empty(t.numel() + 64, dtype=t.dtype)
    v = buf[off : off + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def repeatability(threads: list[int], offsets: int = 32) -> list[dict[str, Any]]:
    """For each dtype, thread count and product shape: how many of ``offsets`` re-runs
    from re-aligned operand copies differ in any bit from the first, and by how much."""
    g = torch.Generator().manual_seed(1)
    shapes = [(1024, 96, 384), (1024, 384, 96), (96, 1024, 384), (1024, 96, 96), (384, 1024, 96)]
    rows: list[dict[str, Any]] = []
    for nt in threads:
        torch.set_num_threads(nt)
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for m, k, n in shapes:
                a = torch.randn(m, k, generator=g).to(dt)
                b = torch.randn(k, n, generator=g).to(dt)
                for name, f in (("mm", lambda x, y: x @ y), ("mm(a, b.T.T)", None)):
                    if f is None:  # the transposed layout a linear's weight has
                        bt = b.t().contiguous()
                        ref = a @ bt.t()
                        outs = [_at_offset(a, o) @ _at_offset(bt, o).t() for o in range(offsets)]
                    else:
                        ref = f(a, b)
                        outs = [f(_at_offset(a, o), _at_offset(b, o)) for o in range(offsets)]
                    diff = [o for o in outs if not torch.equal(o.view(-1).view(torch.int16 if
                            dt != torch.float32 else torch.int32), ref.view(-1).view(
                            torch.int16 if dt != torch.float32 else torch.int32))]  # fmt: skip
                    worst = max((float((o.float() - ref.float()).abs().max()) for o in diff),
                                default=0.0)  # fmt: skip
                    rows.append({"threads": nt, "dtype": str(dt).split(".")[-1],
                                 "shape": f"{m}x{k}x{n}", "op": name, "runs": offsets,
                                 "differ": len(diff), "max_abs_diff": worst})  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 24)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    p.add_argument("--out", required=True)
    p.add_argument("--code-dir", default=None, help="copy inductor's generated C++ here")
    p.add_argument(
        "--repeat-only",
        action="store_true",
        help="only the repeatability part (e.g. again under MKL_CBWR=AUTO: oneMKL's "
        "conditional numerical reproducibility, which promises bitwise-equal GEMMs "
        "whatever the operands' alignment)",
    )
    a = p.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    if a.repeat_only:
        rep = repeatability(threads)
        env = {k: os.environ.get(k, "") for k in ("MKL_CBWR", "OMP_NUM_THREADS")}
        write_json(run_record("host_probe_repeat", "cpu", env=env, repeatability=rep), a.out)
        bad = [r for r in rep if r["differ"]]
        print(f"repeatability ({env}): {len(bad)} of {len(rep)} cases moved a bit")
        return 0
    t_start = time.time()
    torch.manual_seed(0)
    x = torch.randn(a.numel)
    y = torch.empty_like(x)
    cq = torch.compile(lambda t: quantize_scaled(t, "e4m3fn"))
    camax = torch.compile(lambda t: t.abs().amax())
    ccopy = torch.compile(lambda t, u: u.copy_(t))
    calls = {
        "eager copy_": lambda: y.copy_(x),
        "eager aminmax": lambda: torch.aminmax(x),
        "eager quantize_scaled": lambda: quantize_scaled(x, "e4m3fn"),
        "compiled copy_": lambda: ccopy(x, y),
        "compiled abs().amax()": lambda: camax(x),
        "compiled quantize_scaled": lambda: cq(x),
    }
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        for flush in (False, True):
            torch.set_flush_denormal(flush)
            t = time_many(calls, repeats=a.repeats)
            for name, tm in t.items():
                ns = tm.median_ms * 1e6 / a.numel
                rows.append({"threads": nt, "flush_denormal": flush, "variant": name,
                             "median_ms": tm.median_ms, "ns_per_element": ns})  # fmt: skip
    torch.set_flush_denormal(False)
    rep = repeatability(threads)
    record = run_record("host_probe", "cpu", numel=a.numel, repeats=a.repeats,
                        host=host_facts(), rows=rows, repeatability=rep)  # fmt: skip
    write_json(record, a.out)
    if a.code_dir:
        from torch._inductor.codecache import cache_dir

        dst = Path(a.code_dir)
        dst.mkdir(parents=True, exist_ok=True)
        n = 0
        # the C++ and the built kernels (to disassemble: are the bit casts folded?)
        built = [*Path(cache_dir()).rglob("*.cpp"), *Path(cache_dir()).rglob("*.so")]
        for f in built:
            if f.stat().st_mtime >= t_start:
                (dst / f"{f.parent.name}_{f.name}").write_bytes(f.read_bytes())
                n += 1
        print(f"copied {n} generated C++ files and kernels to {dst}")
    print_table(
        f"host probe: {a.numel} float32 elements, median of {a.repeats}",
        ["threads", "flush", "variant", "ms", "ns/elem"],
        [[r["threads"], r["flush_denormal"], r["variant"], r["median_ms"], r["ns_per_element"]]
         for r in rows],
    )  # fmt: skip
    bad = [r for r in rep if r["differ"]]
    print_table(
        f"repeatability: products from re-aligned operand copies ({len(rep)} cases)",
        ["threads", "dtype", "shape", "op", "differ", "max |diff|"],
        [[r["threads"], r["dtype"], r["shape"], r["op"], f"{r['differ']}/{r['runs']}",
          r["max_abs_diff"]] for r in (bad or rep[:3])],
    )  # fmt: skip
    print(f"repeatability: {len(bad)} of {len(rep)} cases moved a bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
