"""The torchtitan model converter, through torchtitan's ModelConverter protocol only
(torchtitan does not import with the CPU build of torch: docs/integrations.md)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lowprec.float8 import Float8Linear
from lowprec.integrations.torchtitan import (
    LowprecConverter,
    converter_for,
    float8_recipes,
    register,
)
from lowprec.recipes import get_recipe
from lowprec.recipes.layers import LayerRule


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(x)))


class Tiny(nn.Module):
    """torchtitan's model shape in small: blocks in a ModuleList, an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.output = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.output(x)


def _registry() -> dict[str, Any]:
    reg: dict[str, Any] = {}

    def register_model_converter(cls: type, name: str) -> None:  # torchtitan's, in small
        assert name not in reg, f"A model converter '{name}' is already registered."
        reg[name] = cls

    names = register(register_model_converter)
    assert names == list(reg)
    return reg


def test_registered_by_name_and_built_as_torchtitan_builds_them() -> None:
    reg = _registry()
    assert {"lowprec", "lowprec.fp8-delayed", "lowprec.fp8-rowwise", "lowprec.mxfp8"} <= set(reg)
    assert not any(n.endswith(("-unit", "-scalify")) for n in reg), "in-place recipes only"
    job = SimpleNamespace(model=SimpleNamespace(converters=["lowprec.fp8-delayed"]))
    # ModelConvertersContainer: cls(job_config, parallel_dims), convert, post_optimizer_hook
    converters = [reg[n](job, None) for n in job.model.converters]
    torch.manual_seed(0)
    model = Tiny()
    ref = Tiny()
    ref.load_state_dict(model.state_dict())
    for c in converters:
        c.convert(model)
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert kinds["layers.0.w1"] == "Float8Linear" and kinds["layers.1.w2"] == "Float8Linear"
    assert kinds["output"] == "Linear", "the recipe's float8_skip keeps the head"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 32)
    y = model(x)
    # Float8 (E4M3 inputs and weights): within a few E4M3 steps (2^-3 relative) of FP32.
    assert torch.allclose(y, ref(x), rtol=0.25, atol=0.25)
    y.square().mean().backward()
    opt.step()
    for c in converters:
        c.post_optimizer_hook(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_generic_converter_reads_the_recipe_from_the_job_config() -> None:
    job = SimpleNamespace(lowprec=SimpleNamespace(recipe="fp8-rowwise"))
    c = LowprecConverter(job, None)
    assert c.recipe_used.name == "fp8-rowwise"
    model = Tiny()
    c.convert(model)
    assert isinstance(model.layers[0].w1, Float8Linear)
    with pytest.raises(ValueError, match=r"\[lowprec\] section"):
        LowprecConverter(SimpleNamespace(), None)


def test_per_layer_rules_apply_and_other_recipes_are_refused() -> None:
    r = get_recipe("fp8-tensorwise", layers=(LayerRule("layers.1.*", None),))
    model = Tiny()
    converter_for(r)(SimpleNamespace(), None).convert(model)
    assert isinstance(model.layers[0].w1, Float8Linear)
    assert type(model.layers[1].w1) is nn.Linear, "the rule keeps block 1 in high precision"
    for bad in ("bf16", "fp8-unit", "fp16-scalify"):
        with pytest.raises(ValueError, match="float8 technique in place"):
            converter_for(bad)
    assert "fp8-tensorwise" in float8_recipes() and "bf16" not in float8_recipes()
