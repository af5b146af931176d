"""Tests for lowprec.core.casts: straight-through casts against lowprec.core.rounding.quantize."""

from __future__ import annotations

import pytest
import torch

from lowprec.core.casts import quantize_grad, quantize_ste
from lowprec.core.rounding import quantize

FORMATS = ["e4m3fn", "e5m2", "fp16", "bf16", "e2m1"]


def _data(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Spans far beyond every format's range so saturation is exercised.
    return torch.randn(512, generator=g) * 10.0 ** torch.randint(-6, 7, (512,), generator=g)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("saturate", [True, False])
def test_quantize_ste_forward_rounds_backward_identity(fmt: str, saturate: bool) -> None:
    x = _data(0).requires_grad_(True)
    w = _data(1)
    y = quantize_ste(x, fmt, saturate=saturate)
    # Forward: bit-identical to quantize (same function, same arguments).
    want = quantize(x.detach(), fmt, saturate=saturate)
    assert bool(((y.detach() == want) | (y.detach().isnan() & want.isnan())).all())
    (y * w).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, w), "backward is exactly the identity"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("saturate", [True, False])
def test_quantize_grad_forward_identity_backward_rounds(fmt: str, saturate: bool) -> None:
    x = _data(2).requires_grad_(True)
    w = _data(3)
    y = quantize_grad(x, fmt, saturate=saturate)
    assert torch.equal(y.detach(), x.detach()), "forward is exactly the identity"
    (y * w).sum().backward()
    want = quantize(w, fmt, saturate=saturate)
    assert x.grad is not None
    assert bool(((x.grad == want) | (x.grad.isnan() & want.isnan())).all())


def test_saturating_default_and_bad_input() -> None:
    x = torch.tensor([1e6, -1e6], requires_grad=True)
    assert quantize_ste(x).tolist() == [448.0, -448.0], "default: E4M3, saturating"
    y = quantize_grad(x)
    y.backward(torch.tensor([1e6, 1.0]))
    assert x.grad is not None and x.grad.tolist() == [57344.0, 1.0], "default: E5M2"
    with pytest.raises(TypeError, match="x must be"):
        quantize_ste([1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="saturate must be"):
        quantize_grad(x, saturate=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp7"):
        quantize_ste(x, "fp7")
