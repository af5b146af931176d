"""Worker of ``test_grad_comm.py``: run under ``torch.distributed.run --nproc-per-node 2``.

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed/_grad_comm_worker.py
OUT.json``: one launch for every check (a process start costs seconds); rank 0 writes
the results.

* ``hook``: :func:`fp8_allreduce_hook` called on a bucket of random gradients with a wide
  dynamic range (odd size: padded), per format, divisor and bucket dtype: the largest
  error over the bound of the module docstring, the scales of every rank, the results of
  every rank, and the bytes handed to the collectives (counted by wrapping them).
* ``nonfinite``: an Inf on rank 1 and a NaN on rank 0 in one bucket.
* ``ddp``: the tiny reference model, 6 AdamW steps under DDP (``fp32``), plain and with
  the FP8 hook; ``overflow``: ``fp16-dynamic-ls`` with the hook and an Inf injected in
  rank 1's gradient at one step.
* ``fsdp``: FSDP2 with the default reduce-scatter, the FP8 one, and a BF16 one
  (:func:`fsdp_reduce_policy`), with the reduce-scatter bytes.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lowprec.distributed.parallel as parallel
from lowprec.core.formats import get_format
from lowprec.distributed import shutdown
from lowprec.distributed.grad_comm import (
    FP8CommState,
    enable_fp8_reduce_scatter,
    fp8_allreduce_hook,
    fsdp_reduce_policy,
    register_fp8_allreduce,
)
from lowprec.jobs.data import CharData
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.recipes.step import train_step

STEPS = 6
N_ELEM = 1001  # odd: the hook pads to a multiple of the world size
_DATA = CharData(32, 8, seed=0)
_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_single", "reduce_scatter_single")


class _Bucket:
    """What the hook reads of a ``GradBucket``."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def buffer(self) -> torch.Tensor:
        return self.t


@contextmanager
def _counting() -> Iterator[dict[str, list[int]]]:
    """Wrap torch.distributed's collectives: the bytes of every input tensor, by name."""
    seen: dict[str, list[int]] = {k: [] for k in _COLLECTIVES}
    orig = {k: getattr(dist, k) for k in _COLLECTIVES}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[0] if name == "all_reduce" else args[1] if len(args) > 1 else None
            if t is None:
                t = kwargs.get("input", kwargs.get("input_tensor"))
            seen[name].append(int(t.nbytes))
            return fn(*args, **kwargs)

        return counted

    for k in _COLLECTIVES:
        setattr(dist, k, wrap(k, orig[k]))
    import lowprec.distributed.grad_comm as gc

    gather = gc._all_gather
    gc._all_gather = dist.all_gather_single
    try:
        yield seen
    finally:
        for k in _COLLECTIVES:
            setattr(dist, k, orig[k])
        gc._all_gather = gather


