"""FSDP2 all-gather bytes per training step, per float8 recipe: FP32 gather vs FP8 gather.

A stack of pre-norm MLP blocks (``LayerNorm``, ``Float8Linear`` up, ``Float8Linear`` down,
with biases) is sharded with ``fully_shard`` on every block and the root and trained for
a few steps on 2 CPU processes (gloo), once as is, once after
:func:`lowprec.distributed.enable_fp8_all_gather` (tensor-wise weights in FP8) and once
after ``enable_fp8_all_gather(model, blocks=True)`` (also the row-local block layouts:
row-wise, MX, 128x128 tiles whose shards hold whole tiles). FSDP2's all-gather is replaced by its
default implementation plus a byte counter (``set_custom_all_gather``), so the bytes are
the ones each rank puts on the wire. Also counted: the scale all-reduces per step.

Usage::

    python benchmarks/bench_fp8_allgather.py [--width 256] [--blocks 4] [--steps 3]
                                             [--out benchmarks/results/fp8_allgather_cpu.json]

Run without ``torchrun``: it starts ``torch.distributed.run --nproc-per-node 2`` itself.
"""

from __future__ import annotations

import argparse
import sys
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

from lowprec.distributed import shutdown

RECIPES = ("tensorwise", "delayed", "static", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4")


def _count_all_gather() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class Counting(DefaultAllGather):
        bytes = 0

        def __call__(
            self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False
        ) -> Any:  # type: ignore[override]
            Counting.bytes += input_tensor.numel() * input_tensor.element_size()
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return Counting


def _model(width: int, blocks: int, recipe: str) -> torch.nn.Module:
    from torch import nn

    from lowprec.float8 import convert_to_float8

    torch.manual_seed(0)
    layers = [
        nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)
        )
        for _ in range(blocks)
    ]
    return convert_to_float8(nn.Sequential(*layers), recipe)


def _run(recipe: str, fp8: bool, args: argparse.Namespace, blocks: bool = False) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lowprec.distributed import attach_scaling_sync, enable_fp8_all_gather
    from lowprec.distributed.float8_fsdp import fp8_all_gather_reductions
    from lowprec.float8 import calibrate

    rank = dist.get_rank()
    m = _model(args.width, args.blocks, recipe)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(8, 32, args.width, generator=g) for _ in range(args.steps)]
    if recipe == "static":
        with calibrate(m):
            m(xs[0]).square().mean().backward()
        m.zero_grad()
    wrapped = enable_fp8_all_gather(m, blocks=blocks) if fp8 else 0
    for block in m:
        fully_shard(block)
    fully_shard(m)
    counter = _count_all_gather()
    for mod in m.modules():
        if hasattr(mod, "set_custom_all_gather"):
            mod.set_custom_all_gather(counter())
    attach_scaling_sync(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for i, x in enumerate(xs):
        if i == 1:  # steady state: from the second step
            counter.bytes = 0
            red0 = fp8_all_gather_reductions(m)
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    steps = args.steps - 1
    return {
        "bytes_per_step": counter.bytes / steps,
        "reductions_per_step": (fp8_all_gather_reductions(m) - red0) / steps,
        "weights_in_fp8": wrapped,
    }


def worker(args: argparse.Namespace) -> None:
    import logging

    import torch.distributed as dist

    logging.disable(logging.WARNING)
    dist.init_process_group("gloo")
    rows = []
    for recipe in RECIPES:
        base = _run(recipe, False, args)
        fp8 = _run(recipe, True, args)
        blk = _run(recipe, True, args, blocks=True)
        rows.append(
            {
                "recipe": recipe,
                "fp32_MB": base["bytes_per_step"] / 1e6,
                "fp8_MB": fp8["bytes_per_step"] / 1e6,
                "ratio": fp8["bytes_per_step"] / base["bytes_per_step"],
                "fp8_weights": fp8["weights_in_fp8"],
                "blocks_MB": blk["bytes_per_step"] / 1e6,
                "blocks_ratio": blk["bytes_per_step"] / base["bytes_per_step"],
                "blocks_weights": blk["weights_in_fp8"],
                "scale_allreduces": fp8["reductions_per_step"],
            }
        )
    if dist.get_rank() == 0:
        cols = list(rows[0])
        title = (
            f"FSDP2 all-gather MB per step and rank (2 ranks, width {args.width}, "
            f"{args.blocks} blocks)"
        )
        print_table(title, cols, [[r[c] for c in cols] for r in rows])
        rec = run_record(
            "fp8_allgather", "cpu", width=args.width, blocks=args.blocks, steps=args.steps
        )
        write_json({**rec, "rows": rows}, args.out)
    shutdown()


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    args = parse_args(p, None, "fp8_allgather_cpu")
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is warm-up)")
    if launched():
        worker(args)
    else:
        torchrun_self(__file__, sys.argv[1:])


if __name__ == "__main__":
    main()
