"""Worker for the float8 distributed tests: ``torchrun --nproc-per-node 2 <this> CASE OUT``.

Every rank runs the case; rank 0 writes the JSON result to ``OUT``. Each case also runs
its one-process reference (on every rank, the same), so the tests compare numbers.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lowprec.core.tensor import ScaledTensor
from lowprec.distributed import shutdown
from lowprec.float8 import Float8Linear, calibrate, convert_to_float8
from lowprec.float8.quant import quantize_parts
from tests.distributed._gather import CountingAllGather

STEPS = 3


def mlp(recipe: str, bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Linear(64, 128, bias=bias),
        nn.ReLU(),
        nn.Linear(128, 64, bias=bias),
        nn.ReLU(),
        nn.Linear(64, 16, bias=bias),
    )
    return convert_to_float8(m, recipe)


def batches(n: int = STEPS) -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 64, generator=g) * (1 + i) for i in range(n)]


def buffers(m: nn.Module) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in m.named_buffers() if "amax" in k}


def all_ranks(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- FSDP2 ---------------------------------------------------------------------------------


def reference(recipe: str) -> dict[str, Any]:
    """One process. Dynamic scaling: the global batch as the ranks' two halves (gradient
    accumulation), so that each half's activations get the scale they get on its rank.
    Delayed scaling: the whole batch in one forward, so that the history records one
    ``amax`` per step, of the whole batch, as the reduced histories of the ranks do."""
    m = mlp(recipe)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    losses = []
    w0 = quantize_parts(m[0].weight.detach().t(), m[0].recipe.weight, 0)[0].t()
    parts = 1 if recipe == "delayed" else 2
    for x in batches():
        tot = 0.0
        for half in x.chunk(parts):
            loss = m(half).square().mean()
            (loss / parts).backward()
            tot += loss.item() / parts
        opt.step()
        opt.zero_grad()
        losses.append(tot)
    return {"losses": losses, "w0": w0.float(), "buffers": buffers(m)}


def fsdp_run(recipe: str, fp8: bool, param_dtype: torch.dtype | None = None) -> dict[str, Any]:
    from lowprec.distributed import attach_scaling_sync, enable_fp8_all_gather
    from lowprec.distributed.float8_fsdp import fp8_all_gather_reductions

    rank = dist.get_rank()
    m = mlp(recipe)
    if fp8:
        enable_fp8_all_gather(m)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for i in (0, 2, 4):
        fully_shard(m[i], mp_policy=mp)
    fully_shard(m, mp_policy=mp)
    for mod in m.modules():
        if hasattr(mod, "set_custom_all_gather"):
            mod.set_custom_all_gather(CountingAllGather())
    attach_scaling_sync(m)
    seen: dict[str, Any] = {}

    def spy(mod: nn.Module, args: Any) -> None:
        if "w0" not in seen:
            w = mod.weight
            seen["type"] = type(w).__name__
            seen["dtype"] = str(w.qdata.dtype) if isinstance(w, ScaledTensor) else str(w.dtype)
            seen["w0"] = w.qdata.float() if isinstance(w, ScaledTensor) else None

    m[0].register_forward_pre_hook(spy)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    CountingAllGather.bytes = 0
    losses = []
    for x in batches():
        loss = m(x.chunk(2)[rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(lt.item() / 2)
    sd = m.state_dict()  # plain master shards: torch.save and DCP never see the wrapper
    torch.save(sd, io.BytesIO())
    plain = all(type(getattr(v, "_local_tensor", v)) is torch.Tensor for v in sd.values())
    return {
        "losses": losses,
        "plain_state_dict": plain,
        "bytes": CountingAllGather.bytes,
        "reductions": fp8_all_gather_reductions(m) if fp8 else 0,
        "buffers": all_ranks(buffers(m)),
        **seen,
    }


def case_fsdp() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for recipe in ("tensorwise", "delayed"):
        ref = reference(recipe)
        fp32 = fsdp_run(recipe, fp8=False)
        fp8 = fsdp_run(recipe, fp8=True)
        w0 = fp8.pop("w0")
        fp32.pop("w0")
        out[recipe] = {
            "ref": {"losses": ref["losses"], "buffers": ref["buffers"]},
            "fp32": fp32,
            "fp8": fp8,
            "w0_equal": bool(w0 is not None and torch.equal(w0, ref["w0"])),
        }
    # BF16 compute (FSDP2's MixedPrecisionPolicy): the FP8 payload is quantized from the
    # BF16-rounded shard, as the BF16 gather would have delivered it.
    bf16 = {fp8: fsdp_run("tensorwise", fp8, torch.bfloat16) for fp8 in (False, True)}
    out["bf16"] = {"hp": bf16[False]["losses"], "fp8": bf16[True]["losses"]}
    return out


# ---- FSDP2, narrow gather of block layouts ---------------------------------------------------

# (recipe, layer widths): the widths make the 128x128 tiles of "blockwise" line up with the
# shards of the first layer only (256 rows: 128 per rank), and "rowwise-uneven" has a
# 15-row layer, which two ranks cannot split evenly.
BLOCK_CASES: dict[str, tuple[str, tuple[int, ...]]] = {
    "rowwise": ("rowwise", (64, 128, 64, 16)),
    "w1x128": ("w1x128", (128, 256, 128, 16)),
    "mxfp8": ("mxfp8", (64, 128, 64, 16)),
    "mxfp4": ("mxfp4", (64, 128, 64, 16)),
    "blockwise": ("blockwise", (128, 256, 128, 16)),
    "rowwise-uneven": ("rowwise", (64, 15, 64)),
    # in_features not a multiple of the block width (128-wide tiles; MX blocks of 32): the
    # gathered weight is cropped from padded blocks (it was read with the padded stride)
    "blockwise-k64": ("blockwise", (64, 256, 64)),
    "mxfp8-k80": ("mxfp8", (80, 128, 16)),
}
PADDED_K = ("blockwise-k64", "mxfp8-k80")


def block_recipe(name: str) -> Any:
    """A preset, or ``w1x128``: row-wise with the weight in 1x128 blocks (no preset has it)."""
    from lowprec.float8.config import CastConfig, Float8Config

    if name != "w1x128":
        return name
    w = CastConfig("e4m3fn", granularity="block:1x128")
    return Float8Config.from_name("rowwise").replace(weight=w, name="w1x128")


def blocks_run(case: str, blocks: bool) -> dict[str, Any]:
    from lowprec.distributed import enable_fp8_all_gather

    recipe, dims = BLOCK_CASES[case]
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [nn.Linear(a, b, bias=False), nn.ReLU()]
    m = convert_to_float8(nn.Sequential(*layers[:-1]), block_recipe(recipe))
    enable_fp8_all_gather(m, blocks=blocks)
    for i in range(0, len(m), 2):
        fully_shard(m[i])
    fully_shard(m)
    for mod in m.modules():
        if hasattr(mod, "set_custom_all_gather"):
            mod.set_custom_all_gather(CountingAllGather())
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    CountingAllGather.bytes = 0
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(STEPS):
        x = torch.randn(16, dims[0], generator=g) * (1 + i)
        loss = m(x.chunk(2)[rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        losses.append(lt.item() / 2)
    shards = [p.to_local().detach().clone() for p in m.parameters()]  # type: ignore[attr-defined]
    return {
        "losses": losses,
        "bytes": CountingAllGather.bytes,
        "_shards": shards,
    }


def case_blocks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in BLOCK_CASES:
        hp, narrow = blocks_run(case, False), blocks_run(case, True)
        # how far the narrow run's master shards moved from the high-precision run's
        diff = max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(narrow.pop("_shards"), hp.pop("_shards"), strict=True)
        )
        out[case] = {"hp": hp, "narrow": narrow, "shard_rel_diff": max(all_ranks(diff))}
    return out


# ---- tensor parallel -------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d: int = 32, h: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block; heads are read off the local width (tensor parallel)."""

    def __init__(self, d: int = 32, head_dim: int = 8) -> None:
        super().__init__()
        self.hd = head_dim
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.mlp = MLP(d, 4 * d)

    def forward(self, x: Tensor) -> Tensor:
        h = self.n1(x)
        q, k, v = (
            f(h).unflatten(-1, (-1, self.hd)).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).flatten(2))
        return x + self.mlp(self.n2(x))


