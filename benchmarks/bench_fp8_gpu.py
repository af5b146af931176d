"""The hardware FP8 path on a GPU: ``torch._scaled_mm`` against BF16, lowprec against torchao.

Written for a lent CUDA machine (Hopper: H100/H200); ``--device cpu`` with a small
``--shape`` is a dry run of the same code (no GPU timings mean anything there). Sections, in
order, each written to the JSON as it finishes (a later failure keeps the earlier ones):

1. **ceilings**: a device-to-device copy of ``--copy-mib`` MiB (bandwidth counts bytes read
   plus bytes written) and an ``--mm-size``³ (8192³) bf16 ``mm`` on random data (TFLOP/s),
   the two rates the GEMM times below are read against.
2. **gemm** at ``--shape M×K×N`` (default 4096×8192×16384, 2MKN flops): ``A (M×K)``
   row-major and ``B (K×N)`` column-major (a linear layer's ``x · Wᵀ``), both N(0, 1) bf16,
   out bf16. Rows: ``bf16 mm``; raw ``torch._scaled_mm`` on operands quantized beforehand
   (E4M3 tensor-wise, also with ``use_fast_accum``; E4M3 row-wise scales);
   ``lowprec scaled_mm`` on lowprec operands quantized beforehand (its dispatch over the raw
   kernel); and dynamic quantization of both bf16 operands plus the GEMM, lowprec
   (``quantize_operand`` + ``scaled_mm``) against torchao (``hp_tensor_to_float8_dynamic`` +
   ``torch.mm`` of the two ``Float8TrainingTensor``\\ s). Accuracy: ``rel err`` is
   ``‖C − C_ref‖ / ‖C_ref‖`` against the float64 product of the *dequantized* operands (the
   GEMM's own error: float32 accumulation and the bf16 output), ``SQNR`` is against the
   float64 product of the bf16 inputs (quantization error included);
   ``lowprec scaled_mm`` must equal the raw kernel's bits on the same operands.
3. **linear**: forward + backward of ``Linear(K, N, bias=False)`` on ``M`` tokens (6MKN
   flops), bf16 parameters and input, eager and ``torch.compile``: ``bf16``,
   ``lowprec tensorwise`` / ``rowwise`` (``convert_to_float8``, hardware GEMMs; eager also
   ``kernels-off``: ``LOWPREC_EAGER_KERNELS=0`` during its steps, lowprec's eager ops
   instead of its compiled quantize kernels), ``torchao tensorwise`` / ``rowwise``
   (``convert_to_float8_training``). SQNR of ``y``, ``dx`` and ``dW`` against float64;
   ``hw/emu``: lowprec's hardware result against its own emulation (``emulate=True``) on
   the same GPU and inputs, the largest difference in bf16 ulps of the emulated value and
   the share of elements that differ, worst of the three outputs (the two multiply the
   same FP8 values; they differ in the accumulation); peak memory of a step above what was
   allocated before it.
4. **bits**: lowprec's quantize (``quantize_parts``) of bf16 and float32 matrices holding
   Inf, NaN, large and tiny values and zero rows, on the GPU with its kernels and with
   them off, against the same call on the CPU, for tensor/axis E4M3 and E5M2, block:128x128
   and mx:32 E4M3, nv:16 E2M1, both layouts, and a given scale that overflows: ``bits``
   equal, and ``values`` equal (a NaN's sign aside); plus torch's own casts of overflowing
   values to E4M3/E5M2 on both devices.

Timing: ``_common.time_many``, the harness of every benchmark: untimed warm-up calls, then
``--repeats`` rounds with every row once per round (interleaved), a round being as many
back-to-back calls as fill ``MIN_REPEAT_S`` with the device synchronised around them; the
median per call. Inputs are fresh random
normals, never zeros. ``--budget-s`` stops before a section or compiled variant would
start past that many seconds (the lease is short); skipped rows are listed.

Usage::

    python benchmarks/bench_fp8_gpu.py [--shape 4096x8192x16384] [--repeats 30]
        [--modes eager,compiled] [--budget-s 330] [--out benchmarks/results/fp8_gpu.json]
    python benchmarks/bench_fp8_gpu.py --device cpu --quick  # dry run
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import (
    arg_parser,
    env,
    optional_import,
    parse_args,
    print_table,
    run_record,
    sqnr_db,
    synchronize,
    time_many,
    write_json,
)
from torch import Tensor, nn

from lowprec.core import kernels
from lowprec.core.rounding import _cast_saturates
from lowprec.float8 import Float8Config, convert_to_float8
from lowprec.float8.config import CastConfig
from lowprec.float8.mm import scaled_mm
from lowprec.float8.quant import Parts, quantize_operand, quantize_parts

E4M3 = torch.float8_e4m3fn
T0 = time.monotonic()
QUICK_HELP = "dry run of every section: shape 64x128x256, 2 repeats, 4 MiB copy, 256³ mm"
MIN_REPEAT_S = 0.05  # per timed repeat of a row (the lease is short)


def elapsed() -> float:
    return time.monotonic() - T0


def time_calls(
    calls: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int
) -> dict[str, dict[str, Any]]:
    """``_common.time_many`` (interleaved rounds, the device synchronised around each
    repeat, median), each row as a dict."""
    return {
        name: t.as_dict()
        for name, t in time_many(calls, device, repeats, warmup, MIN_REPEAT_S).items()
    }


def rel_err(v: Tensor, ref: Tensor) -> float:
    """``‖v − ref‖ / ‖ref‖`` in float64."""
    r = ref.double()
    return float(torch.linalg.vector_norm(v.double() - r) / torch.linalg.vector_norm(r))


def finite(t: Tensor, what: str) -> Tensor:
    if not bool(torch.isfinite(t).all()):
        raise RuntimeError(f"{what}: non-finite values in the result")
    return t


def kernels_off() -> contextlib.AbstractContextManager[None]:
    """``LOWPREC_EAGER_KERNELS=0`` inside: lowprec's eager ops instead of its compiled kernels."""
    return env("LOWPREC_EAGER_KERNELS", "0")


