"""Emulation speed: every float8/MX/NVFP4 preset against FP32 and the peers, with SQNR.

On a CPU every narrow format is emulated: values are rounded for real and multiplied in
float32, so the floor is the FP32 model's own step time. This benchmark times one training
step (``zero_grad``, ``y = model(x)``, ``(y * g).sum().backward()``) of
``Linear(d, 4d) -> GELU -> Linear(4d, d)`` on ``--batch`` tokens, eager and
``torch.compile``d, every variant side by side in one run (interleaved repeats, median):

* ``fp32``: the plain model (the floor; ``x fp32`` divides by its row of the same mode);
* ``lowprec <preset>``: ``convert_to_float8(model, Float8Config.from_name(preset,
  emulate=True))`` for each ``--presets`` (``static`` is calibrated on one batch first);
* ``torchao tensorwise`` / ``torchao rowwise``: ``convert_to_float8_training`` with
  ``Float8LinearConfig(emulate=True)`` / ``Float8LinearConfig.from_recipe_name("rowwise")``
  with ``emulate=True`` (skipped with a note when torchao does not import);
* ``unit-scaling simulate_fp8``: graphcore's ``unit_scaling.transforms.simulate_fp8``
  (E4M3 in forward, E5M2 in backward, *no scaling*, stochastic rounding); where its SQNR
  equals FP32's, its Dynamo transform inserted no quantisation in that mode;
* ``unit-scaling FPFormat quantisers``: the same formats' ``FPFormat.quantise`` (the
  function ``simulate_fp8`` inserts) applied around each ``F.linear`` as the transform
  intends: input and weight in forward, the output gradient in backward;
* ``qtorch fp8``: ``qtorch.quant.float_quantize`` (E4M3 on the linear's input and weight,
  E5M2 on its output gradient, no scaling, nearest) around each ``F.linear``.

``--reference`` adds each preset run eagerly inside ``_reference_paths()`` (the general
masked casts, no table upcast, no compiled kernels: the eager speed before issue 18).

``--profile N`` then profiles N steps of each timed variant (``_common.profile_many``:
``torch.profiler`` self CPU time split into GEMMs, inductor's kernels, other ops and
Python, recompiled with inductor's kernel profiling) and adds a ``profile`` to each row.

``first s``: the first step of each variant and mode (eager: one-time set-up; compiled:
tracing and inductor). SQNR (dB) of the output ``y``, the input gradient ``dx`` and the first
layer's weight gradient ``dW1`` against an FP64 copy of the same model and data.

Usage::

    python benchmarks/bench_emulation.py [--dim 1024] [--batch 512] [--repeats 10]
        [--modes eager,compiled] [--threads 1] [--presets tensorwise,rowwise,...]
        [--no-peers] [--reference] [--compiled-variants fp32,lowprec tensorwise,...]
        [--clock wall|thread] [--profile N]
        [--out benchmarks/results/emulation_cpu.json] [--quick]
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from _common import (
    arg_parser,
    fp64_reference,
    fwd_bwd_step,
    mlp,
    parse_args,
    print_profiles,
    print_table,
    profile_many,
    run_record,
    setup_torch,
    sqnr_db,
    time_many,
    write_json,
)
from torch import Tensor, nn
from torch.nn import functional as F

from lowprec.core.layout import reference_paths as _reference_paths
from lowprec.float8 import Float8Config, calibrate, convert_to_float8

PRESETS = ("tensorwise", "delayed", "static", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4")


# ---- peers ----------------------------------------------------------------------------------


class _GradQuant(torch.autograd.Function):
    """Identity forward; rounds the incoming gradient with ``q`` in backward."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, q: Callable[[Tensor], Tensor]) -> Tensor:  # type: ignore[override]
        ctx.q = q
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return ctx.q(g), None


