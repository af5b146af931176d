"""Gradient communication in FP32, BF16 and FP8: bytes per step and the loss curve, DDP
and FSDP2, 2 processes (gloo on CPU).

The reference CharGPT (width 64, depth 2, 4 heads, batch 32 x 128 global: 16 rows per
rank), recipe ``fp32``, AdamW lr 3e-3, trained ``--steps`` steps from the same seed with:

* DDP: ``allreduce_hook`` (FP32, torch's), a BF16 all-reduce (torch's
  ``bf16_compress_hook``, which DDP accepts on CUDA and XPU only, rewritten here), and
  :func:`lowprec.distributed.register_fp8_allreduce` with E4M3FN and E5M2;
* FSDP2: the FP32 reduce-scatter, the BF16 one (:func:`lowprec.distributed.fsdp_reduce_policy`)
  and :func:`lowprec.distributed.enable_fp8_reduce_scatter` with E4M3FN and E5M2.

Bytes: each collective's input tensor is counted (torch.distributed's functions wrapped)
and turned into the bytes one rank sends with ring algorithms
(:func:`lowprec.distributed.grad_comm.ring_bytes`), scale all-reduces included; the loss
logging is not counted, nor (a separate column) FSDP2's all-gathers of the weights.
Gradient fidelity: the reduced gradients of one step against
the FP32 ones from the same weights, at initialisation and at the FP32 run's final
weights: relative L2 error over all parameters, the worst parameter's, and the fraction
of non-zero FP32 gradient elements that came out zero (flushed by the format's range),
over all parameters and in the parameter that loses most.
Step times are CPU-gloo only and say little about a GPU interconnect.

Usage::

    python benchmarks/bench_grad_comm.py [--steps 60] [--out benchmarks/results/grad_comm_cpu.json]

Run without ``torchrun``: it starts ``torch.distributed.run --nproc-per-node 2`` itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from _common import (
    arg_parser,
    launched,
    parse_args,
    print_table,
    run_record,
    torchrun_self,
    write_json,
)

_COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all",
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
}
DDP_MODES = ("fp32", "bf16", "fp8-e4m3fn", "fp8-e5m2")
FSDP_MODES = ("fp32", "bf16", "fp8-e4m3fn", "fp8-e5m2")


@contextmanager
def _counting() -> Iterator[dict[str, float]]:
    """Wrap torch.distributed's collectives; the bytes this rank sends (ring model), by
    collective."""
    import torch.distributed as dist

    import lowprec.distributed.grad_comm as gc

    sent = dict.fromkeys(_COLLECTIVES.values(), 0.0)
    orig = {k: getattr(dist, k) for k in _COLLECTIVES}
    gather = gc._all_gather

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[0] if name == "all_reduce" else args[1] if len(args) > 1 else None
            if t is None:
                t = kwargs.get("input", kwargs.get("input_tensor"))
            kind = _COLLECTIVES[name]
            sent[kind] += gc.ring_bytes(kind, t.nbytes, dist.get_world_size())
            return fn(*args, **kwargs)

        return counted

    for k in _COLLECTIVES:
        setattr(dist, k, wrap(k, orig[k]))
    gc._all_gather = dist.all_gather_single
    try:
        yield sent
    finally:
        for k in _COLLECTIVES:
            setattr(dist, k, orig[k])
        gc._all_gather = gather


def _bf16_hook(group, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook`` (which DDP refuses off CUDA/XPU): the bucket divided
    by N, all-reduced in BF16 (summed in BF16), copied back. (No annotations: DDP checks
    them as objects, and this module's are strings.)"""
    import torch.distributed as dist

    buf = bucket.buffer()
    low = buf.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(low, group=group, async_op=True).get_future()

    def back(f):  # type: ignore[no-untyped-def]
        return buf.copy_(f.value()[0])

    return fut.then(back)


def _setup() -> tuple[Any, Any]:
    from lowprec.jobs.data import CharData
    from lowprec.jobs.model import ModelConfig

    return ModelConfig(width=64, depth=2, heads=4, seq_len=128), CharData(128, 32, seed=0)