def max_ulps(v: Tensor, ref: Tensor) -> float:
    """The largest ``|v − ref|`` in units of bf16's last place at ``ref`` (where ``ref`` ≠ 0;
    a nonzero ``v`` against a zero ``ref`` counts as infinitely far)."""
    a, b = v.float(), ref.float()
    d = (a - b).abs()
    ulp = torch.ldexp(torch.ones_like(b), torch.frexp(b).exponent - 8)
    ratio = torch.where(b != 0, d / ulp, torch.where(d == 0, 0.0, math.inf))
    return float(ratio.max())


SPECIALS = (math.inf, -math.inf, math.nan, 3e4, -5e-6, 0.0)
BIT_CASTS = {  # (cast, dtype of the input)
    "tensor e4m3fn": CastConfig("e4m3fn"),
    "tensor e5m2": CastConfig("e5m2"),
    "axis e4m3fn": CastConfig("e4m3fn", granularity="axis"),
    "axis e5m2": CastConfig("e5m2", granularity="axis"),
    "block:128x128 e4m3fn": CastConfig("e4m3fn", granularity="block:128x128"),
    "mx:32 e4m3fn": CastConfig("e4m3fn", granularity="mx:32"),
    "nv:16 e2m1": CastConfig("e2m1", granularity="nv:16"),
}


