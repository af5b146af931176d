"""``lowprec.unit.functional.linear(matmul=...)``: the product a unit-scaled linear uses,
injected (a float8 layer's GEMM in the unit + float8 recipes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.unit.functional import linear


def _args(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 24, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(12, 24, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(12, generator=g, dtype=torch.float64).requires_grad_()
    return x, w, b


def _run(matmul: object = None, constraint: str | None = "to_output_scale") -> list[Tensor]:
    x, w, b = _args()
    kw = {} if matmul is None else {"matmul": matmul}
    y = linear(x, w, b, constraint=constraint, **kw)  # type: ignore[arg-type]
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=y.dtype)
    y.backward(gy)
    assert x.grad is not None and w.grad is not None and b.grad is not None
    return [y.detach(), x.grad, w.grad, b.grad]


@pytest.mark.parametrize("constraint", ["to_output_scale", None])
def test_injected_plain_product_gives_the_unit_linear(constraint: str | None) -> None:
    """``matmul = F.linear`` (counted) reproduces the default unit linear — output and the
    gradients of x, W and b — in float64 to its rounding (rtol 1e-12: the same products,
    the scales applied at other points)."""
    calls: list[tuple[int, ...]] = []

    def mm(a: Tensor, b: Tensor) -> Tensor:
        calls.append(tuple(a.shape))
        return F.linear(a, b)

    ref = _run(None, constraint)
    got = _run(mm, constraint)
    assert calls == [(3, 5, 24)]
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    # The unit maths against its definition: y = x Wᵀ/√24 + b (forward).
    x, w, b = _args()
    torch.testing.assert_close(got[0], (x @ w.T / 24**0.5 + b).detach(), rtol=1e-12, atol=0)


def test_injected_product_is_what_is_used() -> None:
    """A product that doubles ``x Wᵀ`` doubles the output's product term and the gradients
    that flow through it (x and W), not the bias gradient: the injected matmul is used in
    both passes."""
    ref = _run(None)
    got = _run(lambda a, b: 2 * F.linear(a, b))
    bias_term = _args()[2].detach()
    torch.testing.assert_close(got[0] - bias_term, 2 * (ref[0] - bias_term))
    torch.testing.assert_close(got[1], 2 * ref[1])
    torch.testing.assert_close(got[2], 2 * ref[2])
    torch.testing.assert_close(got[3], ref[3])


def test_bad_matmul() -> None:
    x, w, b = _args()
    with pytest.raises(TypeError, match="matmul must be callable"):
        linear(x, w, b, matmul=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"give a matmul .* or float8=True, not both"):
        linear(x, w, b, float8=True, matmul=F.linear)
