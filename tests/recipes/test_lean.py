"""Lean policies: master (none / fp32 / remainder) and optimizer-state precision in
recipes, prepare() and the training job; old recipes keep their meaning."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lowprec.amp import LeanAdamW, LeanSGD, MasterWeights, training_state_bytes
from lowprec.jobs.train import read_metrics, train
from lowprec.recipes import Policy, Recipe, get_recipe, prepare
from tests._helpers import TINY

LEAN = ["bf16-sr", "bf16-remainder", "bf16-8bit", "fp8-lean"]


def test_old_fields_map_onto_master() -> None:
    assert Policy("bf16", master_weights=True).master_kind == "fp32"
    assert Policy("bf16").master_kind == "none"
    p = Policy("bf16", master="remainder")
    assert p.master_weights and p.master_kind == "remainder" and p.lean
    assert Policy("bf16", master="none", stochastic_rounding=True).lean
    assert not Policy("bf16", master_weights=True, stochastic_rounding=True).lean
    # An old recipe dict (no master, no optimizer_state) reads as it did.
    old = {k: v for k, v in get_recipe("bf16").to_dict().items()
           if k not in ("master", "optimizer_state")}  # fmt: skip
    assert Recipe.from_dict(old) == get_recipe("bf16")
    assert get_recipe("bf16", master_weights=False).policy.master_kind == "none"


@pytest.mark.parametrize("name", LEAN)
def test_lean_presets_round_trip(name: str) -> None:
    r = get_recipe(name)
    assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"param_dtype": "fp16", "master": "remainder"}, "master='remainder' needs param_dtype"),
        ({"param_dtype": "bf16", "master": "remainder", "stochastic_rounding": True},
         "nothing to round stochastically"),
        ({"param_dtype": "bf16", "master_weights": True, "master": "none"}, "contradicts"),
        ({"param_dtype": "bf16", "master": "fp64"}, "master must be None or one of"),
        ({"param_dtype": "bf16", "optimizer_state": "4bit"}, "optimizer_state must be one of"),
        ({"master": "none", "stochastic_rounding": True}, "into bf16/fp16 parameters"),
    ],
)  # fmt: skip
def test_bad_policies_name_the_field(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Policy(**kwargs)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512))


@pytest.mark.parametrize(
    ("policy", "kind", "state_dtype"),
    [
        (Policy("bf16", master_weights=True), torch.optim.AdamW, torch.float32),
        (Policy("bf16", master_weights=True, optimizer_state="8bit"), LeanAdamW, torch.uint8),
        (Policy("bf16", master="none", stochastic_rounding=True), LeanAdamW, torch.float32),
        (Policy("bf16", master="remainder", optimizer_state="bf16"), LeanAdamW, torch.bfloat16),
        (Policy("fp32", optimizer_state="8bit"), LeanAdamW, torch.uint8),
        (Policy("fp16"), torch.optim.AdamW, torch.float16),
    ],
)  # fmt: skip
def test_prepare_builds_the_policys_optimizer(
    policy: Policy, kind: type, state_dtype: torch.dtype
) -> None:
    run = prepare(_net(), Recipe("x", policy=policy))
    x = torch.randn(4, 512).to(run.recipe.torch_dtype)
    with run.compute():
        run.scaler.scale(run.model(x).float().pow(2).mean()).backward()
    run.scaler.step(run.optimizer)
    inner = run.optimizer.optimizer if isinstance(run.optimizer, MasterWeights) else run.optimizer
    assert type(inner) is kind
    assert isinstance(run.optimizer, MasterWeights) == (policy.master_kind == "fp32")
    st = next(iter(inner.state.values()))
    assert st["exp_avg"].dtype == state_dtype


def test_bytes_per_parameter_of_the_lean_recipes() -> None:
    """After one step, by storage: BF16 parameter (2) + FP32 master (4) + two FP32
    moments (8) = 14 for bf16; 2 + 1 + 1 (+ an FP32 scale per 256: 2·4/256) for fp8-lean;
    the remainder adds 2 to bf16-sr's 10. The two biases (1024 of the 525312 elements)
    keep FP32 moments under 8-bit states (1-D tensors are not block-scaled): 8 bytes
    instead of 2 + 8/256 each."""
    bias = 1024 * (8 - 2 - 8 / 256) / 525312
    want = {"fp32": 12.0, "bf16": 14.0, "bf16-sr": 10.0, "bf16-remainder": 12.0,
            "bf16-8bit": 8.0 + 8 / 256 + bias, "fp8-lean": 4.0 + 8 / 256 + bias}  # fmt: skip
    for name, b in want.items():
        run = prepare(_net(), name)
        x = torch.randn(4, 512).to(run.recipe.torch_dtype)
        with run.compute():
            run.scaler.scale(run.model(x).float().pow(2).mean()).backward()
        run.scaler.step(run.optimizer)
        got = training_state_bytes(run.model, run.optimizer)
        # + one FP32 step counter per tensor (4 tensors, 4 bytes each) over 525k elements
        assert got["per_param"] == pytest.approx(b, abs=1e-3), name
    assert want["fp8-lean"] <= 4.5


def test_unit_scaling_groups_keep_lr_mult_with_8bit_states() -> None:
    r = get_recipe("fp32-unit", optimizer_state="8bit")
    from lowprec.jobs.model import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model("reference", ModelConfig(vocab_size=32, width=32, depth=1, heads=2))
    run = prepare(model, r, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    assert isinstance(run.optimizer, LeanSGD)
    mults = {g.get("lr_mult") for g in run.optimizer.param_groups}
    assert len(mults) > 1 and None not in mults


@pytest.mark.parametrize("recipe", ["bf16-sr", "bf16-remainder", "fp8-lean"])
def test_training_job_resumes_bit_for_bit(tmp_path: Path, recipe: str) -> None:
    """lowprec train: N steps straight == N/2, stop, resume (the stochastic-rounding
    generator and the 8-bit states in the checkpoint)."""
    cfg = replace(TINY, recipe=recipe)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(cfg, straight, progress=False)
    assert train(cfg, split, progress=False, stop_after=4) == {"stopped_at": 4}
    train(cfg, split, resume=True, progress=False)
    assert [r["loss"] for r in read_metrics(straight)] == [r["loss"] for r in read_metrics(split)]
    a = torch.load(straight / "checkpoint.pt", weights_only=True)["run"]["model"]
    b = torch.load(split / "checkpoint.pt", weights_only=True)["run"]["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
