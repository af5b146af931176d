"""Unit-scaled models under ``torch.compile``: the readout with a bias (its forward hook:
μP's multiplier on ``x Wᵀ``, the bias left alone) and unit ops called in the model's own
forward give eager's output and gradients. Oracle: the eager model. Tolerance: float32
kernels that differ in summation order (rtol 1e-4)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lowprec.unit import UnitConfig, unit_scale
from lowprec.unit import functional as U


def _run(u: nn.Module, m: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``m`` (``u`` or its compiled form) on ``x``: the output, then the gradients of
    ``Σ y²`` for the input and each of ``u``'s parameters that gets one."""
    u.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = m(x)
    y.square().sum().backward()
    assert x.grad is not None
    grads = [p.grad.clone() for p in u.parameters() if p.grad is not None]
    return y.detach(), [x.grad, *grads]


def _assert_compiled_equals_eager(u: nn.Module, x: Tensor, n_params: int) -> None:
    (ye, ge), (yc, gc) = _run(u, u, x), _run(u, torch.compile(u), x)
    torch.testing.assert_close(yc, ye, rtol=1e-4, atol=1e-6)
    assert len(gc) == len(ge) == 1 + n_params  # the input's and every parameter's
    for a, b in zip(gc, ge, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_compiled_readout_with_a_bias_equals_eager() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    u = unit_scale(net, config=UnitConfig(output_mult=2.0))
    with torch.no_grad():
        u[2].bias.normal_()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    _assert_compiled_equals_eager(u, x, n_params=4)


class _Explicit(nn.Module):
    """A forward that calls unit ops itself (``U.linear``, ``U.gelu``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.w = nn.Linear(64, 64), nn.Parameter(torch.randn(10, 64))
        self.head = nn.Linear(10, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(U.gelu(U.linear(self.a(x), self.w)))


@pytest.mark.slow
def test_compiled_equals_eager_with_unit_ops_in_the_forward() -> None:
    """Dynamo does not dispatch a Python function to the unit mode: a unit op called in the
    forward had its products converted a second time, scaled by ``1/√K`` twice (the output
    8 times too small at K = 64); its body now runs with the mode passing ops through."""
    torch.manual_seed(0)
    u = unit_scale(_Explicit())
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    _assert_compiled_equals_eager(u, x, n_params=5)
