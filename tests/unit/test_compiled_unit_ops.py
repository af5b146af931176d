"""The readout of a unit-scaled model with a bias, under ``torch.compile``: its forward hook
(μP's multiplier on ``x Wᵀ``, the bias left alone) gives eager's output and gradients.
Oracle: the eager model. Tolerance: float32 kernels that differ in summation order (rtol
1e-4)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lowprec.unit import UnitConfig, unit_scale


@pytest.mark.slow
def test_compiled_readout_with_a_bias_equals_eager() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    u = unit_scale(net, config=UnitConfig(output_mult=2.0))
    with torch.no_grad():
        u[2].bias.normal_()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))

    def run(m: nn.Module) -> tuple[Tensor, list[Tensor]]:
        u.zero_grad(set_to_none=True)
        y = m(x)
        y.square().sum().backward()
        return y.detach(), [p.grad.clone() for p in u.parameters() if p.grad is not None]

    (ye, ge), (yc, gc) = run(u), run(torch.compile(u))
    torch.testing.assert_close(yc, ye, rtol=1e-4, atol=1e-6)
    assert len(gc) == len(ge) == 4
    for a, b in zip(gc, ge, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
