"""Activation checkpointing is numerically transparent for float8 layers with state.

A new user's report: under ``torch.utils.checkpoint`` a delayed-scaling layer's forward,
recomputed in backward, read an ``amax`` history that already held the step's ``amax``
(another scale: the gradients were those of another forward, 0.24-0.39 relative L2 apart
from step 1 on in a Mixtral experts module) and recorded it twice; a stochastically
rounding layer's recomputation drew from the next step's streams. The recomputation now
uses its forward's scales and streams and records nothing (``lowprec.float8.replay``).

Oracle: the same layer run without checkpointing, from the same state. The two compute
the same operations on the same values, so every output, gradient (the input's included)
and scaling buffer must be equal bit for bit. The input's scale changes every step
(×1, ×2, ×4, ×0.5) so that a history read one step late gives another scale.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import lowprec.float8 as f8
from tests import _moe

GROWTH = (1.0, 2.0, 4.0, 0.5)


def _same(a: nn.Module, b: nn.Module) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), n
    for (n, x), y in zip(a.named_buffers(), b.buffers(), strict=True):
        assert torch.equal(x, y), n


def _compare(
    plain: nn.Module,
    make_input: Callable[[torch.Generator, float], tuple[Tensor, ...]],
    reentrant: bool,
    twice: bool = False,
) -> None:
    """``plain`` and its copy run under ``checkpoint`` for len(GROWTH) steps: equal."""
    ckpt = copy.deepcopy(plain)
    gen = torch.Generator().manual_seed(0)

    def run(m: nn.Module, args: tuple[Tensor, ...]) -> Tensor:
        y = m(*args)
        return m(y.tanh(), *args[1:]) if twice else y  # a layer called twice in a step

    for c in GROWTH:
        args = make_input(gen, c)
        xa, xb = args[0].clone().requires_grad_(), args[0].clone().requires_grad_()
        plain.zero_grad(set_to_none=True)
        ckpt.zero_grad(set_to_none=True)
        ya = run(plain, (xa, *args[1:]))
        yb = checkpoint(lambda *a: run(ckpt, a), xb, *args[1:], use_reentrant=reentrant)
        w = torch.randn(ya.shape, generator=gen)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        assert torch.equal(ya, yb)
        assert xa.grad is not None and torch.equal(xa.grad, xb.grad)
        _same(plain, ckpt)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("recipe", ["delayed", "nvfp4-train", "tensorwise"])
def test_linear_layers(recipe: str, reentrant: bool) -> None:
    """``delayed``: input and weight histories; ``nvfp4-train``: stochastic rounding (its
    streams advance each forward); ``tensorwise``: stateless (it always held)."""
    torch.manual_seed(0)
    net = f8.apply(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), recipe)
    _compare(net, lambda g, c: (torch.randn(8, 32, generator=g) * c,), reentrant)


def test_a_layer_called_twice_in_a_step() -> None:
    """Both calls checkpointed: each recomputation gets its own call's scales (last in,
    first out, as backward recomputes them)."""
    torch.manual_seed(0)
    net = f8.apply(nn.Sequential(nn.Linear(32, 32)), "delayed")
    _compare(net, lambda g, c: (torch.randn(8, 32, generator=g) * c,), False, twice=True)


@pytest.mark.parametrize("reentrant", [False, True])
def test_moe_experts_with_delayed_scaling(reentrant: bool) -> None:
    """A Mixtral experts module (3-D expert weights, per-expert histories)."""
    pytest.importorskip("transformers")
    experts = _moe.model("mixtral", layers=1).model.layers[0].mlp.experts
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.2)
    m = f8.Float8Experts(experts, "delayed").train()
    assert m.scaling_buffers()
    idx = torch.randint(0, 4, (16, 2), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(16, 2, generator=torch.Generator().manual_seed(2))
    _compare(m, lambda g, c: (torch.randn(16, 32, generator=g) * c, idx, weights), reentrant)


def test_observed_gemms_under_non_reentrant_checkpointing() -> None:
    """An observed step (``lowprec train``'s GEMM records, ``measure_gemms``) read a saved
    tensor twice in backward, which a non-reentrant checkpoint refuses (CheckpointError:
    unpack triggered for a tensor already unpacked, a new user's trial). Each GEMM is
    observed once, as without checkpointing, and the gradients are the uncheckpointed
    run's."""
    from lowprec.core.observe import CastOperand, observing

    class Count:
        def __init__(self) -> None:
            self.gemms: list[str] = []

        def capture(self) -> Callable[[str, CastOperand, CastOperand], None]:
            return lambda gemm, a, b: self.gemms.append(gemm)

    torch.manual_seed(0)
    plain = f8.apply(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), "delayed")
    ckpt = copy.deepcopy(plain)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    seen = []
    for m, wrap in ((plain, False), (ckpt, True)):
        obs = Count()
        with observing(obs):
            y = checkpoint(m, x, use_reentrant=False) if wrap else m(x)
            y.square().sum().backward()
        seen.append(sorted(obs.gemms))
    assert seen[0] == seen[1] and len(seen[0]) == 5  # 2 layers x 3, less the input's dx
    _same(plain, ckpt)
