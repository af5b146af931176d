"""Float8 GEMM operands are core ScaledTensors (no float8 Operand type)."""

from __future__ import annotations

import pytest
import torch

import lowprec.float8
from lowprec.core.granularity import Granularity
from lowprec.core.tensor import ScaledTensor
from lowprec.float8 import CastConfig, dequantize, quantize_operand, scaled_mm


def test_no_operand_type() -> None:
    assert not hasattr(lowprec.float8, "Operand") and "Operand" not in lowprec.float8.__all__
    assert not hasattr(lowprec.float8.quant, "Operand")


@pytest.mark.parametrize("cd", [0, 1])
def test_block_operand_records_granularity_and_padding(cd: int) -> None:
    t = torch.randn(40, 300, generator=torch.Generator().manual_seed(1))
    op = quantize_operand(t, CastConfig(granularity="block:1x128"), cd)
    assert isinstance(op, ScaledTensor) and op.dtype == torch.float32
    assert op.granularity == Granularity.blocks(1, 128, axis=cd)
    assert op.unpadded_shape == (40, 300)
    assert tuple(op.qdata.shape) == ((40, 384) if cd == 1 else (128, 300))
    # The core dequantize crops the padding: it equals float8's (same float32 products).
    torch.testing.assert_close(op.dequantize(), dequantize(op), rtol=0, atol=0)
    assert op.dequantize().shape == t.shape
    tensor_op = quantize_operand(t, CastConfig(), cd)
    assert tensor_op.granularity == Granularity.tensor() and tensor_op.unpadded_shape == (40, 300)


def test_scaled_mm_refuses_scales_along_the_wrong_dim() -> None:
    t = torch.randn(32, 64)
    a_wrong = quantize_operand(t, CastConfig(granularity="axis"), 0)  # scales along dim 0
    b = quantize_operand(torch.randn(64, 16), CastConfig(granularity="axis"), 0)
    with pytest.raises(
        ValueError,
        match="a: quantized for contraction over dim 0, but a is contracted over dim 1",
    ):
        scaled_mm(a_wrong, b)
    a = quantize_operand(t, CastConfig(granularity="axis"), 1)
    want = a.dequantize().double() @ b.dequantize().double()
    torch.testing.assert_close(scaled_mm(a, b).double(), want, rtol=1e-6, atol=1e-6)