class _STE(torch.autograd.Function):
    """``q(x)`` forward, straight-through backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, q: Callable[[Tensor], Tensor]) -> Tensor:  # type: ignore[override]
        return q(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return g, None


class QLinear(nn.Module):
    """A linear layer rounding its input and weight with ``fwd`` and its output gradient
    with ``bwd`` (the structure of unit-scaling's ``simulate_format``)."""

    def __init__(
        self, lin: nn.Linear, fwd: Callable[[Tensor], Tensor], bwd: Callable[[Tensor], Tensor]
    ):
        super().__init__()
        self.lin, self.fwd, self.bwd = lin, fwd, bwd

    def forward(self, x: Tensor) -> Tensor:
        xq, wq = _STE.apply(x, self.fwd), _STE.apply(self.lin.weight, self.fwd)
        y = F.linear(xq, wq, self.lin.bias)
        return _GradQuant.apply(y, self.bwd)  # type: ignore[no-any-return]


def _qtorch_model(m: nn.Sequential) -> nn.Module:
    from qtorch.quant import float_quantize  # type: ignore[import-untyped]

    def e4(t: Tensor) -> Tensor:
        return float_quantize(t.contiguous(), exp=4, man=3, rounding="nearest")

    def e5(t: Tensor) -> Tensor:
        return float_quantize(t.contiguous(), exp=5, man=2, rounding="nearest")

    return nn.Sequential(*(QLinear(c, e4, e5) if isinstance(c, nn.Linear) else c for c in m))


def peer_builders() -> tuple[dict[str, Callable[[nn.Sequential], nn.Module]], list[str]]:
    """``{name: build(fp32 model) -> model}`` for the importable peers, and notes."""
    builders: dict[str, Callable[[nn.Sequential], nn.Module]] = {}
    notes: list[str] = []
    try:
        import torchao  # type: ignore[import-untyped]
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def tw(m: nn.Sequential) -> nn.Module:
            return convert_to_float8_training(m, config=Float8LinearConfig(emulate=True))  # type: ignore[no-any-return]

        def rw(m: nn.Sequential) -> nn.Module:
            cfg = Float8LinearConfig.from_recipe_name("rowwise")
            cfg = Float8LinearConfig(**{**cfg.__dict__, "emulate": True})
            return convert_to_float8_training(m, config=cfg)  # type: ignore[no-any-return]

        builders["torchao tensorwise"], builders["torchao rowwise"] = tw, rw
        notes.append(f"torchao {torchao.__version__}")
    except Exception as e:
        notes.append(f"torchao skipped: {type(e).__name__}: {e}")
    try:
        import unit_scaling  # type: ignore[import-untyped]
        from unit_scaling.formats import FPFormat  # type: ignore[import-untyped]
        from unit_scaling.transforms import simulate_fp8  # type: ignore[import-untyped]

        def us(m: nn.Sequential) -> nn.Module:
            e4, e5 = FPFormat(4, 3), FPFormat(5, 2)  # simulate_fp8's formats (stochastic)
            return nn.Sequential(
                *(
                    QLinear(c, e4.quantise, e5.quantise) if isinstance(c, nn.Linear) else c
                    for c in m
                )
            )

        builders["unit-scaling simulate_fp8"] = simulate_fp8
        builders["unit-scaling FPFormat quantisers"] = us
        notes.append(f"unit-scaling {getattr(unit_scaling, '__version__', '?')}")
    except Exception as e:
        notes.append(f"unit-scaling skipped: {type(e).__name__}: {e}")
    try:
        import qtorch.quant  # type: ignore[import-untyped]  # noqa: F401

        builders["qtorch fp8"] = _qtorch_model
        notes.append("qtorch (float_quantize) importable")
    except Exception as e:
        notes.append(f"qtorch skipped: {type(e).__name__}: {e}")
    return builders, notes


# ---- driver ---------------------------------------------------------------------------------


def build_lowprec(preset: str, m: nn.Sequential, x: Tensor, g: Tensor) -> nn.Module:
    model = convert_to_float8(m, Float8Config.from_name(preset, emulate=True))
    if preset == "static":  # calibrate the activation and gradient scales on one batch
        with calibrate(model):
            (model(x) * g).sum().backward()
        model.zero_grad(set_to_none=True)
    return model


def main(argv: list[str] | None = None) -> int:
    p = arg_parser(__doc__, threads=1, repeats=10, modes=True, clock=True, profile=True,
                   quick="d=64, batch 32, 2 repeats, eager")  # fmt: skip
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--no-peers", action="store_true")
    p.add_argument(
        "--reference",
        action="store_true",
        help="also time each lowprec preset eagerly with the fast paths off "
        "(lowprec.core.rounding._reference_paths: the general masked casts, no table "
        "upcast, no compiled kernels): the speed before issue 18, in the same run",
    )
    p.add_argument(
        "--compiled-variants",
        default=None,
        help="comma list of variants to run compiled (default: all)",
    )
    args = parse_args(p, argv, "emulation_cpu")
    if args.quick:
        args.dim, args.batch, args.repeats, args.modes = 64, 32, 2, ["eager"]
    modes = args.modes
    presets = [s for s in args.presets.split(",") if s]
    setup_torch(args.threads)
    out = args.out
    t_start = time.perf_counter()

    torch.manual_seed(0)
    d = args.dim
    base = mlp(d)
    x0 = torch.randn(args.batch, d)
    g0 = torch.randn(args.batch, d)
    y_ref, dx_ref, dw_ref = fp64_reference(base, x0, g0)

    builders: dict[str, Callable[[nn.Sequential], nn.Module]] = {"fp32": lambda m: m}
    for pr in presets:
        builders[f"lowprec {pr}"] = lambda m, pr=pr: build_lowprec(pr, m, x0, g0)
    notes: list[str] = []
    if not args.no_peers:
        peers, notes = peer_builders()
        builders.update(peers)
    if args.reference:
        for pr in presets:
            builders[f"lowprec {pr} (reference paths)"] = builders[f"lowprec {pr}"]
    compiled_only = None if args.compiled_variants is None else args.compiled_variants.split(",")

    rows: list[dict[str, Any]] = []
    calls: dict[str, Callable[[], Any]] = {}
    for name, build in builders.items():
        for mode in modes:
            reference = name.endswith("(reference paths)")
            if mode == "compiled" and (
                reference or (compiled_only is not None and name not in compiled_only)
            ):
                continue
            row: dict[str, Any] = {"variant": name, "mode": mode}
            rows.append(row)
            try:
                model = build(copy.deepcopy(base))
                fn = torch.compile(model) if mode == "compiled" else model
                x = x0.clone().requires_grad_(True)
                w1 = next(p for n, p in model.named_parameters() if n.endswith("weight"))
                context = _reference_paths if reference else contextlib.nullcontext
                step = fwd_bwd_step(fn, model, x, g0, context)

                t0 = time.perf_counter()
                y = step()
                row["first_s"] = time.perf_counter() - t0
                assert x.grad is not None and w1.grad is not None
                row["sqnr_y_db"] = sqnr_db(y.detach(), y_ref)
                row["sqnr_dx_db"] = sqnr_db(x.grad, dx_ref)
                row["sqnr_dw1_db"] = sqnr_db(w1.grad, dw_ref)
                calls[f"{name}/{mode}"] = step
            except Exception as e:
                print(f"{name} {mode}: FAILED\n{traceback.format_exc(limit=-3)}", file=sys.stderr)
                row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    timings = time_many(calls, repeats=args.repeats, clock=args.clock)
    for row in rows:
        t = timings.get(f"{row['variant']}/{row['mode']}")
        if t is None:
            continue
        row.update(t.as_dict())
        base_t = timings.get(f"fp32/{row['mode']}")
        row["x_fp32"] = t.median_ms / base_t.median_ms if base_t else None
    profiles = profile_many(calls, args.profile) if args.profile else {}
    for row in rows:
        prof = profiles.get(f"{row['variant']}/{row['mode']}")
        if prof is not None:
            row["profile"] = prof.as_dict()
    record = run_record(
        "emulation",
        "cpu",
        command="python benchmarks/bench_emulation.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        dim=d,
        batch=args.batch,
        repeats=args.repeats,
        threads=args.threads,
        clock=args.clock,
        profile_steps=args.profile,
        modes=modes,
        presets=presets,
        step="zero_grad; y = model(x); (y * g).sum().backward()",
        notes=notes,
        rows=rows,
        total_s=time.perf_counter() - t_start,
    )
    path = write_json(record, out)
    table = [
        [r["variant"], r["mode"], r.get("median_ms"), r.get("x_fp32"), r.get("first_s"),
         r.get("sqnr_y_db"), r.get("sqnr_dx_db"), r.get("sqnr_dw1_db"), r.get("error", "")[:40]]
        for r in rows
    ]  # fmt: skip
    print_table(
        f"fwd+bwd of Linear({d},{4 * d})-GELU-Linear({4 * d},{d}), batch {args.batch}, "
        f"{args.threads} thread(s), median of {args.repeats}, {args.clock} clock",
        ["variant", "mode", "ms", "x fp32", "first s", "SQNR y", "SQNR dx", "SQNR dW1", "error"],
        table,
        caption="\n".join([*notes, f"JSON: {path}"]),
    )
    if profiles:
        print_profiles(f"self CPU ms per step, {args.profile} profiled steps", profiles)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
