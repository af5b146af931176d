"""unit_scale on layer forms met in HF architectures: an embedding subclass that scales
its lookup by a constant (Gemma), an ``nn.Linear`` subclass with its own forward (Falcon),
and in-place arithmetic on a unit op's output (Falcon's ``mlp_output += attention_output``).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from lowprec.unit import unit_scale
from lowprec.unit.convert import convert_modules


class ScaledEmbedding(nn.Embedding):
    """Gemma's ``GemmaScaledWordEmbedding``: the lookup times a constant buffer."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__(n, d)
        self.register_buffer("scale", torch.tensor(d**0.5), persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * self.scale


class PositionScaledEmbedding(nn.Embedding):
    """Not a constant factor: each position's row scaled differently."""

    def forward(self, ids: Tensor) -> Tensor:
        out = super().forward(ids)
        return out * torch.arange(1, ids.shape[-1] + 1, dtype=out.dtype)[:, None]


class OwnLinear(nn.Linear):
    """Falcon's ``FalconLinear``."""

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


def test_scaled_embedding_becomes_the_plain_lookup() -> None:
    m = nn.ModuleDict({"emb": ScaledEmbedding(10, 16), "pos": PositionScaledEmbedding(10, 16),
                       "lin": OwnLinear(16, 4)})  # fmt: skip
    converted, left = convert_modules(m)
    assert converted == ["emb (ScaledEmbedding: embedding, scale 4 dropped)",
                         "lin (OwnLinear: linear)"]  # fmt: skip
    assert left == [] and type(m["pos"]) is PositionScaledEmbedding
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(m["emb"](ids), m["emb"].weight[ids])  # the factor 4 = √16 is dropped
    x = torch.randn(3, 16)
    torch.testing.assert_close(m["lin"](x), nn.functional.linear(x, m["lin"].weight, m["lin"].bias))


class _Branches(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
        self.in_place = in_place  # no bias: the unit linear returns its scaled view

    def forward(self, x: Tensor) -> Tensor:
        if bool(x.isnan().any()):  # data-dependent control flow: torch.fx cannot trace it
            raise ValueError("x: NaN")
        y = self.a(x)
        if self.in_place:
            y += self.b(x)  # on a unit linear's output: a view made by a custom Function
            y *= 0.5
            return y
        return (y + self.b(x)) * 0.5


def test_in_place_arithmetic_on_unit_outputs() -> None:
    """``y += z`` on a unit op's output computes what ``y = y + z`` does: same output and
    the same gradients (autograd alone raises: an in-place change of a custom Function's
    view output)."""
    torch.manual_seed(0)
    ref = _Branches(in_place=False)
    got = copy.deepcopy(ref)
    got.in_place = True
    x = torch.randn(4, 16)
    torch.manual_seed(1)  # the same unit-variance re-initialisation for both
    uref = unit_scale(ref, reinit=True, example_inputs=(x,))
    torch.manual_seed(1)
    ugot = unit_scale(got, reinit=True, example_inputs=(x,))
    out_ref, out_got = uref(x), ugot(x)
    torch.testing.assert_close(out_got, out_ref, rtol=0, atol=0)
    out_ref.square().sum().backward()
    out_got.square().sum().backward()
    for p, q in zip(ugot.parameters(), uref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
