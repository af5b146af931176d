"""Tests for lowprec.core.tensor: ScaledTensor, quantize_scaled, autograd, compile, save/load."""

from __future__ import annotations

import io
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import lowprec
from lowprec.core.scalers import DelayedScaler, StaticScaler
from lowprec.core.tensor import _RULES, ScaledTensor, quantize_scaled, register_rule

ML = {
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
}


def _ref_scaled(x: np.ndarray, fmt: str, scale: np.ndarray) -> np.ndarray:
    """Independent reference: divide in float32, saturate, round with ml_dtypes, multiply."""
    fmax = float(ml_dtypes.finfo(ML[fmt]).max)
    q = np.clip(x.astype(np.float32) / scale.astype(np.float32), -fmax, fmax)
    return q.astype(ML[fmt]).astype(np.float32) * scale.astype(np.float32)


@pytest.fixture
def x() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=g) * torch.logspace(-2, 2, 256)


def test_is_exported() -> None:
    assert lowprec.ScaledTensor is ScaledTensor
    assert lowprec.quantize_scaled is quantize_scaled


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_tensorwise_equals_reference(x: torch.Tensor, fmt: str) -> None:
    st = quantize_scaled(x, fmt)
    xn = x.numpy()
    scale = np.float32(np.abs(xn).max()) / np.float32(ml_dtypes.finfo(ML[fmt]).max)
    assert st.scale.item() == scale
    assert st.qdata.dtype == getattr(torch, f"float8_{fmt}")
    assert st.shape == x.shape and st.dtype == torch.float32
    # Exact: the same float32 division and a bit-exact rounding on both sides.
    assert np.array_equal(st.dequantize().numpy(), _ref_scaled(xn, fmt, np.array(scale)))


@pytest.mark.parametrize(
    ("gran", "r", "c"), [("row", 1, 256), ("block:1x128", 1, 128), ("block:32x64", 32, 64)]
)
def test_finer_granularities_equal_reference(x: torch.Tensor, gran: str, r: int, c: int) -> None:
    st = quantize_scaled(x, "e4m3fn", granularity=gran)
    xn = x.numpy()
    blocks = np.abs(xn).reshape(64 // r, r, 256 // c, c).max(axis=(1, 3))
    scale = blocks.astype(np.float32) / np.float32(448.0)
    full = np.repeat(np.repeat(scale, r, axis=0), c, axis=1)
    assert np.array_equal(st.dequantize().numpy(), _ref_scaled(xn, "e4m3fn", full))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e2m1", "e3m2"])
def test_mx_equals_ocp_reference(x: torch.Tensor, fmt: str) -> None:
    """OCP MX v1.0: X = floor(log2(amax)) - emax_elem per 32-block, elements saturate."""
    st = quantize_scaled(x, fmt, granularity="mx")
    xn = x.numpy().astype(np.float64)
    emax = {"e4m3fn": 8, "e2m1": 2, "e3m2": 4}[fmt]
    amax = np.abs(xn).reshape(64, 8, 32).max(axis=2)
    scale = np.exp2(np.floor(np.log2(amax)) - emax)
    full = np.repeat(scale, 32, axis=1)
    assert np.array_equal(st.dequantize().numpy(), _ref_scaled(xn, fmt, full))
    assert st.qdata.dtype == (torch.float8_e4m3fn if fmt == "e4m3fn" else torch.bfloat16)


def test_error_bound_and_sqnr(x: torch.Tensor) -> None:
    """Per-tensor e4m3fn on data spanning 4 decades: the large values keep 3 mantissa bits."""
    st = quantize_scaled(x, "e4m3fn", granularity="row")
    err = (st.dequantize() - x).abs()
    # Values in e4m3fn's normal range round with relative error <= 2^-4 (half of 2^-3).
    normal = (x.abs() / st.scale) >= 2.0**-6
    assert bool((err[normal] <= x.abs()[normal] * 2.0**-4).all())


def test_scalers_and_conflicts(x: torch.Tensor) -> None:
    sc = StaticScaler("e4m3fn", scale=0.5)
    st = quantize_scaled(x, "e4m3fn", scaler=sc)
    assert st.scale.item() == 0.5
    assert float(st.qdata.float().abs().max()) == 448.0, "values beyond 448*0.5 saturate"
    d = DelayedScaler("e4m3fn", granularity="row")
    assert quantize_scaled(x, "e4m3fn", scaler=d).scale.shape == (64, 1)
    with pytest.raises(ValueError, match="conflicts with the scaler"):
        quantize_scaled(x, "e4m3fn", granularity="tensor", scaler=d)
    with pytest.raises(ValueError, match="differs from the scaler's format"):
        quantize_scaled(x, "e5m2", scaler=d)


def test_nonfinite_input_keeps_scale_finite() -> None:
    x = torch.tensor([1.0, math.inf, 2.0, math.nan])
    st = quantize_scaled(x, "e5m2")
    assert st.scale.item() == 1.0
    out = st.dequantize()
    assert out[0] == 1.0 and out[1] == math.inf and out[2] == 2.0 and math.isnan(out[3])


def test_constructor_validation() -> None:
    data = torch.ones(4, 8)
    with pytest.raises(TypeError, match="data must be a floating-point"):
        ScaledTensor(torch.ones(4, dtype=torch.int64), 1.0)
    for bad in (0.0, -2.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            ScaledTensor(data, bad)
    with pytest.raises(ValueError, match="not block-broadcastable"):
        ScaledTensor(data, torch.ones(3, 1))
    with pytest.raises(ValueError, match="scale is on meta but data is on cpu"):
        ScaledTensor(data, torch.ones((), device="meta"))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        quantize_scaled(torch.ones(3, dtype=torch.int32), "e4m3fn")
    with pytest.raises(TypeError, match="x must be a floating-point"):
        quantize_scaled(torch.ones(3, dtype=torch.complex64), "e4m3fn")
    with pytest.raises(ValueError, match="fmt: unknown format"):  # the argument is fmt
        quantize_scaled(data, "e4m3x")


def test_block_scale_dequantize_matches_repeat() -> None:
    data = torch.randn(4, 6).to(torch.float8_e5m2)
    scale = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])
    st = ScaledTensor(data, scale)
    full = scale.repeat_interleave(2, 0).repeat_interleave(2, 1)
    assert torch.equal(st.dequantize(), data.float() * full)
    assert st.dequantize(torch.float64).dtype == torch.float64


