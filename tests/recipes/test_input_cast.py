"""A prepared BF16/FP16 model takes FP32 inputs: ``prepare`` casts its floating-point
inputs to the recipe's parameter dtype, as FSDP2's mixed precision does under
``lowprec.distributed``. A user's report: ``prepare(mlp, "bf16")(torch.randn(8, 16))``
failed inside ``F.linear`` ("mat1 and mat2 must have the same dtype") on one process,
where the same recipe under FSDP2 ran.

Oracle: the same prepared model called with the inputs cast by hand (bit for bit)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lowprec.recipes import prepare
from lowprec.recipes.compose import CastInputs


class _Net(nn.Module):
    """Floating inputs in a tuple and a dict kwarg, an integer one, an optional scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)
        self.emb = nn.Embedding(10, 32)

    def forward(self, x: Tensor, pair: tuple[Tensor, Tensor], *, ids: Tensor,
                extra: dict[str, Any] | None = None) -> Tensor:  # fmt: skip
        h = self.a(x) + self.a(pair[0]) * pair[1] + self.emb(ids)
        if extra is not None:
            h = h * extra["gain"]
        return self.b(torch.relu(h))


def _inputs(dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    x, y, z = (torch.randn(8, 16 if i < 2 else 32, generator=g) for i in range(3))
    gain = torch.rand(8, 32, generator=g) + 0.5
    ids = torch.randint(0, 10, (8,), generator=g)
    args = (x.to(dtype), (y.to(dtype), z.to(dtype)))
    return args, {"ids": ids, "extra": {"gain": gain.to(dtype), "note": "kept"}}


@pytest.mark.parametrize(
    ("recipe", "dtype"),
    [("bf16", torch.bfloat16), ("fp16-dynamic-ls", torch.float16),
     ("fp8-tensorwise", torch.bfloat16), ("bf16-unit", torch.bfloat16)],
)  # fmt: skip
def test_fp32_inputs_are_cast_to_the_parameter_dtype(recipe: str, dtype: torch.dtype) -> None:
    p = prepare(_Net(), recipe)
    args, kwargs = _inputs(torch.float32)
    y = p.model(*args, **kwargs)
    assert y.dtype == dtype
    args_c, kwargs_c = _inputs(dtype)
    assert torch.equal(y, p.model(*args_c, **kwargs_c))
    assert kwargs["ids"].dtype == torch.int64  # the caller's tensors are not changed
    assert args[0].dtype == torch.float32
    y.float().square().mean().backward()  # the gradients flow through the cast
    assert all(q.grad is not None for q in p.model.parameters() if q.requires_grad)


def test_no_cast_for_fp32_and_scalify() -> None:
    """FP32 needs none; scalify scales its FP32 inputs into FP16 itself (a cast first would
    flush or overflow them); and the hook keeps the prepared model picklable."""
    for recipe in ("fp32", "fp16-scalify"):
        m = prepare(_Net(), recipe).model
        assert not any(isinstance(h, CastInputs) for h in m._forward_pre_hooks.values())
    m = prepare(_Net(), "bf16").model
    assert any(isinstance(h, CastInputs) for h in m._forward_pre_hooks.values())
    pickle.loads(pickle.dumps(m))
    big = torch.full((1, 16), 1e6)  # beyond FP16's range: scalify takes it as it is
    s = prepare(nn.Linear(16, 4), "fp16-scalify").model
    assert torch.isfinite(s(big)).all()