def _grads(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Gradients over ~10 binades, as in a bucket of many tensors, different per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    mag = torch.exp2(torch.empty(N_ELEM).uniform_(-14, -4, generator=g))
    return (torch.randn(N_ELEM, generator=g) * mag).to(dtype)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _bound(g: list[torch.Tensor], out: torch.Tensor, st: FP8CommState, d: float) -> torch.Tensor:
    """The per-element error bound of the module docstring, plus the bucket dtype's own
    rounding of the result and float32 sums (1e-6 relative)."""
    f = get_format(st.fmt)
    u, delta = 2.0 ** -(f.mantissa_bits + 1), f.min_subnormal
    s1, s2 = (float(s) for s in st.last_scales)
    e1 = sum(torch.maximum(u * gi.float().abs(), torch.tensor(s1 * delta / 2)) for gi in g) / d
    big = out.float().abs() + e1
    e2 = torch.maximum(u * big, torch.tensor(s2 * delta / 2))
    ub = 2.0 ** -(get_format(out.dtype).mantissa_bits + 1) if out.dtype != torch.float32 else 0
    return (e1 + e2) * (1 + ub) + ub * big + 1e-6 * big


def _hook_checks(rank: int, world: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for fmt in ("e4m3fn", "e5m2"):
        for div in (None, math.sqrt(world)):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                g = _grads(rank, dtype)
                d = float(world) if div is None else div
                st = FP8CommState(fmt, div)
                buf = g.clone()
                with _counting() as seen:
                    out = fp8_allreduce_hook(st, _Bucket(buf)).wait()  # type: ignore[arg-type]
                all_g = _gather(g)
                ref = sum(x.float() for x in all_g) / d
                err = (out.float() - ref).abs()
                bound = _bound(all_g, out, st, d)
                outs = _gather(out.float())
                scales = _gather(st.last_scales)
                res[f"{fmt}/{div}/{dtype}"] = {
                    "worst": float((err / bound).max()),
                    "rel_err": float(err.norm() / ref.norm()),
                    "same_result": all(torch.equal(outs[0], o) for o in outs),
                    "scales": [s.tolist() for s in scales],
                    "dtype": str(out.dtype),
                    "in_place": out.data_ptr() == buf.data_ptr(),
                    "seen": seen,
                    "bytes_sent": st.bytes_sent,
                }
    return res


def _nonfinite(rank: int) -> dict[str, Any]:
    res = {}
    for fmt in ("e4m3fn", "e5m2"):
        g = _grads(rank, torch.float32)
        if rank == 1:
            g[3] = math.inf
        else:
            g[5] = math.nan
        out = fp8_allreduce_hook(FP8CommState(fmt), _Bucket(g.clone())).wait()  # type: ignore[arg-type]
        fin = torch.isfinite(out)
        clean = [_grads(r, torch.float32) for r in range(2)]
        ref = sum(clean) / 2
        mask = torch.ones_like(fin)
        mask[3] = mask[5] = False
        res[fmt] = {
            "value_3": float(out[3]),
            "value_5": float(out[5]),
            "finite_elsewhere": bool(fin[mask].all()),
            "rel_err_elsewhere": float((out - ref)[mask].norm() / ref[mask].norm()),
        }
    return res


def _model() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(ModelConfig(65, 32, 2, 2, 32))


def _factory(ps: list[Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=3e-3)


def _train(p: Any) -> list[float]:
    r, w = dist.get_rank(), dist.get_world_size()
    out = []
    for s in range(STEPS):
        x, y = _DATA.batch("train", s)
        n = x.shape[0] // w
        res = train_step(p, x[r * n : (r + 1) * n], y[r * n : (r + 1) * n], 3e-3)
        loss = res.loss.detach().float().clone()
        dist.all_reduce(loss)
        out.append(float(loss) / w)
    return out


def _ddp() -> dict[str, Any]:
    res: dict[str, Any] = {"plain": _train(parallel.prepare(_model(), "fp32", "ddp", _factory))}
    for fmt in ("e4m3fn", "e5m2"):
        p = parallel.prepare(_model(), "fp32", "ddp", _factory)
        st = register_fp8_allreduce(p.model, fmt)  # type: ignore[arg-type]
        res[fmt] = _train(p)
        res[fmt + "/bytes_per_step"] = st.bytes_sent / STEPS
    res["numel"] = sum(q.numel() for q in _model().parameters())
    return res


def _overflow(rank: int) -> dict[str, Any]:
    """fp16-dynamic-ls under DDP with the FP8 hook; an Inf in rank 1's gradient at step 1:
    rank 0's own gradient, after the hook, must be non-finite, and every rank skips."""
    p = parallel.prepare(_model(), "fp16-dynamic-ls", "ddp", _factory)
    register_fp8_allreduce(p.model, "e4m3fn")  # E4M3FN: the Inf arrives as NaN
    w = p.model.module.head.weight
    inject = [False]
    if rank == 1:
        w.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), math.inf) if inject[0] else g)
    out: dict[str, Any] = {"scales": [], "skipped": [], "grad_finite": [], "moved": []}
    for s in range(3):
        inject[0] = s == 1
        x, y = _DATA.batch("train", s)
        x, y = x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
        before = w.detach().clone()
        out["scales"].append(p.scaler.get_scale())
        with p.compute():
            _, loss = p.model(x, y)
            p.scaler.scale(loss).backward()
        out["grad_finite"].append(bool(torch.isfinite(w.grad).all()))  # type: ignore[arg-type]
        out["skipped"].append(not p.scaler.step(p.optimizer))
        p.scaler.update()
        p.optimizer.zero_grad()
        out["moved"].append(not torch.equal(before, w.detach()))
    return out


