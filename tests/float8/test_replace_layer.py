"""replace_layer: one layer's float8 config changed in place, its parameters kept.

Oracle: a layer converted from scratch with ``Float8Linear.from_linear`` and the same
config gives bit-identical outputs and gradients; back to high precision, ``F.linear``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec.float8 import Float8Config, Float8Linear, apply
from lowprec.float8.convert import replace_layer
from lowprec.unit.functional import linear as unit_linear


def test_replace_keeps_parameters_and_computes_as_a_fresh_layer() -> None:
    torch.manual_seed(0)
    m = apply(nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8)), "naive")
    w = m[0].weight
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    new = replace_layer(m, "0", Float8Config.from_name("rowwise"))
    assert m[0] is new and new.weight is w and new.recipe.name == "rowwise"
    x = torch.randn(4, 32, requires_grad=True)
    ref = Float8Linear.from_linear(nn.Linear(32, 16), "rowwise")
    ref.weight, ref.bias = nn.Parameter(w.detach().clone()), nn.Parameter(new.bias.detach().clone())
    xr = x.detach().clone().requires_grad_()
    y, yr = new(x), ref(xr)
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    y.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    torch.testing.assert_close(new.weight.grad, ref.weight.grad, rtol=0, atol=0)
    opt.step()  # the optimizer still holds the layer's parameters
    assert not torch.equal(new.weight.detach(), ref.weight.detach())
    plain = replace_layer(m, "0", None)
    assert type(plain) is nn.Linear and plain.weight is w
    torch.testing.assert_close(plain(x), F.linear(x, w, plain.bias), rtol=0, atol=0)


def test_a_unit_scaled_layer_keeps_its_maths_in_high_precision() -> None:
    m = apply(nn.Sequential(nn.Linear(32, 16)), "tensorwise")
    m[0].linear_fn = unit_linear
    hp = replace_layer(m, "0", None)
    assert isinstance(hp, Float8Linear) and hp.linear_fn is unit_linear
    assert set(hp.recipe.high_precision_gemms) == {"forward", "input_grad", "weight_grad"}
    x = torch.randn(4, 32)
    torch.testing.assert_close(hp(x), unit_linear(x, hp.weight, hp.bias), rtol=1e-6, atol=1e-6)


def test_bad_arguments() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="fqn: '1' is not a linear layer"):
        replace_layer(m, "1", None)
    with pytest.raises(ValueError, match=r"fqn: 'x\.y'"):
        replace_layer(m, "x.y", None)
    with pytest.raises(TypeError, match="config must be a Float8Config"):
        replace_layer(m, "0", "rowwise")  # type: ignore[arg-type]