def _same(a: Tensor, b: Tensor, nan_sign: bool = True) -> bool:
    """Equal bits; ``nan_sign=False``: a NaN's sign and payload are not compared (the NaN
    that ``inf / inf`` makes is negative on x86 CPUs and positive on CUDA)."""
    if a.dtype.itemsize == 1:
        eq = a.view(torch.uint8) == b.view(torch.uint8)
    else:
        w = {2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
        eq = a.contiguous().view(w) == b.contiguous().view(w)
    if not nan_sign:
        eq |= a.float().isnan() & b.float().isnan()
    return bool(eq.all())


def _compare(got: Parts, ref: Parts) -> dict[str, bool]:
    pairs = [(got[0].cpu(), ref[0]), (got[1].cpu(), ref[1])]
    return {
        "bits": all(_same(a, b) for a, b in pairs),
        "values": all(_same(a, b, nan_sign=False) for a, b in pairs),
    }


def bits_section(device: torch.device) -> dict[str, Any]:
    """lowprec's float8 quantize on the GPU (its compiled kernels, then its eager ops)
    against the same call on the CPU, bit for bit, on inputs with Inf, NaN, large and tiny
    values; plus torch's own casts of overflowing values on both devices."""
    casts: dict[str, Any] = {}
    for dt in (E4M3, torch.float8_e5m2):
        v = torch.tensor([1e30, 464.0, 465.0, 6e4, 7e4, math.inf, -math.inf, math.nan])
        casts[str(dt)] = {
            "input": v.tolist(),
            "cpu": v.to(dt).view(torch.uint8).tolist(),
            device.type: v.to(device).to(dt).view(torch.uint8).cpu().tolist(),
        }
    out: dict[str, Any] = {"casts": casts, "e4m3fn_cast_saturates": _cast_saturates(device)}
    rows: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2048, 1024, generator=gen).to(dtype)  # 2^21: the kernels' size
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (len(SPECIALS) * 4,), generator=gen)] = torch.tensor(
            SPECIALS * 4, dtype=dtype
        )
        x[5:9] = 0.0  # whole zero rows (axis scales of zero groups)
        xt = x.t()  # a transposed (column-major) operand too
        for name, cast in BIT_CASTS.items():
            for cd, t in ((1, x), (0, xt)):
                key = f"{name} {str(dtype)[6:]} cd={cd}"
                ref = quantize_parts(t, cast, cd)
                got = quantize_parts(t.to(device), cast, cd)
                with kernels_off():
                    eager = quantize_parts(t.to(device), cast, cd)
                rows[key] = {"kernels": _compare(got, ref), "eager": _compare(eager, ref)}
        s = torch.tensor(1e-3)  # a given (delayed/static) scale: most values overflow
        for name in ("tensor e4m3fn", "tensor e5m2"):
            cast = BIT_CASTS[name]
            key = f"{name} {str(dtype)[6:]} given scale"
            ref = quantize_parts(x, cast, 1, s)
            got = quantize_parts(x.to(device), cast, 1, s.to(device))
            with kernels_off():
                eager = quantize_parts(x.to(device), cast, 1, s.to(device))
            rows[key] = {"kernels": _compare(got, ref), "eager": _compare(eager, ref)}
    out["rows"] = rows
    out["all_equal_values"] = all(
        r["kernels"]["values"] and r["eager"]["values"] for r in rows.values()
    )
    out["all_equal_bits"] = all(r["kernels"]["bits"] and r["eager"]["bits"] for r in rows.values())
    out["kernels_broken"] = list(kernels._BROKEN)
    out["quantize_devices"] = list(kernels.quantize_devices())
    return out


def ceilings(device: torch.device, copy_mib: int, size: int, repeats: int) -> dict[str, Any]:
    n = copy_mib * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    t = time_calls(
        {"copy": lambda: dst.copy_(src), "mm": lambda: torch.mm(a, b)}, device, repeats, 3
    )
    if not torch.equal(dst, src):
        raise RuntimeError("copy: destination differs from source")
    copy_ms, mm_ms = t["copy"]["median_ms"], t["mm"]["median_ms"]
    return {
        "copy_mib": copy_mib,
        "copy_ms": copy_ms,
        "copy_tb_s": 2 * n * 4 / (copy_ms * 1e-3) / 1e12,
        "bf16_mm_size": size,
        f"bf16_mm_{size}_ms": mm_ms,
        f"bf16_mm_{size}_tflops": 2 * size**3 / (mm_ms * 1e-3) / 1e12,
    }


def _torchao() -> Any:
    """torchao's float8 training API, or why it does not import (its rows are skipped)."""
    mods = [optional_import(f"torchao.float8{m}")
            for m in ("", ".float8_scaling_utils", ".float8_training_tensor")]  # fmt: skip
    bad = next((m for m in mods if isinstance(m, str)), None)
    if bad is not None:
        return bad
    ao, scaling, training = mods
    assert not isinstance(ao, str) and not isinstance(scaling, str)
    assert not isinstance(training, str)
    return {
        "version": importlib.import_module("torchao").__version__,
        "config": ao.Float8LinearConfig,
        "convert": ao.convert_to_float8_training,
        "dynamic": scaling.hp_tensor_to_float8_dynamic,
        "role": training.GemmInputRole,
        "mm_config": training.LinearMMConfig,
    }