def case_tp() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from lowprec.distributed import Float8ColwiseParallel

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 8, 32, generator=g) * (1 + i) for i in range(STEPS)]
    out: dict[str, Any] = {}
    for recipe in ("tensorwise", "delayed"):
        for kind in ("mlp", "block"):
            torch.manual_seed(0)
            ref = convert_to_float8(MLP() if kind == "mlp" else Block(), recipe)
            tp = copy.deepcopy(ref)
            if kind == "mlp":
                plan: dict[str, Any] = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            else:
                sp = Shard(1)
                plan = {
                    "n1": SequenceParallel(),
                    "n2": SequenceParallel(),
                    **{
                        n: Float8ColwiseParallel(input_layouts=sp)
                        for n in ("q", "k", "v", "mlp.up")
                    },
                    "o": RowwiseParallel(output_layouts=sp),
                    "mlp.down": RowwiseParallel(output_layouts=sp),
                }
            parallelize_module(tp, mesh, plan)
            seen: dict[str, Any] = {}
            if kind == "block":

                def spy(mod: nn.Module, args: Any, seen: dict[str, Any] = seen) -> None:
                    x = args[0]
                    if isinstance(x, ScaledTensor) and "q_in" not in seen:
                        seen["q_in"] = (str(x.qdata.dtype), x.qdata.float(), x.scale)

                tp.q.register_forward_pre_hook(spy)
            o1 = torch.optim.SGD(ref.parameters(), lr=0.1)
            o2 = torch.optim.SGD(tp.parameters(), lr=0.1)
            l_ref, l_tp = [], []
            for i, x in enumerate(xs):
                if kind == "block" and i == 0:
                    h = ref.n1(x).detach().reshape(-1, 32)
                    ref_q = quantize_parts(h, ref.q.recipe.input, 1)
                l1 = ref(x).square().mean()
                l1.backward()
                o1.step()
                o1.zero_grad()
                if kind == "mlp":
                    y = tp(x)
                else:
                    y = DTensor.from_local(
                        tp(x.chunk(2, dim=1)[rank]), mesh, [Shard(1)]
                    ).full_tensor()
                l2 = y.square().mean()
                l2.backward()
                o2.step()
                o2.zero_grad()
                l_ref.append(l1.item())
                l_tp.append(l2.item())
            wdiff = max(
                float(
                    ((p.full_tensor() if isinstance(p, DTensor) else p) - q).abs().max()
                    / q.abs().max()
                )
                for p, q in zip(tp.parameters(), ref.parameters(), strict=True)
            )
            res: dict[str, Any] = {"ref": l_ref, "tp": l_tp, "param_rel_diff": wdiff}
            if "q_in" in seen:
                dt, data, scale = seen["q_in"]
                res["q_in_dtype"] = dt
                res["q_in_equal"] = bool(
                    torch.equal(data.reshape(-1, 32), ref_q[0].float())
                    and torch.equal(scale, ref_q[1])
                )
            out[f"{kind}-{recipe}"] = res
    return out


