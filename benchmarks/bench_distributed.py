"""Data parallelism per recipe: bytes on the wire per step, and step time of 1 vs 2 processes.

The reference char-LM (``lowprec.jobs.model.CharGPT``) is trained with each recipe:

* on 1 process (``lowprec.recipes.prepare``, the whole batch);
* on 2 CPU processes (gloo) with ``lowprec.distributed.prepare(..., parallel="fsdp")`` and
  ``parallel="ddp"``, each rank on half of the same global batch.

Bytes: FSDP2's all-gathers and reduce-scatters are counted in Python (each rank's input to
``all_gather_into_tensor`` / ``reduce_scatter_tensor``, as FSDP2 calls them), per step and
rank, with the FP8 all-gather of float8 weights where the layout allows. DDP all-reduces its
gradient buckets in C++: its bytes are the gradients' (every parameter's size in its dtype),
per step and rank. Step time: ``_common.time_fn``, one step per repeat in order, the median
over ``--steps`` timed steps after one warm-up step.

Usage::

    python benchmarks/bench_distributed.py [--steps 4] [--width 128] [--depth 2]
        [--batch-size 16] [--seq-len 64] [--out benchmarks/results/distributed_cpu.json]

Run without ``torchrun``: it starts ``torch.distributed.run --nproc-per-node 2`` itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import (
    arg_parser,
    launched,
    parse_args,
    print_table,
    run_record,
    time_fn,
    torchrun_self,
    write_json,
)

from lowprec.distributed import shutdown

RECIPES = (
    "fp32",
    "bf16",
    "fp16-dynamic-ls",
    "fp8-tensorwise",
    "fp8-delayed",
    "fp8-rowwise",
    "fp16-unit",
    "fp16-scalify",
)


class _Bytes:
    all_gather = 0
    reduce_scatter = 0


def _count_collectives() -> None:
    """Count the bytes each rank sends into FSDP2's collectives (``all_gather_single`` and
    ``reduce_scatter_single`` in torch 2.13; ``*_into_tensor`` / ``*_tensor`` before)."""
    import torch.distributed as dist

    def counting(name: str, kind: str) -> None:
        inner = getattr(dist, name, None)
        if inner is None:
            return

        def call(*a: Any, **k: Any) -> Any:
            x = a[1] if len(a) > 1 else k.get("input", k.get("input_tensor"))
            setattr(_Bytes, kind, getattr(_Bytes, kind) + x.numel() * x.element_size())
            return inner(*a, **k)

        setattr(dist, name, call)

    for name in ("all_gather_single", "all_gather_into_tensor"):
        counting(name, "all_gather")
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        counting(name, "reduce_scatter")


def _train(args: argparse.Namespace, recipe: str, parallel: str | None) -> dict[str, Any]:
    from lowprec.jobs.data import CharData
    from lowprec.jobs.model import CharGPT, ModelConfig
    from lowprec.recipes import prepare
    from lowprec.recipes.step import train_step

    torch.manual_seed(0)
    model = CharGPT(ModelConfig(65, args.width, args.depth, 4, args.seq_len))
    data = CharData(args.seq_len, args.batch_size, seed=0)

    def factory(ps: list[Any]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-3)

    if parallel is None:
        run, rank, world = prepare(model, recipe, factory), 0, 1
    else:
        import torch.distributed as dist

        from lowprec.distributed import prepare as dist_prepare

        run = dist_prepare(model, recipe, parallel, factory)  # type: ignore[arg-type]
        rank, world = dist.get_rank(), dist.get_world_size()
    ag: list[int] = []
    rs: list[int] = []

    def step() -> None:
        x, y = data.batch("train", len(ag))
        k = x.shape[0] // world
        _Bytes.all_gather = _Bytes.reduce_scatter = 0
        train_step(run, x[rank * k : (rank + 1) * k], y[rank * k : (rank + 1) * k], 1e-3)
        ag.append(_Bytes.all_gather)
        rs.append(_Bytes.reduce_scatter)

    # every rank runs the same steps: with min_repeat_s=0, one step per repeat
    t = time_fn(step, repeats=args.steps, warmup=1, min_repeat_s=0.0)
    grads = sum(p.numel() * p.element_size() for p in run.model.parameters())
    return {
        "step_s": t.median_ms / 1e3,
        "all_gather_MB": statistics.mean(ag[1:]) / 1e6,  # the first step is warm-up
        "reduce_scatter_MB": statistics.mean(rs[1:]) / 1e6,
        "grad_MB": grads / 1e6,
    }


def worker(args: argparse.Namespace) -> None:
    import logging

    import torch.distributed as dist

    logging.disable(logging.WARNING)
    dist.init_process_group("gloo")
    _count_collectives()
    rows = {f"{m}/{r}": _train(args, r, m) for r in RECIPES for m in ("fsdp", "ddp")}
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    shutdown()


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parse_args(p, None, "distributed_cpu")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if launched():
        worker(args)
        return
    torch.set_num_threads(1)  # as each of the 2 workers (torchrun's OMP_NUM_THREADS=1)
    one = {r: _train(args, r, None) for r in RECIPES}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "two.json"
        torchrun_self(__file__, [*sys.argv[1:], "--worker-out", str(path)])
        two = json.loads(path.read_text())
    rows = []
    for r in RECIPES:
        f, d = two[f"fsdp/{r}"], two[f"ddp/{r}"]
        rows.append(
            {
                "recipe": r,
                "fsdp_all_gather_MB": f["all_gather_MB"],
                "fsdp_reduce_scatter_MB": f["reduce_scatter_MB"],
                "ddp_all_reduce_MB": d["grad_MB"],
                "1proc_step_ms": one[r]["step_s"] * 1e3,
                "fsdp_2proc_step_ms": f["step_s"] * 1e3,
                "ddp_2proc_step_ms": d["step_s"] * 1e3,
                "fsdp_speedup": one[r]["step_s"] / f["step_s"],
                "ddp_speedup": one[r]["step_s"] / d["step_s"],
            }
        )
    cols = list(rows[0])
    title = (
        f"bytes per step and rank, step time (CPU, gloo; width {args.width}, depth "
        f"{args.depth}, global batch {args.batch_size}x{args.seq_len})"
    )
    print_table(title, cols, [[row[c] for c in cols] for row in rows])
    rec = run_record(
        "distributed",
        "cpu",
        steps=args.steps,
        width=args.width,
        depth=args.depth,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
    )
    write_json({**rec, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