def gemm_section(
    m: int, k: int, n: int, device: torch.device, repeats: int, ao: Any
) -> dict[str, Any]:
    bf = torch.bfloat16
    a = torch.randn(m, k, device=device, dtype=bf)
    b = torch.randn(n, k, device=device, dtype=bf).t()  # K×N, column-major
    e4 = CastConfig("e4m3fn")
    e4_row = CastConfig("e4m3fn", granularity="axis")
    qa, qb = quantize_operand(a, e4, 1), quantize_operand(b, e4, 0)
    ra, rb = quantize_operand(a, e4_row, 1), quantize_operand(b, e4_row, 0)
    a8, sa = qa.qdata.contiguous(), qa.scale.float().reshape(())
    b8, sb = qb.qdata.t().contiguous().t(), qb.scale.float().reshape(())
    ar8, sar = ra.qdata.contiguous(), ra.scale.float().reshape(m, 1)
    br8, sbr = rb.qdata.t().contiguous().t(), rb.scale.float().reshape(1, n)
    hw = device.type == "cuda"

    def raw(fast: bool = False) -> Tensor:
        return torch._scaled_mm(a8, b8, sa, sb, out_dtype=bf, use_fast_accum=fast)

    calls: dict[str, Callable[[], Tensor]] = {"bf16 mm": lambda: torch.mm(a, b)}
    if hw:
        calls["_scaled_mm tensorwise"] = raw
        calls["_scaled_mm tensorwise fast-accum"] = lambda: raw(True)
        calls["_scaled_mm rowwise"] = lambda: torch._scaled_mm(ar8, br8, sar, sbr, out_dtype=bf)
    calls["lowprec scaled_mm tensorwise"] = lambda: scaled_mm(qa, qb, out_dtype=bf)
    calls["lowprec scaled_mm rowwise"] = lambda: scaled_mm(ra, rb, out_dtype=bf)
    calls["lowprec quantize+mm tensorwise"] = lambda: scaled_mm(
        quantize_operand(a, e4, 1), quantize_operand(b, e4, 0), out_dtype=bf
    )
    if isinstance(ao, dict):
        cfg, role = ao["mm_config"](), ao["role"]

        def ao_mm() -> Tensor:
            fa = ao["dynamic"](a, E4M3, cfg, gemm_input_role=role.INPUT)
            fb = ao["dynamic"](b, E4M3, cfg, gemm_input_role=role.WEIGHT)
            return torch.mm(fa, fb)

        calls["torchao quantize+mm tensorwise"] = ao_mm
    outs = {name: finite(fn(), name) for name, fn in calls.items()}
    if hw and not torch.equal(outs["lowprec scaled_mm tensorwise"], outs["_scaled_mm tensorwise"]):
        raise RuntimeError("lowprec scaled_mm differs from torch._scaled_mm on the same operands")
    ref_in = a.double() @ b.double()
    deq_t = (a8.double() * sa.double()) @ (b8.double() * sb.double())
    deq_r = (ar8.double() * sar.double()) @ (br8.double() * sbr.double())
    acc: dict[str, dict[str, float | None]] = {}
    for name, out in outs.items():
        deq = deq_r if "rowwise" in name else deq_t
        acc[name] = {
            "rel_err_vs_dequantized": None if name == "bf16 mm" else rel_err(out, deq),
            "sqnr_db_vs_bf16_inputs": sqnr_db(out, ref_in),
        }
    del outs, ref_in, deq_t, deq_r
    t = time_calls(calls, device, repeats, 3)
    flops = 2 * m * k * n
    base = t["bf16 mm"]["median_ms"]
    rows = {
        name: {
            **t[name],
            "tflops": flops / (t[name]["median_ms"] * 1e-3) / 1e12,
            "x_bf16": t[name]["median_ms"] / base,
            **acc[name],
        }
        for name in calls
    }
    return {"shape": [m, k, n], "rows": rows}


def _linear_variants(ao: Any) -> dict[str, Callable[[nn.Module], nn.Module]]:
    v: dict[str, Callable[[nn.Module], nn.Module]] = {"bf16": lambda mod: mod}
    for name in ("tensorwise", "rowwise"):
        v[f"lowprec {name}"] = lambda mod, r=name: convert_to_float8(mod, Float8Config.from_name(r))
        v[f"lowprec {name} kernels-off"] = v[f"lowprec {name}"]
    if isinstance(ao, dict):
        v["torchao tensorwise"] = lambda mod: ao["convert"](mod, config=ao["config"]())
        v["torchao rowwise"] = lambda mod: ao["convert"](
            mod, config=ao["config"].from_recipe_name("rowwise")
        )
    return v


