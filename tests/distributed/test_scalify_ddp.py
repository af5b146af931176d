"""scalify under DistributedDataParallel: 2 processes (CPU, gloo) against one.

This file is also the worker: ``python -m torch.distributed.run --nproc-per-node 2
test_scalify_ddp.py OUT.json``. Each rank trains ``DDP(scalify(model, "fp16"))`` for 3 SGD
steps on its half of the batch; rank 0 then trains an identical model in one process on
the whole batch as two accumulated half-batch micro-steps (each loss halved). The two see
the same operands: halving a loss is exact in scaled arithmetic (a power of two in the
scale), so the gradients differ only in the float32 order of DDP's average
``(g₀ + g₁)/2`` against ``g₀/2 + g₁/2``: one rounding, relative 1e-6.

FSDP2: ``fully_shard(scalify(model))`` (the wrapper as the root FSDP unit) gives the
one-process gradients; a module sharded *inside* the wrapper is refused (see
docs/scalify.md, "Distributed").
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lowprec.distributed import shutdown

STEPS = 3


def _model() -> torch.nn.Module:
    from lowprec.jobs.model import CharGPT, ModelConfig

    torch.manual_seed(0)
    return CharGPT(ModelConfig(vocab_size=32, width=32, depth=2, heads=2, seq_len=16))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 32, (4, 16), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _worker(out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lowprec.scalify import scalify

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    idx, tgt = _batch()
    half = slice(2 * rank, 2 * rank + 2)
    base = _model()
    ref_model = copy.deepcopy(base)
    ddp = DDP(scalify(base, "fp16"))
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        _, loss = ddp(idx[half], tgt[half])
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / 2)
    grads = {n: p.grad.tolist() for n, p in base.named_parameters() if p.grad is not None}
    fsdp = _fsdp(idx, tgt, half)
    if rank == 0:
        ref = scalify(ref_model, "fp16")
        ropt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        ref_losses = []
        for _ in range(STEPS):
            ropt.zero_grad()
            total = 0.0
            for r in range(2):
                h = slice(2 * r, 2 * r + 2)
                _, loss = ref(idx[h], tgt[h])
                (loss / 2).backward()
                total += float(loss.detach()) / 2
            ropt.step()
            ref_losses.append(total)
        ref_grads = {n: p.grad.tolist() for n, p in ref_model.named_parameters()}
        first = _model()  # one step from the initial weights, for FSDP
        for r in range(2):
            h = slice(2 * r, 2 * r + 2)
            (scalify(first, "fp16")(idx[h], tgt[h])[1] / 2).backward()
        first_grads = {n: p.grad.tolist() for n, p in first.named_parameters()}
        result = {"losses": losses, "ref_losses": ref_losses, "grads": grads,
                  "ref_grads": ref_grads, "wrapped_type": type(ddp.module).__name__,
                  "fsdp": fsdp, "first_grads": first_grads}  # fmt: skip
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    shutdown()


def _fsdp(idx: torch.Tensor, tgt: torch.Tensor, half: slice) -> dict[str, Any]:
    """FSDP2 with the Scalified wrapper as its root: one step's gradients (gathered);
    sharding a module inside the wrapper: the error."""
    from torch.distributed.fsdp import fully_shard

    from lowprec.scalify import scalify

    s = fully_shard(scalify(_model(), "fp16"))
    _, loss = s(idx[half], tgt[half])
    loss.backward()
    grads = {n.removeprefix("module."): p.grad.full_tensor().tolist()
             for n, p in s.named_parameters() if p.grad is not None}  # fmt: skip
    inner = _model()
    fully_shard(inner.blocks[0])
    try:
        scalify(inner, "fp16")(idx[half], tgt[half])
        error = ""
    except TypeError as e:
        error = str(e)
    return {"grads": grads, "error": error}


def _launch(tmp: Path) -> dict[str, Any]:
    path = tmp / "scalify_ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", __file__, str(path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(path.read_text())
    return result


@pytest.mark.slow
def test_ddp_equals_one_process(tmp_path: Path) -> None:
    r = _launch(tmp_path)
    assert r["wrapped_type"] == "Scalified"
    # losses: the mean of the ranks' losses is the one-process loss of the same step
    # (one float32 rounding apart); they fall (the run trains)
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6)
    assert r["losses"][-1] < r["losses"][0]
    for name, ref in r["ref_grads"].items():
        got = torch.tensor(r["grads"][name])
        want = torch.tensor(ref)
        assert float((got - want).norm() / want.norm()) < 1e-6, name

    # FSDP2 with the wrapper as root: gathered gradients equal one process's (the same
    # operands; the reduce-scatter's average is one float32 rounding)
    for name, ref in r["first_grads"].items():
        got = torch.tensor(r["fsdp"]["grads"][name])
        want = torch.tensor(ref)
        assert float((got - want).norm() / want.norm()) < 1e-6, name
    # a module sharded inside the wrapper is refused with an explanation
    assert "fully_shard" in r["fsdp"]["error"] and "blocks.0" in r["fsdp"]["error"]


if __name__ == "__main__":
    _worker(sys.argv[1])
