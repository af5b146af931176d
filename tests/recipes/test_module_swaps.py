"""Module swaps never drop parameters (issue 40, item 1): a linear layer that holds child
modules (a LoRA-style adapter), other parameters or buffers keeps them through every
transform that replaces modules: the float8 conversion (at the root and inside a model)
and back, unit scaling, scalify, and ``prepare`` under every recipe. Each test counts the
parameters and the ``state_dict`` keys before and after."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec import scalify, unit
from lowprec.float8 import Float8Linear, convert_back, convert_to_float8
from lowprec.recipes import prepare, recipe_names


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.a.child = nn.Sequential(nn.Linear(4, 4))  # what torchao's test attaches
        self.a.extra = nn.Parameter(torch.ones(3))
        self.a.register_buffer("buf", torch.arange(2.0))
        self.a.register_buffer("scratch", torch.zeros(1), persistent=False)
        self.b = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.b(torch.relu(self.a(x)))
        return y


def _names(m: nn.Module) -> tuple[list[str], list[str]]:
    """Parameter names and state_dict keys, without scalify's wrapper prefix and the float8
    scaling state (which the conversion adds)."""
    params = sorted(n.removeprefix("module.") for n, _ in m.named_parameters())
    state = ("_amax_history", "_static_amax", "rng_state")  # float8 state, not parameters
    keys = sorted(k for k in m.state_dict() if not k.endswith(state))
    return params, keys


BEFORE = _names(Adapted())


def test_reference_names() -> None:
    assert len(BEFORE[0]) == 7 and "a.child.0.weight" in BEFORE[0] and "a.extra" in BEFORE[0]
    assert "a.buf" in BEFORE[1] and "a.scratch" not in BEFORE[1]


@pytest.mark.parametrize("preset", ["tensorwise", "delayed", "static", "rowwise", "nvfp4"])
def test_float8_conversion_keeps_children_parameters_and_buffers(preset: str) -> None:
    m = Adapted()
    child, extra, buf = m.a.child, m.a.extra, m.a.buf
    out = convert_to_float8(m, preset)
    assert isinstance(out.a, Float8Linear)
    assert _names(out) == BEFORE
    assert out.a.child is child and out.a.extra is extra and out.a.buf is buf  # the same objects
    assert isinstance(out.a.child[0], Float8Linear)  # the adapter's own linear converts too
    assert "scratch" in out.a._non_persistent_buffers_set
    # an optimizer built afterwards sees every parameter
    opt = torch.optim.SGD(out.parameters(), lr=0.1)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(BEFORE[0])
    # and back: the plain model has the same names again, without scaling state
    back = convert_back(out)
    assert _names(back) == BEFORE and type(back.a) is nn.Linear and back.a.child is child
    assert not any(k.endswith(("_amax_history", "_static_amax")) for k in back.state_dict())


def test_float8_conversion_of_the_root_keeps_children() -> None:
    lin = Adapted().a
    before = _names(lin)
    out = convert_to_float8(lin, "tensorwise")
    assert isinstance(out, Float8Linear) and _names(out) == before


def test_a_child_named_like_a_float8_attribute_is_refused() -> None:
    lin = nn.Linear(8, 8)
    lin.recipe = nn.Linear(2, 2)  # Float8Linear has a .recipe
    with pytest.raises(ValueError, match=r"child module 'recipe' clashes with an attribute"):
        convert_to_float8(nn.Sequential(lin), "tensorwise")


def test_unit_scaling_and_scalify_keep_every_parameter() -> None:
    u = unit.apply(Adapted(), reinit=True, example_inputs=(torch.randn(2, 16),))
    assert _names(u) == BEFORE
    assert _names(scalify.apply(Adapted(), "fp16")) == BEFORE


@pytest.mark.parametrize("recipe", recipe_names())
def test_prepare_keeps_every_parameter(recipe: str) -> None:
    p = prepare(Adapted(), recipe)
    assert _names(p.model) == BEFORE
