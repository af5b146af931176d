"""Lean training state (lowprec.amp.lean) under FSDP2, DDP and DCP, against one process.

Two launches of ``_lean_worker.py`` (2 processes, gloo; then 1 process): see its docstring;
and ``lowprec train --parallel fsdp --recipe fp8-lean`` through torchrun (4 launches).

What can differ, and the tolerance it gives:

* Given the same gradients (``grads``): nothing. A rank updates whole rows, the 8-bit
  blocks lie along rows (a shard's codes and scales are those rows of the one-process
  ones), every operation is elementwise or within a row, and the stochastic rounding of
  a shard uses its rows of the draws of the whole tensor: parameters, codes, scales,
  remainders and generator states are compared bit for bit.
* Training (``train``), relative on every step's loss: the ranks' BF16 gradients of half
  batches are summed (FSDP2: in FP32, then rounded to BF16; DDP: in BF16) instead of one
  BF16 gradient of the whole batch, a few BF16 roundings (2^-8) of the update: 1e-3 for
  bf16-sr, bf16-remainder, bf16-8bit (measured ~2e-5). fp8-lean: also the FP8 input and
  gradient scales of half batches (2^-4 / 2^-3 per element, as fp8-tensorwise in
  test_parallel.py): 2e-3 (measured ~1.5e-4).
* DCP on the same world size: the restored state and the resumed losses bit for bit.
  After a 2 → 1 reshard: the restored state bit for bit (every parameter, code, scale,
  remainder and the generator); the resumed losses then differ from the 2-process run's
  only by the gradient sums, as above: 1e-3 / 2e-3 (measured ~2e-5); saved again on one
  process and resumed, the run repeats its losses bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests._helpers import world_of_one
from tests.distributed._lean_worker import DCP, DDP, FSDP, GRAD_CASES, STEPS, launch

TOL = {"bf16-sr": 1e-3, "bf16-remainder": 1e-3, "bf16-8bit": 1e-3, "fp8-lean": 2e-3}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return launch(tmp_path_factory.mktemp("lean"))


def _worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_sharded_update_is_the_one_process_update_bit_for_bit(
    result: dict[str, Any], case: str
) -> None:
    r = result["grads"][case]
    assert r["params"] and r["max_param_diff"] == 0.0
    assert r["states"] and r["dtensor_states"]
    assert r["generators_equal_across_ranks"] and r["generator_equals_one_process"]
    assert r["state_dicts_cross"]  # a one-process state dict loads sharded, and back
    if case.startswith("8bit"):
        # weight (7, 301) on 2 ranks: 4 rows here; 2 blocks per row (256 + 45 columns)
        assert r["weight2"] == {"codes": [[7, 301], [4, 301]], "scales": [[7, 2], [4, 2]]}
        # 1-D tensors (biases) keep FP32 moments: no scales
        keys = dict((k, v) for k, v in r["keys"])
        assert "exp_avg_scale" in keys["0.weight"] and "exp_avg_scale" not in keys["0.bias"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "recipe"), [("fsdp", r) for r in FSDP] + [("ddp", r) for r in DDP]
)
def test_two_processes_train_as_one(result: dict[str, Any], mode: str, recipe: str) -> None:
    r = result["train"][f"{mode}/{recipe}"]
    assert len(r["parallel"]) == STEPS
    assert _worst(r["parallel"], r["reference"]) <= TOL[recipe], r
    assert r["reference"][-1] < r["reference"][0]  # it trains: not a comparison of constants
    assert r["optimizer"] == "LeanAdamW"
    assert r["generators_equal"]  # rank 0's generator, broadcast by prepare
    if mode == "fsdp":  # BF16 shards without FP32 masters; bf16-8bit's shards are masters
        dtype = "torch.float32" if recipe == "bf16-8bit" else "torch.bfloat16"
        assert r["weight"] == ["DTensor", dtype]
    else:
        assert r["replicas_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", DCP)
def test_dcp_resume_same_world_size_is_bit_exact(result: dict[str, Any], recipe: str) -> None:
    r = result["dcp"][recipe]
    assert r["step"] == 2 and r["loaded_equal"]
    assert r["resumed"] == r["straight"]


@pytest.mark.slow
def test_dcp_resume_under_ddp_is_bit_exact(result: dict[str, Any]) -> None:
    r = result["dcp_ddp"]  # fp8-lean: 8-bit states and the generator, replicated
    assert len(r["straight"]) == 2 and r["resumed"] == r["straight"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", DCP)
def test_dcp_reshard_two_to_one(result: dict[str, Any], recipe: str) -> None:
    one, two = result["one"]["dcp"][recipe], result["dcp"][recipe]
    assert one["step"] == 2 and one["n"] > 10
    assert one["mismatched"] == []  # every parameter, state and the generator, bitwise
    assert _worst(one["resumed"], two["straight"]) <= TOL[recipe]
    # resumed after the reshard, it resumes bit for bit on its own world size
    assert one["resumed_again"] == one["resumed"]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_lean_recipes_are_prepared_on_one_rank(mode: str) -> None:
    """A world of one: every lean recipe prepares (none is refused any more), with a lean
    optimizer; under FSDP2 bf16-sr's parameters stay BF16 shards."""
    from lowprec.amp.lean import LeanOptimizer
    from lowprec.distributed.parallel import prepare

    with world_of_one():
        for recipe in ("fp8-lean", "bf16-sr", "bf16-remainder", "bf16-8bit"):
            p = prepare(nn.Sequential(nn.Linear(8, 8)), recipe, mode)  # type: ignore[arg-type]
            inner = getattr(p.optimizer, "optimizer", p.optimizer)
            assert isinstance(inner, LeanOptimizer), recipe
            if mode == "fsdp" and recipe == "bf16-sr":
                assert next(p.model.parameters()).dtype == torch.bfloat16
            del p, inner


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``lowprec train --parallel fsdp --recipe fp8-lean`` under torch's launcher: A (2
    processes, 4 steps, uninterrupted); B (2 processes, 2 steps, then ``--resume`` to 4);
    B2 (a copy of B at step 2, resumed to 4 on one process: 2 → 1)."""
    import shutil
    import subprocess
    import sys

    from lowprec.jobs.train import read_metrics

    tmp = tmp_path_factory.mktemp("lean_cli")
    args = ["--recipe", "fp8-lean", "--batch-size", "8", "--seq-len", "32", "--width", "32",
            "--depth", "1", "--heads", "2", "--eval-every", "3", "--eval-batches", "2",
            "--ckpt-every", "2", "--no-progress", "--parallel", "fsdp"]  # fmt: skip

    def run(n: int, *more: str) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(n), "-m", "lowprec", "train", *args, *more]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]

    run(2, "--steps", "4", "--out", str(tmp / "A"))
    run(2, "--steps", "2", "--out", str(tmp / "B"))
    shutil.copytree(tmp / "B", tmp / "B2")
    run(2, "--steps", "4", "--resume", "--out", str(tmp / "B"))
    run(1, "--steps", "4", "--resume", "--out", str(tmp / "B2"))
    return {k: [r["loss"] for r in read_metrics(tmp / k)] for k in ("A", "B", "B2")}


@pytest.mark.slow
def test_cli_lean_fsdp_resumes_bit_for_bit_and_after_reshard(cli_runs: dict[str, Any]) -> None:
    a, b, b2 = cli_runs["A"], cli_runs["B"], cli_runs["B2"]
    assert len(a) == 4 and b == a  # same world size: every loss to the last bit
    assert b2[:2] == a[:2]  # written by the 2-process run before the copy
    # 2 -> 1: the gradient sums and FP8 scales of half batches (bf16-sr measured 4.4e-6,
    # fp8-lean 1.27e-5)
    assert _worst(b2, a) <= TOL["fp8-lean"]