# ---- scaling state ---------------------------------------------------------------------------


def case_sync() -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from lowprec.distributed import attach_scaling_sync, enable_fp8_all_gather, sync_scaling_state

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(3 + rank)  # different data on every rank
    xs = [torch.randn(8, 64, generator=g) * (1 + 3 * rank) for _ in range(STEPS)]
    last_global_amax = max(all_ranks(float(xs[-1].abs().max())))
    out: dict[str, Any] = {"global_amax_last_input": last_global_amax}
    for mode in ("ddp", "ddp-unsynced", "fsdp"):
        m = mlp("delayed", bias=True)
        if mode == "fsdp":
            enable_fp8_all_gather(m)
            for i in (0, 2, 4):
                fully_shard(m[i])
            fully_shard(m)
            model: nn.Module = m
        else:
            model = DistributedDataParallel(m)
        if mode != "ddp-unsynced":
            attach_scaling_sync(m)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x in xs:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out[mode] = all_ranks(buffers(m))
    # static calibration on different data, then one explicit reduction
    m = mlp("static")
    with calibrate(m):
        m(xs[0]).square().mean().backward()
    before = float(m[0].input_static_amax)
    sync_scaling_state(m)
    sc = m[0].scaler("input")
    assert sc is not None and isinstance(m[0], Float8Linear)
    out["static"] = {
        "before": all_ranks(before),
        "after": all_ranks(float(m[0].input_static_amax)),
        "scale": all_ranks(float(sc.scale)),  # type: ignore[union-attr]
        "expected_scale": float(m[0].recipe.input.scale_for(torch.tensor(max(all_ranks(before))))),
        "global_amax": max(all_ranks(float(xs[0].abs().max()))),
    }
    return out


