"""Worker of ``test_parallel.py``: run under ``torch.distributed.run --nproc-per-node 2``.

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed/_parallel_worker.py
OUT.json`` trains the tiny reference model a few steps with
:func:`lowprec.distributed.parallel.prepare` (each rank on its half of the global batch)
for every (parallel mode, recipe) of :data:`CASES`, and each rank also trains the
one-process reference (:func:`lowprec.recipes.prepare`, the whole batch); rank 0 writes
both loss curves. It also saves a DCP checkpoint of a DDP run and resumes it in a fresh
``prepare``. One launch for all: a process start costs seconds.

Resharded DCP resume (:data:`RESHARD`, FSDP2): ``launch`` first runs stage ``one`` on one
process (2 steps, checkpoint), then the 2-process main stage, which also trains 2 steps,
checkpoints and continues (the uninterrupted run), and loads stage ``one``'s checkpoint
(1 → 2); then stage ``two_to_one`` on one process loads the 2-process checkpoint (2 → 1).
Each load records the restored scaling state (loss scaler, amax histories).
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
from lowprec.distributed import shutdown
from lowprec.distributed.float8_fsdp import Float8AllGatherWeight
from lowprec.distributed.parallel import prepare as dist_prepare
from lowprec.float8 import Float8Linear
from lowprec.jobs.data import CharData
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.recipes import prepare
from lowprec.recipes.step import train_step

STEPS = 4
CASES: list[tuple[str, str]] = [
    (mode, recipe)
    for mode in ("fsdp", "ddp")
    for recipe in ("fp32", "fp16-dynamic-ls", "bf16", "fp8-tensorwise", "fp8-delayed", "fp16-unit")
] + [("ddp", "fp16-scalify"), ("fsdp", "fp16-scalify"), ("fsdp", "fp8-rowwise"), ("fsdp", "mxfp8")]
_DATA = CharData(32, 8, seed=0)
RESHARD = ["fp8-delayed", "fp16-dynamic-ls", "fp16-unit"]
BLOCKS = ["fp8-rowwise", "mxfp8"]


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


def _scaling_state(p: Any) -> dict[str, Any]:
    """The loss scaler's state and the float8 amax histories (replicated on every rank)."""
    sc = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in
          p.scaler.state_dict().items()}  # fmt: skip
    amax = {k: v.tolist() for k, v in p.model.named_buffers() if "amax" in k}
    return {"scaler": sc, "amax": amax}


def _reshard_stage(stage: str, base: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for recipe in RESHARD:
        if stage in ("one", "two"):  # train 2 steps and checkpoint
            p = dist_prepare(_model(), recipe, "fsdp", _factory)
            _train(p, 0, 2, True)
            dcp_state.save(p, base / f"{stage}-{recipe}", {"step": 2})
            out[recipe] = {"saved": _scaling_state(p), "straight": _train(p, 2, STEPS, True)}
        if stage in ("two", "two_to_one"):  # load the other world size's checkpoint
            src = "one" if stage == "two" else "two"
            q = dist_prepare(_model(), recipe, "fsdp", _factory)
            extra = dcp_state.load(q, base / f"{src}-{recipe}")
            res = {"loaded": _scaling_state(q), "step": extra["step"]}
            res["resumed"] = _train(q, 2, STEPS, True)
            out.setdefault(recipe, {})["from_" + src] = res
    return out


def main(path: str, stage: str = "two") -> None:
    dist.init_process_group("gloo")
    if stage != "two":  # one process: a resharding stage only
        result = _reshard_stage(stage, Path(path).parent)
        Path(path).write_text(json.dumps(result))
        shutdown()
        return
    result: dict[str, Any] = {"reshard": _reshard_stage("two", Path(path).parent)}
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
    # FSDP2 with the narrow all-gather of block layouts (fp8_all_gather="blocks"), against
    # the default gather of the same recipe and the one-process run.
    for recipe in BLOCKS:
        p = dist_prepare(_model(), recipe, "fsdp", _factory, fp8_all_gather="blocks")
        wrapped = sum(
            isinstance(getattr(m.weight, "_local_tensor", None), Float8AllGatherWeight)
            for m in p.model.modules()
            if isinstance(m, Float8Linear)
        )
        blocks = _train(p, 0, STEPS, True)
        result[f"fsdp-blocks/{recipe}"] = {"blocks": blocks, "wrapped": wrapped}
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
    shutdown()


def _run(out: Path, n: int, stage: str) -> dict[str, Any]:
    path = out / f"{stage}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(n), __file__, str(path), stage]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def launch(out: Path) -> dict[str, Any]:
    """Run the stages (see the module docstring): one process, 2 processes (gloo), one
    process; rank 0's results of the 2-process stage, with the resharding results of all
    three under ``"reshard"``."""
    one = _run(out, 1, "one")
    result = _run(out, 2, "two")
    two_to_one = _run(out, 1, "two_to_one")
    for recipe in RESHARD:
        r = result["reshard"][recipe]
        r["one"] = one[recipe]
        r["from_two"] = two_to_one[recipe]["from_two"]
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "two")
