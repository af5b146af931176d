"""Worker of ``test_lean_distributed.py``: lean training state under FSDP2, DDP and DCP.

``python -m torch.distributed.run --nproc-per-node N tests/distributed/_lean_worker.py
OUT_DIR STAGE``; stage ``two`` on 2 processes, then stage ``one`` on 1 process. One launch
per stage (a process start costs seconds); rank 0 writes ``OUT_DIR/STAGE.json`` (and the
states as ``.pt`` files for the bitwise comparisons).

Stage ``two``:

* ``grads``: a BF16 model with an odd number of rows per weight (uneven shards) is
  sharded by ``fully_shard`` and stepped by a lean optimizer with given (identical)
  gradients, next to the same model unsharded in the same process (the one-process
  optimizer): parameters, 8-bit codes, block scales, remainders and the generator state
  are compared bit for bit; the generators of the ranks too.
* ``train``: the lean recipes under ``prepare(..., "fsdp" | "ddp")`` against
  :func:`lowprec.recipes.prepare` on one process (the global batch split over the ranks,
  as ``_parallel_worker.py``); under DDP, the replicas' parameters after training.
* ``dcp``: fp8-lean and bf16-remainder under FSDP2: 2 steps, :func:`checkpoint.save`,
  2 more steps (the uninterrupted run); a fresh ``prepare`` loads the checkpoint on the
  same world size and repeats the 2 steps; the full state at the checkpoint is written
  for stage ``one``.

Stage ``one`` (FSDP2 on one process): loads stage ``two``'s checkpoints (2 → 1), writes
the full restored state, saves it again and trains the same 2 steps; a fresh ``prepare``
loads that one-process checkpoint and trains them once more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from lowprec.amp import LeanAdamW
from lowprec.distributed import checkpoint as dcp_state
from lowprec.distributed import shutdown
from lowprec.distributed.parallel import prepare as dist_prepare
from lowprec.recipes import prepare
from tests.distributed._parallel_worker import _factory, _model, _train

STEPS = 4
FSDP = ["bf16-sr", "bf16-remainder", "bf16-8bit", "fp8-lean"]
DDP = ["bf16-sr", "fp8-lean"]
DCP = ["fp8-lean", "bf16-remainder"]
GRAD_CASES: dict[str, dict[str, Any]] = {
    "8bit-sr": {"state": "8bit", "stochastic_rounding": True},
    "8bit-sr-stochastic-states": {
        "state": "8bit",
        "stochastic_rounding": True,
        "state_rounding": "stochastic",
    },
    "8bit-remainder": {"state": "8bit", "master": "remainder"},
    "bf16-states-sr": {"state": "bf16", "stochastic_rounding": True},
}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _full(t: Any) -> Any:
    """The full tensor of a DTensor (gloo gathers neither uint8 nor 16-bit types: those
    travel as their bits in int32)."""
    if not isinstance(t, DTensor):
        return t
    if t.dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        return t.full_tensor()
    local = t.to_local()
    wide = (local.view(torch.int16) if local.is_floating_point() else local).to(torch.int32)
    d = DTensor.from_local(wide, t.device_mesh, t.placements, run_check=False,
                           shape=t.shape, stride=t.stride())  # fmt: skip
    full = d.full_tensor()
    if t.is_floating_point():
        return full.to(torch.int16).view(t.dtype)
    return full.to(t.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern as integers (so NaN payloads and -0 compare too)."""
    t = t.detach().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _net() -> nn.Module:
    torch.manual_seed(0)  # weights (301, 40) and (7, 301): odd rows, rows of 2 blocks
    return nn.Sequential(nn.Linear(40, 301), nn.GELU(), nn.Linear(301, 7)).bfloat16()