def case_reducer() -> dict[str, Any]:
    """A core DelayedScaler with ``reducer=MaxReducer()`` on different data per rank, and a
    DynamicScaler given the reduced ``amax=``: every rank's history and scales, and the
    history one process records on the concatenated data."""
    from lowprec.core.scalers import DelayedScaler, DynamicScaler
    from lowprec.distributed import MaxReducer

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(11 + rank)
    xs = [torch.randn(6, 16, generator=g) * (1 + 5 * rank) * (i + 1) for i in range(STEPS)]
    sc = DelayedScaler("e4m3fn", history_len=4, reducer=MaxReducer())
    scales = [float(sc(x)) for x in xs]
    one = DelayedScaler("e4m3fn", history_len=4)
    whole = [torch.cat([torch.tensor(v) for v in all_ranks(x.tolist())]) for x in xs]
    one_scales = [float(one(w)) for w in whole]
    dyn = DynamicScaler("e4m3fn")
    given = float(dyn(amax=MaxReducer()(xs[0].abs().amax())))
    return {
        "history": all_ranks(sc.amax_history.tolist()),  # type: ignore[union-attr]
        "scales": all_ranks(scales),
        "one_history": one.amax_history.tolist(),  # type: ignore[union-attr]
        "one_scales": one_scales,
        "dynamic_given": all_ranks(given),
        "dynamic_whole": float(DynamicScaler("e4m3fn")(whole[0])),
    }


def main() -> None:
    case, path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    try:
        cases = {
            "case_fsdp": case_fsdp,
            "case_blocks": case_blocks,
            "case_tp": case_tp,
            "case_sync": case_sync,
            "case_reducer": case_reducer,
        }
        if case == "all":  # one launch for the three test files: processes start once
            result = {name: fn() for name, fn in cases.items()}
        else:
            result = cases[case]()
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                json.dump(result, f, default=lambda t: t.tolist())
    finally:
        shutdown()


if __name__ == "__main__":
    main()


_RESULTS: dict[str, Any] = {}


def results(case: str, tmp_path_factory: Any) -> dict[str, Any]:
    """``case``'s result from one 2-process launch of every case, shared by the test files
    of a pytest session."""
    if not _RESULTS:
        _RESULTS.update(launch("all", tmp_path_factory.mktemp("float8_dist")))
    out: dict[str, Any] = _RESULTS[case]
    return out


def launch(case: str, out_dir: Any) -> dict[str, Any]:
    """Run ``case`` on 2 processes (gloo) with torch's launcher; rank 0's JSON result."""
    from pathlib import Path

    from tests._helpers import torchrun_json

    result: dict[str, Any] = torchrun_json(Path(__file__), 2, Path(out_dir) / f"{case}.json", case)
    return result
