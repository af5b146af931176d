"""Worker of the tensor/sequence-parallel harness: ``torchrun --nproc-per-node N <this> OUT``.

For every layout (a parallel plan over a device mesh) and every float8 preset, a float8
MLP ``Linear(64→256) → GELU → Linear(256→64)`` (with biases; a LayerNorm in front for the
sequence-parallel layouts) runs two forward/backward passes (an SGD step between) on every
rank and, the same, on one process. Rank 0 writes, per ``layout/preset``, the largest
relative difference between the two of:

* the output,
* **the input's gradient** (the input requires grad; its gradient is where a wrongly
  stated placement of a local GEMM's input gradient shows),
* every parameter's gradient,

and the same numbers between the one-process float8 model and the FP32 model (the
preset's own quantization error, which the tests use to bound the cases that round at
other scales). Relative difference: ``max |a - b| / max |b|``.

Layouts, 2 processes (1-D mesh): ``colrow`` (torch's ``ColwiseParallel`` +
``RowwiseParallel``, replicated input), ``colrow-f8`` (lowprec's ``Float8ColwiseParallel``
instead), ``sp`` (``SequenceParallel`` norm, ``ColwiseParallel(input_layouts=Shard(1))``,
``RowwiseParallel(output_layouts=Shard(1))``), ``sp-f8`` (``Float8ColwiseParallel``
instead); ``ddp``, ``fsdp`` and ``fsdp-fp8ag`` (FSDP2 with the FP8 all-gather of the weights),
each rank on a slice of the batch, against one process accumulating the slices' gradients.
4 processes (2-D mesh ``dp × tp``): ``2d``, weights distributed by hand
(``[Replicate, Shard(0)]`` / ``[Replicate, Shard(1)]``) and the input sharded by batch over
``dp``: the weight gradients are partial sums over ``dp``.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lowprec.distributed import shutdown
from lowprec.float8 import convert_to_float8

PRESETS = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4")
LAYOUTS_1D = ("colrow", "colrow-f8", "sp", "sp-f8")
PASSES = 2
# Data parallel: every dynamic preset (a delayed history records one slice per rank, the
# one-process reference one per slice in turn: not the same record) and FP32.
_DYNAMIC = ("fp32", "tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4")
DP_PRESETS = {"ddp": _DYNAMIC, "fsdp": _DYNAMIC, "fsdp-fp8ag": ("tensorwise",)}
LAYOUTS_DP = tuple(DP_PRESETS)
# The other techniques under torch's own tensor-parallel styles.
OTHER_TECHNIQUES = ("unit",)


class MLP(nn.Module):
    def __init__(self, norm: bool, hidden: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64) if norm else nn.Identity()
        self.up = nn.Linear(64, hidden)
        self.down = nn.Linear(hidden, 64)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.down(nn.functional.gelu(self.up(self.norm(x))))
        return y


def technique(preset: str, model: nn.Module, example: Tensor) -> nn.Module:
    """``model`` under ``preset``: a float8 preset, ``"fp32"`` (unchanged), ``"unit"``
    (u-μP unit scaling, re-initialised) or ``"scalify"`` (scaled FP16 arithmetic)."""
    from lowprec import scalify, unit

    if preset == "fp32":
        return model
    if preset == "unit":
        torch.manual_seed(1)
        return unit.apply(model, reinit=True, example_inputs=(example,))
    if preset == "scalify":
        return scalify.apply(model, "fp16")
    return convert_to_float8(model, preset)


def rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def full(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    out: Tensor = t.full_tensor() if isinstance(t, DTensor) else t
    return out


def inputs() -> tuple[list[Tensor], Tensor]:
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 8, 64, generator=g) * (1 + i) for i in range(PASSES)]
    return xs, torch.randn(4, 8, 64, generator=g)


def _record_and_step(
    records: list[dict[str, Tensor]], rec: dict[str, Tensor], model: nn.Module, opt: Any
) -> None:
    """Add every parameter's gradient (whole) to ``rec``, keep it, and take the SGD step."""
    rec.update({f"{k}.grad": full(p.grad).clone() for k, p in model.named_parameters()})  # type: ignore[arg-type]
    records.append(rec)
    opt.step()
    opt.zero_grad()