def _factory(ps: list[Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=3e-3)


def _prepared(parallel: str, mode: str, state: dict[str, Any] | None = None) -> Any:
    """A fresh prepared model (``state``: weights to start from) with ``mode``'s comms."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import lowprec.distributed.parallel as par
    from lowprec.distributed import (
        enable_fp8_reduce_scatter,
        fsdp_reduce_policy,
        register_fp8_allreduce,
    )
    from lowprec.jobs.model import CharGPT

    cfg, _ = _setup()
    torch.manual_seed(0)
    model = CharGPT(cfg)
    if state is not None:
        model.load_state_dict(state)
    if parallel == "ddp":
        p = par.prepare(model, "fp32", "ddp", _factory)
        if mode == "fp32":
            p.model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif mode == "bf16":
            p.model.register_comm_hook(None, _bf16_hook)
        else:
            register_fp8_allreduce(p.model, mode.removeprefix("fp8-"))
        return p
    orig = par.mixed_precision_policy
    if mode == "bf16":  # (how prepare would take it: the policy of shard())
        par.mixed_precision_policy = lambda r: fsdp_reduce_policy(r, torch.bfloat16)
    try:
        p = par.prepare(model, "fp32", "fsdp", _factory)
    finally:
        par.mixed_precision_policy = orig
    if mode.startswith("fp8-"):
        enable_fp8_reduce_scatter(p.model, mode.removeprefix("fp8-"))
    return p


def _half(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    _, data = _setup()
    x, y = data.batch("train", s)
    r, n = dist.get_rank(), x.shape[0] // dist.get_world_size()
    return x[r * n : (r + 1) * n], y[r * n : (r + 1) * n]


def _train(parallel: str, mode: str, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lowprec.recipes.step import train_step

    p = _prepared(parallel, mode)
    losses, times = [], []
    with _counting() as sent:
        for s in range(steps):
            x, y = _half(s)
            t0 = time.perf_counter()
            res = train_step(p, x, y, 3e-3)
            times.append(time.perf_counter() - t0)
            losses.append(res.loss.detach().float().reshape(1))
    loss = torch.cat(losses)
    dist.all_reduce(loss)  # the global batch's loss: the mean of equal halves'
    weights = sent["all_gather"] if parallel == "fsdp" else 0.0  # FSDP2: the weights
    return {
        "loss": (loss / dist.get_world_size()).tolist(),
        "bytes_per_step": (sum(sent.values()) - weights) / steps,
        "weight_gather_bytes_per_step": weights / steps,
        "cpu_gloo_s_per_step": statistics.median(times[1:] or times),
        "model": p.model,
    }


def _grads(parallel: str, mode: str, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The reduced gradients of one step (batch 0) from the weights ``state``."""
    from torch.distributed.tensor import DTensor

    p = _prepared(parallel, mode, state)
    x, y = _half(0)
    _, loss = p.model(x, y)
    loss.backward()
    out = {}
    for n, q in p.model.named_parameters():
        g = q.grad
        out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _fidelity(g: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    num = sum(float((g[n] - r).double().square().sum()) for n, r in ref.items())
    den = sum(float(r.double().square().sum()) for r in ref.values())
    per = {n: float((g[n] - r).norm() / r.norm()) for n, r in ref.items() if r.norm() > 0}
    worst = max(per, key=lambda n: per[n])
    lost = {n: (int(((g[n] == 0) & (r != 0)).sum()), int((r != 0).sum())) for n, r in ref.items()}
    most = max(lost, key=lambda n: lost[n][0] / max(lost[n][1], 1))
    return {
        "rel_l2": (num / den) ** 0.5,
        "worst_param": worst,
        "worst_rel_l2": per[worst],
        "flushed": sum(a for a, _ in lost.values()) / sum(b for _, b in lost.values()),
        "most_flushed_param": most,
        "most_flushed": lost[most][0] / max(lost[most][1], 1),
    }


def _state(model: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    m = getattr(model, "module", model)
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in m.state_dict().items()
    }


def worker(args: argparse.Namespace) -> None:
    import logging

    import torch.distributed as dist

    from lowprec.distributed import shutdown

    logging.disable(logging.WARNING)
    dist.init_process_group("gloo")
    cfg, _ = _setup()
    torch.manual_seed(0)
    from lowprec.jobs.model import CharGPT

    init = _state(CharGPT(cfg))
    rows, curves = [], {}
    for parallel, modes in (("ddp", DDP_MODES), ("fsdp", FSDP_MODES)):
        runs = {m: _train(parallel, m, args.steps) for m in modes}
        trained = _state(runs["fp32"]["model"])
        fid = {}
        for when, st in (("init", init), ("trained", trained)):
            ref = _grads(parallel, "fp32", st)
            fid[when] = {m: _fidelity(_grads(parallel, m, st), ref) for m in modes}
        base = runs["fp32"]
        for m in modes:
            r = runs[m]
            curves[f"{parallel}/{m}"] = r["loss"]
            rows.append(
                {
                    "parallel": parallel,
                    "comm": m,
                    "MB_per_step": r["bytes_per_step"] / 1e6,
                    "vs_fp32": r["bytes_per_step"] / base["bytes_per_step"],
                    "final_loss": r["loss"][-1],
                    "max_rel_dloss": max(
                        abs(a - b) / b for a, b in zip(r["loss"], base["loss"], strict=True)
                    ),
                    "grad_rel_l2_init": fid["init"][m]["rel_l2"],
                    "grad_rel_l2_trained": fid["trained"][m]["rel_l2"],
                    "worst_param_trained": fid["trained"][m]["worst_param"],
                    "worst_rel_l2_trained": fid["trained"][m]["worst_rel_l2"],
                    "flushed_init": fid["init"][m]["flushed"],
                    "flushed_trained": fid["trained"][m]["flushed"],
                    "most_flushed_trained": fid["trained"][m]["most_flushed"],
                    "most_flushed_param_trained": fid["trained"][m]["most_flushed_param"],
                    "weight_gather_MB": r["weight_gather_bytes_per_step"] / 1e6,
                    "cpu_gloo_s_per_step": r["cpu_gloo_s_per_step"],
                }
            )
    if dist.get_rank() == 0:
        names = ("worst_param_trained", "most_flushed_param_trained")
        cols = [c for c in rows[0] if c not in names]
        print_table(
            f"Gradient communication, 2 ranks, {args.steps} steps "
            f"({sum(v.numel() for v in init.values())} parameters; times: CPU gloo only)",
            cols,
            [[r[c] for c in cols] for r in rows],
        )
        for r in rows:
            print(
                f"{r['parallel']}/{r['comm']}: worst parameter {r['worst_param_trained']}, "
                f"most flushed {r['most_flushed_param_trained']}"
            )
        rec = run_record("grad_comm", "cpu", steps=args.steps, world=dist.get_world_size())
        write_json({**rec, "rows": rows, "loss_curves": curves}, args.out)
    shutdown()


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--steps", type=int, default=60)
    args = parse_args(p, None, "grad_comm_cpu")
    if args.steps < 2:
        p.error("--steps must be >= 2")
    if launched():
        worker(args)
    else:
        torchrun_self(__file__, sys.argv[1:])


if __name__ == "__main__":
    main()