def linear_section(
    m: int,
    k: int,
    n: int,
    device: torch.device,
    repeats: int,
    modes: list[str],
    budget_s: float,
    ao: Any,
) -> dict[str, Any]:
    bf = torch.bfloat16
    base = nn.Linear(k, n, bias=False, device=device, dtype=bf)
    x = torch.randn(m, k, device=device, dtype=bf)
    g = torch.randn(m, n, device=device, dtype=bf)
    w64, x64, g64 = base.weight.detach().double(), x.double(), g.double()
    ref = {"y": x64 @ w64.t(), "dx": g64 @ w64, "dW": g64.t() @ x64}
    hw = device.type == "cuda"

    def run(model: nn.Module, off: bool = False) -> dict[str, Tensor]:
        xi = x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        with kernels_off() if off else contextlib.nullcontext():
            y = model(xi)
            y.backward(g)
        w = next(model.parameters())
        assert xi.grad is not None and w.grad is not None
        return {"y": y.detach(), "dx": xi.grad, "dW": w.grad}

    rows: dict[str, Any] = {}
    skipped: list[str] = []
    emu_out: dict[str, dict[str, Tensor]] = {}
    if hw:  # lowprec's own emulation on the GPU: the cross-check of its hardware path
        for r in ("tensorwise", "rowwise"):
            emu = convert_to_float8(copy.deepcopy(base), Float8Config.from_name(r, emulate=True))
            emu_out[f"lowprec {r}"] = run(emu)
        del emu
    for mode in modes:
        steps: dict[str, Callable[[], object]] = {}
        for name, make in _linear_variants(ao).items():
            key = f"{name}/{mode}"
            off = name.endswith("kernels-off")
            if off and mode == "compiled":
                continue  # (the kernels are eager-only)
            if elapsed() > budget_s:
                skipped.append(key)
                continue
            model = make(copy.deepcopy(base))
            if mode == "compiled":
                model = torch.compile(model)
            synchronize(device)
            t = time.perf_counter()
            out = run(model, off)  # the first step (compiles when compiled)
            synchronize(device)
            row: dict[str, Any] = {"first_step_s": time.perf_counter() - t}
            for o, v in out.items():
                row[f"sqnr_{o}_db"] = sqnr_db(finite(v, f"{key} {o}"), ref[o])
            if name in emu_out:
                e = emu_out[name]
                row["hw_vs_emu_max_ulps"] = max(max_ulps(out[o], e[o]) for o in out)
                row["hw_vs_emu_differ"] = max(float((out[o] != e[o]).float().mean()) for o in out)
            if hw:
                synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                mem0 = torch.cuda.memory_allocated(device)
                run(model, off)
                synchronize(device)
                row["peak_mib"] = (torch.cuda.max_memory_allocated(device) - mem0) / 2**20
            rows[key] = row
            steps[key] = lambda mod=model, o=off: run(mod, o)
        if steps:
            for key, tm in time_calls(steps, device, repeats, 2).items():
                rows[key].update(tm)
                rows[key]["tflops"] = 6 * m * k * n / (tm["median_ms"] * 1e-3) / 1e12
    for key, row in rows.items():
        b = rows.get(f"bf16/{key.split('/')[1]}")
        if b is not None and "median_ms" in row and "median_ms" in b:
            row["x_bf16"] = row["median_ms"] / b["median_ms"]
    for key, row in rows.items():
        name, mode = key.split("/")
        peer = rows.get(f"{name.replace('lowprec', 'torchao')}/{mode}")
        if name.startswith("lowprec") and peer is not None and "median_ms" in peer:
            row["x_torchao"] = row["median_ms"] / peer["median_ms"]
    return {"shape": [m, k, n], "rows": rows, "skipped": skipped}