def test_straight_through_gradient(x: torch.Tensor) -> None:
    xr = x.clone().requires_grad_()
    upstream = torch.randn_like(x)
    quantize_scaled(xr, "e4m3fn", granularity="mx").dequantize().backward(upstream)
    assert xr.grad is not None and torch.equal(xr.grad, upstream)
    leaf = ScaledTensor(torch.ones(3), 2.0, requires_grad=True)
    (leaf.dequantize() * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert leaf.grad is not None and leaf.grad.tolist() == [1.0, 2.0, 3.0]


def test_ops_without_rules_name_the_op(x: torch.Tensor) -> None:
    st = quantize_scaled(x, "e4m3fn")
    with pytest.raises(NotImplementedError, match=r"no rule for aten\.add\.Tensor"):
        st + 1
    with pytest.raises(NotImplementedError, match=r"aten\.mm"):
        st @ x.T


def test_register_rule() -> None:
    neg = torch.ops.aten.neg.default

    @register_rule(neg)
    def _neg(func: object, args: tuple[ScaledTensor, ...], kwargs: dict[str, object]) -> object:
        t = args[0]
        return ScaledTensor(-t.qdata.float(), t.scale, dtype=t.dtype)

    try:
        st = ScaledTensor(torch.tensor([1.0, -3.0]), 0.5)
        assert (-st).dequantize().tolist() == [-0.5, 1.5]
    finally:
        del _RULES[neg]


def test_detach_clone_to(x: torch.Tensor) -> None:
    st = quantize_scaled(x, "e5m2", granularity="row")
    for t in (st.detach(), st.clone(), st.to("cpu")):
        assert isinstance(t, ScaledTensor) and torch.equal(t.dequantize(), st.dequantize())
    b = st.to(torch.bfloat16)
    assert isinstance(b, ScaledTensor) and b.dtype == torch.bfloat16
    assert b.qdata.dtype == torch.float8_e5m2, ".to(dtype) changes the logical dtype only"
    assert torch.equal(b.dequantize(), st.dequantize().bfloat16())
    m = st.to("meta")
    assert m.device.type == "meta" and m.qdata.device.type == "meta"
    assert m.scale.device.type == "meta"


def test_save_load_roundtrip(x: torch.Tensor, tmp_path: Path) -> None:
    st = quantize_scaled(x.bfloat16(), "e4m3fn", granularity="block:1x128")
    path = tmp_path / "st.pt"
    torch.save({"w": st}, path)
    loaded = torch.load(path)  # weights_only=True: the class is registered as safe
    w = loaded["w"]
    assert isinstance(w, ScaledTensor) and w.dtype == torch.bfloat16 and w.fmt == st.fmt
    assert torch.equal(w.qdata.view(torch.uint8), st.qdata.view(torch.uint8))
    assert torch.equal(w.scale, st.scale)
    buf = io.BytesIO()
    torch.save(st, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf).dequantize(), st.dequantize())


