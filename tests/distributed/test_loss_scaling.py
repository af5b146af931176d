"""Issue 16 item 4: loss scaling under sharded gradients. The Inf/NaN flag is all-reduced
(MAX) across the process group, so an overflow on one rank makes every rank skip the step
and back off identically, with one all-reduce per step.

Two processes on CPU (gloo), each with its own gradients (as with sharded gradients: no
gradient all-reduce). Oracle: rank 0's own gradients are finite, so without the reduction
rank 0 would apply the step; the expected scale sequence follows the backoff rule."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from lowprec.amp import DynamicLossScaler, MasterWeights, StaticLossScaler
from lowprec.distributed import shutdown
from lowprec.recipes.step import Plain, train_step

WORLD = 2
INF_STEP = 1


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2).half()

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        out = self.lin(x.half()).float()
        return out, (out - y).square().mean()


def _scaler_phase(rank: int, group: Any) -> dict[str, Any]:
    """3 steps of scale → backward → step → update; an Inf in rank 1's gradient at
    step INF_STEP only."""
    model = _Model()
    opt = MasterWeights(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=1000, process_group=group)
    calls: list[int] = []
    orig = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return orig(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    out: dict[str, Any] = {"scales": [], "skipped": [], "locally_finite": [], "moved": []}
    try:
        for t in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * rank + t))
            _, loss = model(x, torch.zeros(8, 2))
            scaler.scale(loss).backward()
            if rank == 1 and t == INF_STEP:
                model.lin.weight.grad[0, 0] = math.inf  # type: ignore[index]
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())  # type: ignore[arg-type]
            before = model.lin.weight.detach().clone()
            out["scales"].append(scaler.get_scale())
            out["skipped"].append(not scaler.step(opt))
            out["locally_finite"].append(finite)
            out["moved"].append(not torch.equal(before, model.lin.weight))
            scaler.update()
            opt.zero_grad()
        out["final_scale"] = scaler.get_scale()
    finally:
        dist.all_reduce = orig  # type: ignore[assignment]
    out["all_reduces"] = len(calls)
    return out


def _train_step_phase(rank: int) -> dict[str, Any]:
    """``train_step(skip_nonfinite=True)`` with a NaN input on rank 1 only: rank 1 skips
    through ``scaler.skip`` and rank 0 through the reduced flag (no deadlock)."""
    model = _Model()
    opt = MasterWeights(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    run = Plain(model, opt, StaticLossScaler(4.0))
    x = torch.randn(8, 4)
    if rank == 1:
        x[0, 0] = math.nan
    r = train_step(run, x, torch.zeros(8, 2), skip_nonfinite=True)
    return {"skipped": r.skipped, "nonfinite": r.nonfinite}


def _worker(rank: int, store: str, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        result = {
            "default": _scaler_phase(rank, None),
            "group": _scaler_phase(rank, dist.new_group(ranks=list(range(WORLD)))),
            "train_step": _train_step_phase(rank),
        }
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        shutdown()


def _spawn(tmp_path: Path, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    ctx = mp.start_processes(
        _worker,
        args=(str(tmp_path / "store"), str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:  # a rank stuck in a collective: fail, not hang
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {WORLD} processes did not finish in {timeout_s} s")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_inf_on_one_rank_makes_every_rank_skip(tmp_path: Path) -> None:
    r0, r1 = _spawn(tmp_path)
    for phase in ("default", "group"):
        a, b = r0[phase], r1[phase]
        assert a["locally_finite"] == [True, True, True], "rank 0's own gradients are finite"
        assert b["locally_finite"] == [True, False, True]
        assert a["skipped"] == b["skipped"] == [False, True, False]
        assert a["moved"] == b["moved"] == [True, False, True]
        # 256 for steps 0 and 1; the skip at step 1 halves it for step 2 on both ranks
        assert a["scales"] == b["scales"] == [256.0, 256.0, 128.0]
        assert a["final_scale"] == b["final_scale"] == 128.0
        assert a["all_reduces"] == b["all_reduces"] == 3, "one all-reduce per step"
    assert r0["train_step"] == {"skipped": True, "nonfinite": None}
    assert (
        r1["train_step"]["skipped"] is True
        and r1["train_step"]["nonfinite"] == "loss and gradients"
    )
