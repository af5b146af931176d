"""The parts of unit-scaling's public API that lowprec.unit now has (issue 38; the table in
docs/unit-scaling.md lists each item and each documented difference): constraints, ops,
modules and arguments, each checked against torch or the rule it states."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lowprec.unit import apply_constraint, scale_bwd, scale_fwd
from lowprec.unit import functional as U
from lowprec.unit import nn as unn


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_more_constraints() -> None:
    assert apply_constraint("amean", 4.0, 1.0, 1.0) == (2.0, 2.0, 2.0)
    assert apply_constraint("to_left_grad_scale", 4.0, 2.0, 1.0) == (2.0, 2.0, 2.0)
    assert apply_constraint("to_right_grad_scale", 4.0, 2.0, 1.0) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="ties a two-operand op's scales"):
        apply_constraint("to_left_grad_scale", 4.0, 2.0)
    # matmul takes them: every scale becomes the left gradient's 1/√N
    a, b = torch.randn(64, 32, generator=_g(0)), torch.randn(32, 16, generator=_g(1))
    y = U.matmul(a, b, constraint="to_left_grad_scale")
    torch.testing.assert_close(y, (a @ b) / math.sqrt(16))


def test_residual_apply_is_split_branch_add() -> None:
    x = torch.randn(8, 16, generator=_g(0)).requires_grad_(True)
    lin = torch.nn.Linear(16, 16)
    y = U.residual_apply(lin, x, 0.2)
    torch.testing.assert_close(y, math.sqrt(0.2) * lin(x) + math.sqrt(0.8) * x)
    y.sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    r, s = U.residual_split(ref, 0.2)
    U.residual_add(lin(r), s, 0.2).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_scale_elementwise() -> None:
    f = U.scale_elementwise(torch.tanh, 2.0, 0.5, constraint=None)
    x = torch.randn(100, generator=_g(0)).requires_grad_(True)
    y = f(x)
    torch.testing.assert_close(y, 2.0 * torch.tanh(x))
    y.sum().backward()
    torch.testing.assert_close(x.grad, 0.5 * (1 - torch.tanh(x.detach()) ** 2))
    g = U.scale_elementwise(torch.tanh, 2.0, 0.5)  # to_output_scale: both 2
    x.grad = None
    g(x).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * (1 - torch.tanh(x.detach()) ** 2))
    with pytest.raises(ValueError, match="output_scale"):
        U.scale_elementwise(torch.tanh, 0.0, 1.0)


def test_mse_loss_true_forward_unit_gradients() -> None:
    x = torch.randn(1 << 16, generator=_g(0)).requires_grad_(True)
    t = torch.randn(1 << 16, generator=_g(1)).requires_grad_(True)
    loss = U.mse_loss(x, t)
    torch.testing.assert_close(loss, F.mse_loss(x, t))
    loss.backward()
    assert x.grad is not None and t.grad is not None
    # Var 2(x - t) = 8 for unit x, t: ±5% (2^16 values, sampling error < 0.5%)
    assert abs(float(x.grad.std()) - 1) < 0.05 and abs(float(t.grad.std()) - 1) < 0.05
    torch.testing.assert_close(U.mse_loss(x, t, "sum"), F.mse_loss(x, t, reduction="sum"))
    with pytest.raises(ValueError, match="shapes must be equal"):
        U.mse_loss(x, t[:5])


@pytest.mark.parametrize("kw", [{}, {"label_smoothing": 0.1}, {"weight": True},
                                {"weight": True, "label_smoothing": 0.3}])  # fmt: skip
def test_cross_entropy_weight_and_label_smoothing(kw: dict[str, object]) -> None:
    v = 10
    x = torch.randn(64, v, generator=_g(0)).requires_grad_(True)
    t = torch.randint(0, v, (64,), generator=_g(1))
    t[:5] = -100
    args = dict(kw)
    if args.get("weight"):
        args["weight"] = torch.rand(v, generator=_g(2)) + 0.5
    ours = U.cross_entropy(x, t, **args)  # type: ignore[arg-type]
    ref = F.cross_entropy(x, t, **args)  # type: ignore[arg-type]
    torch.testing.assert_close(ours, ref)  # the true loss
    (gx,) = torch.autograd.grad(ours, x)
    (rx,) = torch.autograd.grad(F.cross_entropy(x, t, reduction="sum", **args), x)  # type: ignore[arg-type]
    # the gradient: torch's (of the sum: the mean's 1/N is forward-only) times √V/√(1+(e-2)/V)
    torch.testing.assert_close(gx, rx * math.sqrt(v) / math.sqrt(1 + (math.e - 2) / v))
    m = unn.CrossEntropyLoss(
        weight=args.get("weight"), label_smoothing=float(kw.get("label_smoothing", 0.0))
    )  # type: ignore[arg-type]
    torch.testing.assert_close(m(x, t), ref)


def test_refused_arguments_are_value_errors() -> None:
    x = torch.randn(4)
    for call in (
        lambda: U.dropout(x, 0.1, inplace=True),
        lambda: U.silu(x, inplace=True),
        lambda: unn.SiLU(inplace=True),
        lambda: unn.Dropout(0.1, inplace=True),
        lambda: unn.Conv1d(2, 2, 3, padding_mode="reflect"),
    ):
        with pytest.raises(ValueError, match=r"inplace|padding_mode"):
            call()


def test_activation_modules_are_their_functions() -> None:
    x = torch.randn(256, 64, generator=_g(0))
    torch.testing.assert_close(unn.GELU(mult=2.0)(x), U.gelu(x, mult=2.0))
    torch.testing.assert_close(unn.GELU("tanh", constraint=None)(x),
                               U.gelu(x, "tanh", constraint=None))  # fmt: skip
    torch.testing.assert_close(unn.SiLU(mult=0.5)(x), U.silu(x, mult=0.5))
    torch.testing.assert_close(unn.Softmax(0, mult=2.0)(x), U.softmax(x, 0, mult=2.0))
    d = unn.Dropout(0.25).eval()
    assert torch.equal(d(x), x)
    d.train()
    torch.manual_seed(3)
    y = d(x)
    torch.manual_seed(3)
    torch.testing.assert_close(y, F.dropout(x, 0.25) * math.sqrt(0.75))


def test_conv1d_module() -> None:
    torch.manual_seed(0)
    m = unn.Conv1d(8, 16, 3, padding=1)
    x = torch.randn(4, 8, 100, generator=_g(0))
    torch.testing.assert_close(m(x), U.conv1d(x, m.weight, m.bias, 1, 1))
    assert abs(float(m.weight.std()) - 1) < 0.1  # unit init (384 values)


def test_attention_dropout_in_training_only() -> None:
    torch.manual_seed(0)
    layer = unn.TransformerLayer(32, 4, dropout_p=0.5)
    x = torch.randn(2, 16, 32, generator=_g(0))
    layer.eval()
    ref = unn.TransformerLayer(32, 4)
    ref.load_state_dict(layer.state_dict())
    ref.eval()
    torch.testing.assert_close(layer(x), ref(x))  # eval: no dropout
    layer.train()
    ref.train()
    assert not torch.allclose(layer(x), ref(x))  # training: attention dropout applies
    with pytest.raises(ValueError, match="dropout_p must be in"):
        unn.MultiHeadAttention(32, 4, dropout_p=1.0)


def test_scale_primitives_still_compose() -> None:  # scale_fwd / scale_bwd, as unit-scaling's
    x = torch.ones(3, requires_grad=True)
    scale_bwd(scale_fwd(x, 2.0), 3.0).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [3.0, 3.0, 3.0]
