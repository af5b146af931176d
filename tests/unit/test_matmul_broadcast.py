"""``lowprec.unit.functional.matmul`` with broadcast batch dims (found by a new user's
trial): a ``(M, K)`` operand against a batch of ``B`` right operands had both gradients
``√B`` too large with ``constraint=None`` (rms 2.8 at B = 8, 5.6 at 32), and a parameter
used as ``self.mix @ x`` in a converted model got a gradient that grew with the batch
(rms 1.03 at batch 4, 4.34 at 64; under gradient accumulation 0.5× the one-batch one).

Each gradient is checked against the plain autograd gradient of ``a @ b`` (FP64): it must
be that gradient times one constant (the rule's scale), and the scales are the counts of
summed terms the docstring states, so for unit inputs and a unit incoming gradient every
rms is 1 within sampling (±10%: at least 16k elements a tensor)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from lowprec.unit import functional as U
from lowprec.unit import unit_scale

M, K, N = 64, 128, 48


def _rms(t: Tensor) -> float:
    return float(t.double().square().mean().sqrt())


def _grads(a: Tensor, b: Tensor, g: Tensor, **kw: object) -> tuple[Tensor, Tensor, Tensor]:
    y = U.matmul(a, b, **kw)  # type: ignore[arg-type]
    ga, gb = torch.autograd.grad(y, (a, b), g)
    return y, ga, gb


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("constraint", [None, "to_output_scale"])
@pytest.mark.parametrize("form", ["weight", "expanded-weight", "activation"])
def test_a_broadcast_left_operand(batch: int, constraint: str | None, form: str) -> None:
    gen = torch.Generator().manual_seed(batch)
    a0 = nn.Parameter(torch.randn(M, K, generator=gen, dtype=torch.float64))
    b0 = torch.randn(batch, K, N, generator=gen, dtype=torch.float64, requires_grad=True)
    b = b0 * 1.0  # an activation
    g = torch.randn(batch, M, N, generator=gen, dtype=torch.float64)
    a = {"weight": a0, "expanded-weight": a0.expand(batch, M, K), "activation": a0 * 1.0}[form]
    y, ga, gb = _grads(a, b, g, constraint=constraint)
    ta, tb = torch.autograd.grad(a @ b, (a, b), g)  # the true gradients
    s_out = K**-0.5
    torch.testing.assert_close(y, (a @ b) * s_out)
    n_eff, m_eff = N * batch, M  # terms each element of ∂a, of ∂b sums
    if form == "activation" and constraint == "to_output_scale":
        want_a, want_b = s_out, s_out  # tied: the exact gradient of the scaled forward
    else:
        want_a, want_b = n_eff**-0.5, (m_eff**-0.5 if constraint is None else s_out)
    torch.testing.assert_close(ga, ta * want_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gb, tb * want_b, rtol=1e-12, atol=1e-12)
    if form != "activation":  # a weight's gradient: unit whatever the batch
        assert 0.9 < _rms(ga if form == "weight" else torch.autograd.grad(a, a0, ga)[0]) < 1.1


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(16, 16))
        self.fc, self.head = nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.fc(self.mix @ x))


def test_a_mixing_parameter_under_gradient_accumulation() -> None:
    """k = 4 micro-batches, each unit loss divided by √k (docs/unit-scaling.md), give the
    one-batch gradient for every parameter, the token-mixing one included (0.5× before),
    and its gradient does not grow with the batch."""
    torch.manual_seed(0)
    u = unit_scale(_Mixer())
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(32, 16, 32, generator=g), torch.randint(0, 10, (32, 16), generator=g)

    def grads(k: int) -> dict[str, Tensor]:
        u.zero_grad()
        for xc, tc in zip(x.chunk(k), t.chunk(k), strict=True):
            (U.cross_entropy(u(xc).flatten(0, 1), tc.flatten()) / math.sqrt(k)).backward()
        return {n: p.grad.clone() for n, p in u.named_parameters() if p.grad is not None}

    one, acc = grads(1), grads(4)
    for name, g1 in one.items():
        torch.testing.assert_close(acc[name], g1, rtol=1e-4, atol=1e-6)
    small = {}
    for b in (4, 32):
        u.zero_grad()
        U.cross_entropy(u(x[:b]).flatten(0, 1), t[:b].flatten()).backward()
        small[b] = _rms(u.mix.grad)
    assert 0.8 < small[32] / small[4] < 1.25, small  # (was 2.8 = √8 before)
