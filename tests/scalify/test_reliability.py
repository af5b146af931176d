"""Issue 14, defects 6 and 7 in scalify: no NaN from rescaling zeros, no silent ±inf
payloads, no silent complex/integer arithmetic."""

from __future__ import annotations

import pytest
import torch

from lowprec.scalify import as_scaled, dynamic_rescale, rebalance, scaled, scalify, unscale


@pytest.mark.parametrize("how", ["max", "l1", "l2"])
@pytest.mark.parametrize("make", ["known_zero", "zero_data", "empty"])
def test_dynamic_rescale_of_zeros_is_zeros(how: str, make: str) -> None:
    x = {
        "known_zero": lambda: as_scaled(torch.zeros(3)),  # the special scale 0
        "zero_data": lambda: scaled(torch.zeros(3, dtype=torch.float16), 4.0),
        "empty": lambda: scaled(torch.zeros(0, dtype=torch.float16), 4.0),
    }[make]()
    y = dynamic_rescale(x, how)  # type: ignore[arg-type]
    assert torch.equal(y.dequantize(), x.dequantize()), "the value is unchanged (zeros)"
    assert torch.equal(y.scale, x.scale), "documented: an all-zero x keeps its scale"
    z = rebalance(y, 2.0)
    assert not torch.isnan(z.dequantize()).any()


def test_dynamic_rescale_grad_of_zero_gradient_is_zero() -> None:
    x = torch.ones(3, requires_grad=True)
    t = dynamic_rescale(as_scaled(x), "l2", grad=True)
    (unscale(t) * 0.0).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros(3))


def test_dynamic_rescale_refuses_nan_data() -> None:
    with pytest.raises(ValueError, match="statistic"):
        dynamic_rescale(scaled(torch.tensor([1.0, float("nan")]), 1.0))


def test_as_scaled_refuses_a_scale_that_overflows_the_payload() -> None:
    x = torch.tensor([1.0, -2.0])
    with pytest.raises(ValueError, match=r"scale: .* too small for x"):
        as_scaled(x, 1e-6)  # 2/1e-6 = 2e6 > FP16's 65504
    # a scale just large enough is accepted and exact; NaN/Inf entries stay visible
    t = as_scaled(x, 2.0 / 65504)
    assert torch.isfinite(t.qdata).all() and torch.allclose(t.dequantize(), x, rtol=2**-10)
    y = as_scaled(torch.tensor([1.0, float("inf"), float("nan")]), 1.0)
    assert y.qdata[0] == 1 and y.qdata[1] == float("inf") and y.qdata[2].isnan()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_scalify_refuses_complex_inputs(dtype: torch.dtype) -> None:
    lin = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"args\[0\]: complex"):
        scalify(lin)(torch.ones(3, 4, dtype=dtype))
    with pytest.raises(TypeError, match=r"kwargs\['b'\]: complex"):
        scalify(lambda a, b: a + b)(torch.ones(2), b=torch.ones(2, dtype=dtype))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        as_scaled(torch.ones(2, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_scalify_refuses_integer_matmul_operands(dtype: torch.dtype) -> None:
    lin = torch.nn.Linear(4, 2)
    with pytest.raises(RuntimeError):  # what torch itself does
        lin(torch.ones(3, 4, dtype=dtype))
    with pytest.raises(TypeError, match="floating-point operands"):
        scalify(lin)(torch.ones(3, 4, dtype=dtype))


def test_scalify_passes_integer_indices_through() -> None:
    emb = torch.nn.Embedding(5, 3)
    idx = torch.tensor([0, 4, 2])
    assert torch.allclose(scalify(emb)(idx), emb(idx), rtol=2**-10)