def test_stochastic_rounding_reproducible(x: torch.Tensor) -> None:
    def run(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return quantize_scaled(x, "e4m3fn", rounding="stochastic", generator=g).dequantize()

    a, b, c = run(3), run(3), run(4)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.slow
def test_compile_fullgraph(x: torch.Tensor) -> None:
    torch._dynamo.reset()

    def roundtrip(t: torch.Tensor) -> torch.Tensor:
        return quantize_scaled(t, "e4m3fn", granularity="block:1x128").dequantize()

    compiled = torch.compile(roundtrip, fullgraph=True)
    assert torch.equal(compiled(x), roundtrip(x))
    xr = x.clone().requires_grad_()
    compiled(xr).sum().backward()
    assert xr.grad is not None and bool((xr.grad == 1).all())

    st = quantize_scaled(x, "e5m2", granularity="row")
    consume = torch.compile(lambda s: s.dequantize() * 2.0, fullgraph=True)
    assert torch.equal(consume(st), st.dequantize() * 2.0)
    produce = torch.compile(lambda t: quantize_scaled(t, "e4m3fn"), fullgraph=True)
    out = produce(x)
    assert isinstance(out, ScaledTensor)
    ref = quantize_scaled(x, "e4m3fn")
    assert torch.equal(out.qdata.view(torch.uint8), ref.qdata.view(torch.uint8))


def test_domain_rules_and_fallback_apply_to_their_domain_only() -> None:
    from lowprec.core.tensor import _DOMAIN_RULES, _FALLBACKS, register_fallback

    neg = torch.ops.aten.neg.default
    seen: list[str] = []

    @register_rule(neg, domain="test-domain")
    def _neg(func: object, args: tuple[ScaledTensor, ...], kwargs: dict[str, object]) -> object:
        t = args[0]
        return ScaledTensor(-t.qdata, t.scale, dtype=t.dtype, domain=t.domain)

    def _fallback(func: object, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        seen.append(str(func))
        return args[0]

    register_fallback("test-domain", _fallback)
    try:
        st = ScaledTensor(torch.tensor([1.0, -3.0]), 0.5, domain="test-domain")
        assert (-st).dequantize().tolist() == [-0.5, 1.5] and (-st).domain == "test-domain"
        assert torch.abs(st) is st and seen == ["aten.abs.default"]
        plain = ScaledTensor(torch.tensor([1.0]), 0.5)  # no domain: neither applies
        with pytest.raises(NotImplementedError, match=r"aten\.neg"):
            torch.neg(plain)
        assert st.detach().domain == "test-domain"  # shared rules keep the domain
    finally:
        del _DOMAIN_RULES["test-domain"]
        del _FALLBACKS["test-domain"]


def test_wrapper_has_the_data_strides() -> None:
    data = torch.randn(4, 6).t()
    st = ScaledTensor(data, 2.0)
    assert st.stride() == data.stride() and not st.is_contiguous()


def test_unpadded_shape_crops_and_granularity_is_kept() -> None:
    """A zero-padded payload stands for the smaller tensor: dequantize crops, the gradient
    is zero-padded back, metadata survives detach/clone/.to."""
    from lowprec.core.granularity import Granularity

    g = Granularity.blocks(1, 4)
    data = torch.arange(8.0).reshape(2, 4)
    st = ScaledTensor(data, torch.full((2, 1), 2.0), granularity=g, unpadded_shape=(2, 3))
    assert st.unpadded_shape == (2, 3) and st.granularity == g
    assert st.dequantize().tolist() == [[0.0, 2.0, 4.0], [8.0, 10.0, 12.0]]
    for t in (st.detach(), st.clone(), st.to(torch.float64)):
        assert isinstance(t, ScaledTensor) and t.unpadded_shape == (2, 3) and t.granularity == g
    with pytest.raises(ValueError, match="unpadded_shape"):
        ScaledTensor(data, 1.0, unpadded_shape=(3, 3))
    # Gradient of the cropped view: zero-padded back to the payload's shape.
    ctx = type("Ctx", (), {"padded": (2, 4)})()
    g, _ = ScaledTensor.dequantize.__globals__["_Dequantize"].backward(ctx, torch.ones(2, 3))
    assert g.tolist() == [[1.0, 1.0, 1.0, 0.0]] * 2


def test_clone_with_memory_format_applies_to_the_data() -> None:
    x = quantize_scaled(torch.randn(2, 3, 4, 5), "e4m3fn")
    y = x.clone(memory_format=torch.channels_last)
    assert y.qdata.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y.dequantize(), x.dequantize())


def test_load_state_dict_into_a_scaled_tensor_buffer() -> None:
    m = torch.nn.Module()
    m.register_buffer("b", quantize_scaled(torch.randn(4, 4), "e4m3fn", granularity="row"))
    src = quantize_scaled(torch.randn(4, 4) * 7, "e4m3fn", granularity="row")
    m.load_state_dict({"b": src})
    assert torch.equal(m.b.dequantize(), src.dequantize())
    with pytest.raises(RuntimeError, match="does not match the destination"):
        m.load_state_dict({"b": quantize_scaled(torch.randn(4, 4), "e5m2", granularity="row")})
    with pytest.raises(RuntimeError, match="a plain tensor cannot be copied into a ScaledTensor"):
        m.load_state_dict({"b": torch.randn(4, 4)})
