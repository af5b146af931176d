"""Worker of ``test_parallel.py``: run under ``torch.distributed.run --nproc-per-node 2``.

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed/_parallel_worker.py
OUT.json`` trains the tiny reference model a few steps with
:func:`lowprec.distributed.parallel.prepare` (each rank on its half of the global batch)
for every (parallel mode, recipe) of :data:`CASES`, and each rank also trains the
one-process reference (:func:`lowprec.recipes.prepare`, the whole batch); rank 0 writes
both loss curves. It also saves a DCP checkpoint of a DDP run and resumes it in a fresh
``prepare``. One launch for all: a process start costs seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lowprec.distributed import checkpoint as dcp_state
from lowprec.distributed.parallel import prepare as dist_prepare
from lowprec.jobs.data import CharData
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.recipes import prepare
from lowprec.recipes.step import train_step

STEPS = 4
CASES: list[tuple[str, str]] = [
    (mode, recipe)
    for mode in ("fsdp", "ddp")
    for recipe in ("fp32", "fp16-dynamic-ls", "bf16", "fp8-tensorwise", "fp8-delayed", "fp16-unit")
] + [("ddp", "fp16-scalify"), ("fsdp", "fp16-scalify")]
_DATA = CharData(32, 8, seed=0)


def _model() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(ModelConfig(65, 32, 2, 2, 32))


def _factory(ps: list[Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=3e-3)


def _train(p: Any, start: int, end: int, parallel: bool) -> list[float]:
    r, w = (dist.get_rank(), dist.get_world_size()) if parallel else (0, 1)
    out = []
    for s in range(start, end):
        x, y = _DATA.batch("train", s)
        n = x.shape[0] // w
        res = train_step(
            p, x[r * n : (r + 1) * n], y[r * n : (r + 1) * n], 3e-3, skip_nonfinite=True
        )
        loss = res.loss.detach().float().clone()
        if parallel:  # the mean of equal halves' mean losses: the global batch's loss
            dist.all_reduce(loss)
            loss /= w
        out.append(float(loss))
    return out


def main(path: str) -> None:
    dist.init_process_group("gloo")
    result: dict[str, Any] = {}
    for mode, recipe in CASES:
        p = dist_prepare(_model(), recipe, mode, _factory)  # type: ignore[arg-type]
        par = _train(p, 0, STEPS, True)
        ref = _train(prepare(_model(), recipe, _factory), 0, STEPS, False)
        head = next(w for n, w in p.model.named_parameters() if n.endswith("head.weight"))
        result[f"{mode}/{recipe}"] = {
            "parallel": par,
            "reference": ref,
            "optimizer": type(p.optimizer).__name__,
            "weight": [type(head).__name__, str(head.dtype)],
        }
    # DCP under DDP (replicated state, MasterWeights and a dynamic loss scaler): save after
    # 2 steps, continue; a fresh prepare loads it and continues the same steps.
    ckpt = Path(path).parent / "ddp-dcp"
    p = dist_prepare(_model(), "fp16-dynamic-ls", "ddp", _factory)
    _train(p, 0, 2, True)
    dcp_state.save(p, ckpt, {"step": 2})
    after = _train(p, 2, STEPS, True)
    q = dist_prepare(_model(), "fp16-dynamic-ls", "ddp", _factory)
    extra = dcp_state.load(q, ckpt)
    resumed = _train(q, 2, STEPS, True)
    result["ddp_resume"] = {"after": after, "resumed": resumed, "step": extra["step"]}
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(out: Path) -> dict[str, Any]:
    """Run this worker on 2 processes (gloo) and return rank 0's results."""
    path = out / "parallel.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*cmd, __file__, str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(path.read_text())
    return result


if __name__ == "__main__":
    main(sys.argv[1])