def _unit(rank: int) -> dict[str, Any]:
    """fp16-unit under DDP: ``prepare`` registers its sum/sqrt(N) hook; the same run with
    that hook swapped for the FP8 one with ``divide_by`` = its divisor (the wiring of a
    unit recipe). One step's gradients and 6 steps' losses of both."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def grads(p: Any) -> torch.Tensor:
        x, y = _DATA.batch("train", 0)
        with p.compute():
            _, loss = p.model(x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
            p.scaler.scale(loss).backward()
        g = torch.cat([q.grad.float().reshape(-1) for q in p.model.parameters()])
        p.optimizer.zero_grad()
        return g

    ref = parallel.prepare(_model(), "fp16-unit", "ddp", _factory)
    g_ref = grads(ref)
    orig = DDP.register_comm_hook
    divisors: list[float] = []

    def swap(self: DDP, state: Any, hook: Any) -> None:
        factor, group = state[0], state[1]  # the unit hook's (sqrt(N), group, ...)
        divisors.append(factor)
        orig(self, FP8CommState("e4m3fn", factor, group), fp8_allreduce_hook)

    DDP.register_comm_hook = swap  # type: ignore[method-assign]
    try:
        p = parallel.prepare(_model(), "fp16-unit", "ddp", _factory)
        q = parallel.prepare(_model(), "fp16-unit", "ddp", _factory)
    finally:
        DDP.register_comm_hook = orig  # type: ignore[method-assign]
    g = grads(p)
    return {
        "divisors": divisors,
        "rel_l2": float((g - g_ref).norm() / g_ref.norm()),
        "norm_ratio": float(g.norm() / g_ref.norm()),
        "losses": _train(q),
        "reference": _train(ref),
    }


def _fsdp() -> dict[str, Any]:
    res: dict[str, Any] = {}
    with _counting() as seen:
        res["fp32"] = _train(parallel.prepare(_model(), "fp32", "fsdp", _factory))
    res["fp32/rs_bytes"] = sum(seen["reduce_scatter_single"]) / STEPS
    p = parallel.prepare(_model(), "fp32", "fsdp", _factory)
    st = enable_fp8_reduce_scatter(p.model, "e5m2")
    with _counting() as seen:
        res["fp8"] = _train(p)
    res["fp8/a2a_bytes"] = sum(seen["all_to_all_single"]) / STEPS
    res["fp8/bytes_sent"] = st.bytes_sent / STEPS
    res["fp8/reduce_scatters"] = len(seen["reduce_scatter_single"])
    res["bf16"] = _train(parallel.prepare(_model(), "bf16", "fsdp", _factory))
    orig = parallel.mixed_precision_policy  # wire the BF16 reduce into shard()
    parallel.mixed_precision_policy = lambda r: fsdp_reduce_policy(r, torch.bfloat16)  # type: ignore[assignment]
    try:
        with _counting() as seen:
            res["bf16-reduce"] = _train(parallel.prepare(_model(), "bf16", "fsdp", _factory))
    finally:
        parallel.mixed_precision_policy = orig  # type: ignore[assignment]
    res["bf16-reduce/rs_bytes"] = sum(seen["reduce_scatter_single"]) / STEPS
    return res


def main(path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {
        "world": world,
        "hook": _hook_checks(rank, world),
        "nonfinite": _nonfinite(rank),
        "ddp": _ddp(),
        "overflow": _gather_obj(_overflow(rank)),
        "unit": _unit(rank),
        "fsdp": _fsdp(),
    }
    if rank == 0:
        Path(path).write_text(json.dumps(result))
    shutdown()


def _gather_obj(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


if __name__ == "__main__":
    main(sys.argv[1])
