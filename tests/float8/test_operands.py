"""Float8 GEMM operands are core ScaledTensors (no float8 Operand type)."""

from __future__ import annotations

import math

import pytest
import torch

import lowprec.float8
from lowprec.core.formats import get_format
from lowprec.core.granularity import Granularity
from lowprec.core.tensor import ScaledTensor
from lowprec.float8 import CastConfig, dequantize, quantize_operand, scaled_mm
from lowprec.float8.quant import dequantize_parts, quantize_parts


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


def _specials(t: torch.Tensor) -> torch.Tensor:
    """``t`` with Inf, -Inf, NaN, zeros of both signs, huge, tiny and subnormal values."""
    t = t.clone()
    flat = t.view(-1)
    vals = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3e38, -1e-40, 1e-30, 7.0]
    for i, v in enumerate(vals):
        flat[i * 37] = v
    return t


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN matches any NaN (payloads may differ)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ai = a.float().masked_fill(nan, 0).view(torch.int32)
    bi = b.float().masked_fill(nan, 0).view(torch.int32)
    return torch.equal(ai, bi)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "granularity", "cd", "given", "in_dtype", "out_dtype"),
    [
        ("e4m3fn", "tensor", 1, False, torch.float32, torch.float32),
        ("e4m3fn", "tensor", 0, True, torch.float32, torch.float32),  # given scale: overflow
        ("e5m2", "tensor", 1, True, torch.float32, torch.bfloat16),
        ("e5m2", "tensor", 0, False, torch.bfloat16, torch.float32),
        ("e4m3fn", "axis", 1, False, torch.float32, torch.float32),
        ("e4m3fn", "axis", 0, False, torch.float16, torch.bfloat16),
        ("e5m2", "axis", 1, False, torch.float32, torch.float32),
    ],
)
def test_traced_payload_values_are_the_casts(
    fmt: str,
    granularity: str,
    cd: int,
    given: bool,
    in_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> None:
    """Under torch.compile a tensor- or axis-scaled operand's payload values come from bit
    arithmetic (round_bits), not from the float8 cast and back: the same values and scale
    as eager ``quantize_parts`` upcast, for ordinary values and for Inf, NaN, ±0,
    subnormals, values that overflow a given scale (saturate; Inf becomes NaN in e4m3fn)."""
    from lowprec.core.upcast import upcast
    from lowprec.float8.quant import quantize_parts, quantize_values

    torch._dynamo.reset()
    cast = CastConfig(fmt, granularity=granularity)
    t = _specials(torch.randn(48, 80, generator=torch.Generator().manual_seed(3)) * 50)
    t = t.to(in_dtype)
    scale = torch.tensor(1e-3) if given else None  # 50·N(0,1) / 1e-3 overflows both formats

    def traced(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = quantize_values(x, cast, cd, out_dtype, scale)
        assert out is not None
        return out

    values, s = torch.compile(traced, fullgraph=True)(t)
    data, s_ref, _ = quantize_parts(t, cast, cd, scale)
    ref = upcast(data, out_dtype)
    assert values.dtype == out_dtype and values.shape == ref.shape
    assert _same_values(values, ref)
    assert torch.equal(s, s_ref)
    assert bool(ref.isnan().any())  # the specials were exercised
    if given:  # and the saturation of a quotient beyond the format's range
        assert bool((ref.abs() == get_format(fmt).max).any())


@pytest.mark.slow
@pytest.mark.parametrize("granularity", ["block:1x128", "block:128x128"])
@pytest.mark.parametrize("cd", [0, 1])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200)])  # whole blocks; padded
def test_traced_block_cast_of_a_transpose_is_the_eager_one(
    granularity: str, cd: int, shape: tuple[int, int]
) -> None:
    """Compiled, a block-scaled cast of a transposed matrix (``W.t()``, ``g.t()``) is
    computed on the contiguous matrix and transposed back: payload, scale, unpadded shape
    and the dequantized values equal eager's bit for bit (zero padding included)."""
    from lowprec.float8.quant import dequantize_parts, quantize_parts

    torch._dynamo.reset()
    cast = CastConfig("e4m3fn", granularity=granularity)
    w = _specials(torch.randn(*shape, generator=torch.Generator().manual_seed(5)))

    def both(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        data, s, pad = quantize_parts(m.t(), cast, cd)
        return data, s, dequantize_parts(data, s, pad, torch.float32)

    got = torch.compile(both, fullgraph=True)(w)
    data, s, pad = quantize_parts(w.t(), cast, cd)
    want = (data, s, dequantize_parts(data, s, pad, torch.float32))
    assert got[0].shape == want[0].shape and torch.equal(
        got[0].view(torch.uint8), want[0].view(torch.uint8)
    )
    assert torch.equal(got[1], want[1])
    assert got[2].shape == w.t().shape and _same_values(got[2], want[2])
    # computed in the contiguous matrix's layout (the point of the transposition): the
    # transposed matrix's dim 0 is the storage's unit-stride dim (a crop keeps it)
    assert got[0].stride(0) == 1 and got[2].stride(0) == 1


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e2m1"])
@pytest.mark.parametrize("gran", ["tensor", "axis", "block:1x32", "mx:32", "nv:16"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_values_never_become_finite_and_both_paths_agree(
    fmt: str, gran: str, bad: float
) -> None:
    # The scaled-cast rule (lowprec.core.scales.nonfinite_scale, docs/formats.md): a block
    # holding Inf/NaN reads NaN where it cannot carry the value (MX/NV blocks, formats
    # without Inf and NaN codes); elsewhere ±Inf stays ±Inf (E5M2) or becomes NaN (E4M3FN).
    # quantize_scaled and the float8 operand path give the same scales and values.
    from lowprec import quantize_scaled

    if gran == "nv:16" and fmt != "e2m1":
        pytest.skip("NVFP4 blocks are E2M1")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[1, 5] = bad
    d, s, pad = quantize_parts(x, CastConfig(fmt, granularity=gran), 1)
    ours = dequantize_parts(d, s, pad, torch.float32)
    qs = quantize_scaled(x, fmt, granularity=gran)
    assert torch.equal(s.isnan(), qs.scale.isnan()) and torch.equal(
        s.nan_to_num(0.0), qs.scale.nan_to_num(0.0)
    )
    assert torch.equal(ours.isnan(), qs.dequantize().isnan())
    assert not torch.isfinite(ours[1, 5])  # never turned into a finite value
    block = gran in ("mx:32", "nv:16") or fmt == "e2m1"
    if block:  # the whole group of the bad value reads NaN, the others stay finite
        width = {"tensor": 64, "axis": 64, "block:1x32": 32, "mx:32": 32, "nv:16": 16}[gran]
        group = ours if gran == "tensor" else ours[1, :width]
        assert bool(group.isnan().all())
        if gran != "tensor":
            assert bool(torch.isfinite(ours[0]).all())
    else:  # only the bad value itself is non-finite
        assert int((~torch.isfinite(ours)).sum()) == 1
        want = bad if (fmt == "e5m2" and not math.isnan(bad)) else None
        if want is None:
            assert math.isnan(float(ours[1, 5]))
        else:
            assert float(ours[1, 5]) == want