def _grads_case(kw: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref, sh = _net(), _net()
    for m in (sh[0], sh[2], sh):
        fully_shard(m, mesh=mesh)
    o_ref = LeanAdamW(ref.parameters(), lr=1e-2, generator=_gen(), **kw)
    o_sh = LeanAdamW(sh.parameters(), lr=1e-2, generator=_gen(), **kw)
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        for pr, ps in zip(ref.parameters(), sh.parameters(), strict=True):
            # gradients over many binades, as the same BF16 tensor on every rank
            grad = torch.randn(pr.shape, generator=g) * 10 ** (
                torch.rand(pr.shape, generator=g) * 6 - 5
            )
            pr.grad = grad.bfloat16()
            ps.grad = distribute_tensor(pr.grad.clone(), mesh, ps.placements)
        o_ref.step()
        o_sh.step()
    out: dict[str, Any] = {"params": True, "states": True, "dtensor_states": True, "keys": []}
    diff = 0.0
    for (name, pr), ps in zip(ref.named_parameters(), sh.parameters(), strict=True):
        full = ps.full_tensor()
        out["params"] &= _same(full, pr.detach())
        diff = max(diff, float((full.float() - pr.float()).abs().max()))
        st_ref, st_sh = o_ref.state[pr], o_sh.state[ps]
        out["keys"].append([name, sorted(st_sh)])
        for k, v in st_ref.items():
            if k == "step":
                continue
            out["dtensor_states"] &= isinstance(st_sh[k], DTensor)
            out["states"] &= _same(_full(st_sh[k]), v)
    out["max_param_diff"] = diff
    gens = [torch.empty_like(o_sh.generator.get_state()) for _ in range(dist.get_world_size())]
    dist.all_gather(gens, o_sh.generator.get_state())
    out["generators_equal_across_ranks"] = all(torch.equal(x, gens[0]) for x in gens)
    out["generator_equals_one_process"] = torch.equal(gens[0], o_ref.generator.get_state())
    # torch-style state dicts cross over: one process's (full tensors) into the sharded
    # optimizer (each rank takes its rows), the sharded one's (DTensors) into one process
    o_sh2 = LeanAdamW(sh.parameters(), lr=1e-2, generator=_gen(), **kw)
    o_sh2.load_state_dict(o_ref.state_dict())
    o_ref2 = LeanAdamW(ref.parameters(), lr=1e-2, generator=_gen(), **kw)
    o_ref2.load_state_dict(o_sh.state_dict())
    out["state_dicts_cross"] = all(
        _same(_full(o_sh2.state[ps][k]), v) and _same(o_ref2.state[pr][k], v)
        for pr, ps in zip(ref.parameters(), sh.parameters(), strict=True)
        for k, v in o_ref.state[pr].items()
    )
    w = sh[2].weight
    codes = o_sh.state[w].get("exp_avg")
    if codes is not None and codes.dtype == torch.uint8:
        scales = o_sh.state[w]["exp_avg_scale"]
        out["weight2"] = {
            "codes": [list(codes.shape), list(codes.to_local().shape)],
            "scales": [list(scales.shape), list(scales.to_local().shape)],
        }
    return out


def _gathered(model: nn.Module) -> torch.Tensor:
    """The flat float32 parameters of a replica (DDP)."""
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _train_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    refs = {
        r: _train(prepare(_model(), r, _factory, generator=_gen()), 0, STEPS, False)
        for r in sorted(set(FSDP) | set(DDP))
    }
    for mode, recipes in (("fsdp", FSDP), ("ddp", DDP)):
        for r in recipes:
            # each rank seeds its own generator: prepare broadcasts rank 0's (= _gen())
            seeded = torch.Generator().manual_seed(1234 + 1000 * dist.get_rank())
            p = dist_prepare(_model(), r, mode, _factory, seeded)  # type: ignore[arg-type]
            res: dict[str, Any] = {"parallel": _train(p, 0, STEPS, True), "reference": refs[r]}
            gen = p.optimizer.generator.get_state()
            gens = [torch.empty_like(gen) for _ in range(dist.get_world_size())]
            dist.all_gather(gens, gen)
            res["generators_equal"] = all(torch.equal(g, gen) for g in gens)
            head = next(w for n, w in p.model.named_parameters() if n.endswith("head.weight"))
            res["weight"] = [type(head).__name__, str(head.dtype)]
            res["optimizer"] = type(p.optimizer).__name__
            if mode == "ddp":
                mine = _gathered(p.model)
                all_ = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
                dist.all_gather(all_, mine)
                res["replicas_equal"] = all(torch.equal(_bits(a), _bits(mine)) for a in all_)
            out[f"{mode}/{r}"] = res
    return out


def _full_state(p: Any) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state tensor of ``p`` as full tensors, by name."""
    out = {f"param/{n}": _full(w).detach().clone() for n, w in p.model.named_parameters()}
    names = {id(w): n for n, w in p.model.named_parameters()}
    for w, st in p.optimizer.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"state/{names[id(w)]}/{k}"] = _full(v).detach().clone()
    out["generator"] = p.optimizer.generator.get_state()
    return out


def _dcp_two(base: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in DCP:
        p = dist_prepare(_model(), r, "fsdp", _factory, _gen())
        _train(p, 0, 2, True)
        dcp_state.save(p, base / f"ckpt-{r}", {"step": 2})
        saved = _full_state(p)
        straight = _train(p, 2, STEPS, True)
        q = dist_prepare(_model(), r, "fsdp", _factory, torch.Generator().manual_seed(99))
        extra = dcp_state.load(q, base / f"ckpt-{r}")
        loaded = _full_state(q)
        same = sorted(saved) == sorted(loaded) and all(_same(saved[k], loaded[k]) for k in saved)
        resumed = _train(q, 2, STEPS, True)
        if dist.get_rank() == 0:
            torch.save(saved, base / f"saved-{r}.pt")
        out[r] = {"straight": straight, "resumed": resumed, "loaded_equal": same,
                  "step": extra["step"]}  # fmt: skip
    return out


def _dcp_ddp(base: Path) -> dict[str, Any]:
    """fp8-lean under DDP: the replicated state (8-bit codes, scales, the generator in the
    optimizer's state dict) saved after 2 steps and resumed by a fresh ``prepare``."""
    p = dist_prepare(_model(), "fp8-lean", "ddp", _factory, _gen())
    _train(p, 0, 2, True)
    dcp_state.save(p, base / "ckpt-ddp", {"step": 2})
    straight = _train(p, 2, STEPS, True)
    q = dist_prepare(_model(), "fp8-lean", "ddp", _factory, torch.Generator().manual_seed(99))
    dcp_state.load(q, base / "ckpt-ddp")
    return {"straight": straight, "resumed": _train(q, 2, STEPS, True)}


def _dcp_one(base: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in DCP:
        q = dist_prepare(_model(), r, "fsdp", _factory, torch.Generator().manual_seed(99))
        extra = dcp_state.load(q, base / f"ckpt-{r}")
        loaded = _full_state(q)
        saved = torch.load(base / f"saved-{r}.pt", weights_only=True)
        mism = [k for k in saved if k not in loaded or not _same(saved[k], loaded[k])]
        # and on from here in one process: saved again, the resumed run repeats it
        dcp_state.save(q, base / f"ckpt1-{r}", {"step": 2})
        resumed = _train(q, 2, STEPS, True)
        q2 = dist_prepare(_model(), r, "fsdp", _factory, torch.Generator().manual_seed(98))
        dcp_state.load(q2, base / f"ckpt1-{r}")
        out[r] = {"mismatched": mism, "n": len(saved), "step": extra["step"],
                  "resumed": resumed, "resumed_again": _train(q2, 2, STEPS, True)}  # fmt: skip
    return out


def main(base: str, stage: str) -> None:
    dist.init_process_group("gloo")
    out = Path(base)
    result: dict[str, Any]
    if stage == "two":
        result = {"grads": {k: _grads_case(kw) for k, kw in GRAD_CASES.items()}}
        result["train"] = _train_cases()
        result["dcp"] = _dcp_two(out)
        result["dcp_ddp"] = _dcp_ddp(out)
    else:
        result = {"dcp": _dcp_one(out)}
    if dist.get_rank() == 0:
        (out / f"{stage}.json").write_text(json.dumps(result))
    shutdown()


def _run(out: Path, n: int, stage: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(n), __file__, str(out), stage]
    root = str(Path(__file__).resolve().parents[2])  # for ``tests.distributed`` imports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result: dict[str, Any] = json.loads((out / f"{stage}.json").read_text())
    return result


def launch(out: Path) -> dict[str, Any]:
    """Stage ``two`` on 2 processes, then stage ``one`` on one (module docstring)."""
    two = _run(out, 2, "two")
    two["one"] = _run(out, 1, "one")
    return two


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