def main() -> None:
    p = arg_parser(__doc__, repeats=30, modes=True, devices=("cuda", "cpu"),
                   quick=QUICK_HELP)  # fmt: skip
    p.add_argument("--shape", default="4096x8192x16384", help="M x K x N")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--mm-size", type=int, default=8192, help="N of the N³ bf16 mm ceiling")
    p.add_argument("--budget-s", type=float, default=330.0)
    p.add_argument("--revision", default=None, help="the git commit, where .git is absent")
    p.add_argument("--sections", default="ceilings,gemm,linear,bits",
                   help="sections to run (a comma list of ceilings,gemm,linear,bits)")  # fmt: skip
    args = parse_args(p, None, "fp8_gpu_{device}")
    if args.quick:
        args.shape, args.repeats, args.copy_mib, args.mm_size = "64x128x256", 2, 4, 256
    try:
        m, k, n = (int(v) for v in args.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape must be MxKxN, got {args.shape!r}")
    modes = args.modes
    device = torch.device(args.device)
    out = Path(args.out)
    torch.manual_seed(0)
    ao = _torchao()
    record = run_record(
        "fp8_gpu",
        device,
        shape=[m, k, n],
        repeats=args.repeats,
        modes=modes,
        torchao=ao["version"] if isinstance(ao, dict) else ao,
        revision=args.revision,
    )
    if device.type == "cuda":
        record["capability"] = list(torch.cuda.get_device_capability(device))
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("ceilings", lambda: ceilings(device, args.copy_mib, args.mm_size, args.repeats)),
        ("gemm", lambda: gemm_section(m, k, n, device, args.repeats, ao)),
        ("linear", lambda: linear_section(m, k, n, device, args.repeats, modes, args.budget_s, ao)),
        ("bits", lambda: bits_section(device)),
    ]
    wanted = [w.strip() for w in args.sections.split(",") if w.strip()]
    unknown = sorted(set(wanted) - {name for name, _ in sections})
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from ceilings,gemm,linear,bits")
    for name, fn in sections:
        if name not in wanted:
            continue
        if elapsed() > args.budget_s:
            record[name] = {"skipped": f"budget: {elapsed():.0f} s > {args.budget_s:.0f} s"}
            continue
        t = time.perf_counter()
        try:
            record[name] = fn()
        except Exception as e:
            record[name] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            traceback.print_exc()
        record[name]["section_s"] = time.perf_counter() - t
        write_json(record, out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report(record)
    print(f"wrote {out} ({elapsed():.0f} s)")


def report(record: dict[str, Any]) -> None:
    b = record.get("bits", {})
    if "rows" in b:
        n = len(b["rows"])
        for what in ("bits", "values"):
            bad = [k for k, r in b["rows"].items() if not (r["kernels"][what] and r["eager"][what])]
            print(
                f"{what}: {n - len(bad)}/{n} quantize cases equal to the CPU's (kernels and eager)"
            )
            for k in bad:
                print(f"  {what} differ: {k}: {b['rows'][k]}")
        print(
            f"e4m3fn cast saturates here: {b['e4m3fn_cast_saturates']}; kernels on "
            f"{b['quantize_devices']}; broken: {b['kernels_broken'] or 'no'}"
        )
        for dt, c in b["casts"].items():
            print(f"  cast {dt}: {c}")
    c = record.get("ceilings", {})
    if "copy_tb_s" in c:
        size = c["bf16_mm_size"]
        print(
            f"ceilings: copy {c['copy_tb_s']:.2f} TB/s (read+write), "
            f"bf16 mm {size}^3 {c[f'bf16_mm_{size}_tflops']:.0f} TFLOP/s"
        )
    g = record.get("gemm", {})
    if "rows" in g:
        print_table(
            f"GEMM {'x'.join(map(str, g['shape']))} ({record['device']})",
            ["row", "ms", "TFLOP/s", "x bf16", "rel err vs deq", "SQNR dB"],
            [
                [
                    n,
                    r["median_ms"],
                    r["tflops"],
                    r["x_bf16"],
                    r["rel_err_vs_dequantized"],
                    r["sqnr_db_vs_bf16_inputs"],
                ]
                for n, r in g["rows"].items()
            ],
        )
    lin = record.get("linear", {})
    if "rows" in lin:
        print_table(
            f"Linear fwd+bwd {'x'.join(map(str, lin['shape']))} ({record['device']})",
            [
                "variant",
                "ms",
                "TFLOP/s",
                "x bf16",
                "x torchao",
                "first s",
                "SQNR y",
                "SQNR dx",
                "SQNR dW",
                "peak MiB",
                "hw/emu ulps",
                "differ",
            ],
            [
                [
                    k,
                    r.get("median_ms"),
                    r.get("tflops"),
                    r.get("x_bf16"),
                    r.get("x_torchao"),
                    r.get("first_step_s"),
                    r.get("sqnr_y_db"),
                    r.get("sqnr_dx_db"),
                    r.get("sqnr_dW_db"),
                    r.get("peak_mib"),
                    r.get("hw_vs_emu_max_ulps"),
                    r.get("hw_vs_emu_differ"),
                ]
                for k, r in lin["rows"].items()
            ],
        )
        if lin.get("skipped"):
            print("skipped (budget):", ", ".join(lin["skipped"]))
    for name in ("ceilings", "bits", "gemm", "linear"):
        if "error" in record.get(name, {}):
            print(f"{name}: {record[name]['error']}")


if __name__ == "__main__":
    main()