def one_process(model: nn.Module, xs: list[Tensor], weight: Tensor) -> list[dict[str, Tensor]]:
    """Outputs and gradients of ``PASSES`` passes (SGD steps between) on one process."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: list[dict[str, Tensor]] = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        y = model(x)
        (y * weight).sum().backward()
        assert x.grad is not None
        _record_and_step(out, {"out": y.detach(), "x.grad": x.grad}, model, opt)
    return out


def parallel_1d(
    layout: str, model: nn.Module, xs: list[Tensor], weight: Tensor
) -> list[dict[str, Tensor]]:
    """The same passes with ``model`` parallelized over a 1-D mesh of every rank; outputs
    and gradients gathered to whole tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from lowprec.distributed import Float8ColwiseParallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    col = Float8ColwiseParallel if layout.endswith("-f8") else ColwiseParallel
    sp = layout.startswith("sp")
    if sp:
        plan: dict[str, Any] = {
            "norm": SequenceParallel(),
            "up": col(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        plan = {"up": col(), "down": RowwiseParallel()}
    # A scalified model is a wrapper: the plan's names are those of the wrapped model.
    parallelize_module(getattr(model, "module", model), mesh, plan)
    rank, n = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: list[dict[str, Tensor]] = []
    for x in xs:
        local = (x.chunk(n, dim=1)[rank] if sp else x).clone().requires_grad_(True)
        y = model(local)
        w = weight.chunk(n, dim=1)[rank] if sp else weight
        (y * w).sum().backward()
        assert local.grad is not None
        if sp:
            y_full = DTensor.from_local(y.detach(), mesh, [Shard(1)]).full_tensor()
            g_full = DTensor.from_local(local.grad, mesh, [Shard(1)]).full_tensor()
        else:
            y_full, g_full = y.detach(), local.grad
        _record_and_step(out, {"out": y_full, "x.grad": g_full}, model, opt)
    return out


def parallel_2d(model: nn.Module, xs: list[Tensor], weight: Tensor) -> list[dict[str, Tensor]]:
    """The passes on a ``(2, world/2)`` mesh (dp × tp): weights distributed by hand, the
    input a DTensor sharded by batch over dp and replicated over tp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import Placement

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2))
    rep, col, row = Replicate(), Shard(0), Shard(1)
    layouts: dict[str, list[Placement]] = {
        "up.weight": [rep, col],
        "up.bias": [rep, col],
        "down.weight": [rep, row],
        "down.bias": [rep, rep],
    }
    for name, pl in layouts.items():
        mod_name, attr = name.split(".")
        mod = getattr(model, mod_name)
        p = getattr(mod, attr)
        setattr(mod, attr, nn.Parameter(distribute_tensor(p.detach(), mesh, pl)))
    dp = dist.get_rank() // mesh.shape[1]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: list[dict[str, Tensor]] = []
    for x in xs:
        local = x.chunk(2, dim=0)[dp].clone().requires_grad_(True)
        xd = DTensor.from_local(local, mesh, [Shard(0), rep])
        y = model(xd)
        wd = DTensor.from_local(weight.chunk(2, dim=0)[dp], mesh, [Shard(0), rep])
        (y * wd).sum().backward()
        assert local.grad is not None
        g_full = DTensor.from_local(local.grad, mesh, [Shard(0), rep]).full_tensor()
        _record_and_step(out, {"out": full(y.detach()), "x.grad": g_full}, model, opt)
    return out


def one_process_halves(
    model: nn.Module, xs: list[Tensor], weight: Tensor, n: int
) -> list[dict[str, Tensor]]:
    """The data-parallel reference: each pass accumulates the gradients of the ``n``
    batch slices the ranks get (so each slice's dynamic scales are its own, as on its
    rank); the parameter gradients are averaged over the slices, as DDP and FSDP2 do."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: list[dict[str, Tensor]] = []
    for x, w in zip([x.chunk(n) for x in xs], [weight.chunk(n)] * len(xs), strict=True):
        ys, gs = [], []
        for xi, wi in zip(x, w, strict=True):
            xi = xi.clone().requires_grad_(True)
            y = model(xi)
            (y * wi).sum().backward()
            assert xi.grad is not None
            ys.append(y.detach())
            gs.append(xi.grad)
        for p in model.parameters():
            p.grad.div_(n)  # type: ignore[union-attr]
        _record_and_step(out, {"out": torch.cat(ys), "x.grad": torch.cat(gs)}, model, opt)
    return out


def data_parallel(
    layout: str, model: nn.Module, xs: list[Tensor], weight: Tensor
) -> list[dict[str, Tensor]]:
    """The passes under DDP (``ddp``) or FSDP2 (``fsdp``; ``fsdp-fp8ag``: with the FP8
    all-gather of the weights), each rank on its batch slice; outputs, input gradients
    and (averaged) parameter gradients gathered whole."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from lowprec.distributed import enable_fp8_all_gather

    rank, n = dist.get_rank(), dist.get_world_size()
    if layout == "ddp":
        run: nn.Module = DistributedDataParallel(model)
    else:
        if layout == "fsdp-fp8ag":
            enable_fp8_all_gather(model)
        for sub in (model.get_submodule("up"), model.get_submodule("down")):
            fully_shard(sub)
        fully_shard(model)
        run = model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out: list[dict[str, Tensor]] = []
    for x in xs:
        local = x.chunk(n)[rank].clone().requires_grad_(True)
        y = run(local)
        (y * weight.chunk(n)[rank]).sum().backward()
        assert local.grad is not None
        ys: list[Any] = [None] * n
        gs: list[Any] = [None] * n
        dist.all_gather_object(ys, y.detach())
        dist.all_gather_object(gs, local.grad)
        _record_and_step(out, {"out": torch.cat(ys), "x.grad": torch.cat(gs)}, model, opt)
    return out


def compare(a: list[dict[str, Tensor]], b: list[dict[str, Tensor]]) -> dict[str, float]:
    """Per output/gradient, the largest relative difference over the passes."""
    assert len(a) == len(b)
    keys = sorted(b[0])
    assert sorted(a[0]) == keys, (sorted(a[0]), keys)
    return {k: max(rel(ra[k], rb[k]) for ra, rb in zip(a, b, strict=True)) for k in keys}


class _Warnings(logging.Handler):
    """The WARNING messages of lowprec's tensor-parallel forward."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    path = sys.argv[1]
    dist.init_process_group("gloo")
    warned = _Warnings()
    logging.getLogger("lowprec.distributed.float8_dtensor").addHandler(warned)
    try:
        world = dist.get_world_size()
        layouts = ("2d",) if world == 4 else (*LAYOUTS_1D, *LAYOUTS_DP)
        xs, weight = inputs()
        result: dict[str, Any] = {}
        for layout in layouts:
            norm = layout.startswith("sp")
            torch.manual_seed(0)
            fp32 = MLP(norm)
            dp = layout in LAYOUTS_DP
            presets = DP_PRESETS[layout] if dp else PRESETS
            if layout in ("colrow", "sp"):
                presets = (*presets, *OTHER_TECHNIQUES)
            for preset in presets:
                ref = technique(preset, copy.deepcopy(fp32), xs[0])
                par = copy.deepcopy(ref)
                if dp:
                    want = one_process_halves(ref, xs, weight, world)
                    hp = one_process_halves(copy.deepcopy(fp32), xs, weight, world)
                    got = data_parallel(layout, par, xs, weight)
                elif layout == "2d":
                    want, hp = (
                        one_process(ref, xs, weight),
                        one_process(copy.deepcopy(fp32), xs, weight),
                    )
                    got = parallel_2d(par, xs, weight)
                else:
                    want, hp = (
                        one_process(ref, xs, weight),
                        one_process(copy.deepcopy(fp32), xs, weight),
                    )
                    got = parallel_1d(layout, par, xs, weight)
                result[f"{layout}/{preset}"] = {
                    "parallel": compare(got, want),
                    "quantization": compare(want, hp),
                }
        # Every tensor-parallel case above has whole scaling blocks on every shard.
        result["tile_warnings"] = list(warned.messages)
        if world == 2:  # a hidden width of 384: shards of 192 cut the 128-wide blocks
            warned.messages.clear()
            torch.manual_seed(0)
            fp32 = MLP(False, hidden=384)
            ref = technique("blockwise", copy.deepcopy(fp32), xs[0])
            par = copy.deepcopy(ref)
            want = one_process(ref, xs, weight)
            got = parallel_1d("colrow", par, xs, weight)
            result["cut/blockwise"] = {
                "parallel": compare(got, want),
                "quantization": compare(want, one_process(fp32, xs, weight)),
                "warnings": list(warned.messages),
            }
        if world == 2:  # scalify refuses tensor parallelism with a clear error
            torch.manual_seed(0)
            try:
                parallel_1d("colrow", technique("scalify", MLP(False), xs[0]), xs, weight)
                result["scalify_tp_error"] = None
            except TypeError as e:
                result["scalify_tp_error"] = str(e)
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
