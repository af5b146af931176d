"""Which layers explain a gap (lowprec.jobs.attribution).

Oracles: a model with one layer made harmful by construction (its FP8 cast at scale 1
flushes inputs of 1e-4 to zero) must rank first, with the loss of the model where that
layer was never lowered (the same parameters); the swap leaves the model exactly as it was.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from lowprec.float8 import Float8Linear
from lowprec.jobs.attribution import attribute, attribute_run, high_precision, lowered_layers
from lowprec.jobs.rundir import RunError
from lowprec.recipes import prepare


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.b(torch.relu(self.a(x)) * 1e-4)  # b's inputs ~1e-4: flushed at scale 1
        return out, (out - y).square().mean()


def test_the_harmful_layer_ranks_first_and_the_model_is_restored() -> None:
    torch.manual_seed(0)
    ref = Tiny()
    prepared = prepare(Tiny(), "fp8-naive")
    prepared.model.load_state_dict(ref.to(torch.bfloat16).state_dict(), strict=False)
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        y = ref(x, x)[0]  # the high-precision output: the loss is the lowered model's error
    before = {k: v.clone() for k, v in prepared.model.state_dict().items()}
    mods = dict(prepared.model.named_modules())
    rows = attribute(prepared, [(x, y)])
    assert rows[0]["layer"] == "b"
    assert rows[0]["gain"] > 0.5 and abs(rows[1]["gain"]) < 0.01  # b's output was all zero
    # the oracle: b never lowered, the same parameters
    with torch.no_grad(), prepared.compute():
        prepared.model.b = nn.Linear(16, 16, bias=False).to(torch.bfloat16)
        prepared.model.b.load_state_dict({"weight": before["b.weight"]})
        want = float(prepared.model(x, y)[1])
    assert rows[0]["loss"] == pytest.approx(want, rel=1e-6)
    prepared.model.b = mods["b"]
    assert dict(prepared.model.named_modules()) == mods  # the same module objects back
    assert all(torch.equal(v, prepared.model.state_dict()[k]) for k, v in before.items())


def test_lowered_layers_and_errors(tmp_path: Path) -> None:
    p = prepare(Tiny(), "fp8-tensorwise", None)
    assert lowered_layers(p.model) == ["a", "b"]
    with high_precision(p.model, "a"):
        assert type(p.model.a) is nn.Linear
    assert isinstance(p.model.a, Float8Linear)
    with pytest.raises(ValueError, match="not a low-precision layer"):
        with high_precision(p.model, ""):
            pass
    with pytest.raises(RunError, match="checkpoint"):
        attribute_run(tmp_path)


def test_attribute_run_on_a_trained_run(tmp_path: Path) -> None:
    from lowprec.jobs.train import TrainConfig, train

    cfg = TrainConfig(
        recipe="fp8-naive", steps=4, width=32, depth=1, heads=2, seq_len=16, batch_size=4,
        eval_every=4, ckpt_every=4,
    )  # fmt: skip
    train(replace(cfg), tmp_path / "r", progress=False)
    rows = attribute_run(tmp_path / "r", batches=2)
    assert {r["layer"] for r in rows} == {
        "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.fc", "blocks.0.fc_out"
    }  # fmt: skip
    assert rows == sorted(rows, key=lambda r: -r["gain"])
