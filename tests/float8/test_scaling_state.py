"""Float8Linear's delayed/static scaling runs on the core scalers, with their state in the
module's buffers: state_dict round trips, rebinding after ``.to()``, reducible tensors."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from lowprec.core.scalers import DelayedScaler, StaticScaler
from lowprec.float8 import Float8Linear, calibrate, convert_to_float8


def _mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(seed)) * 4


def _step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    y = m(x)
    opt.zero_grad()
    y.pow(2).mean().backward()
    opt.step()
    return y.detach()


def _scales(m: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The scale each delayed/static scaler would give ``x`` now (recording nothing)."""
    out = []
    for mod in m.modules():
        if isinstance(mod, Float8Linear):
            t = x.new_ones(8, mod.in_features)
            for role in ("input", "weight", "grad_output"):
                sc = mod.scaler(role)
                if sc is not None:
                    out.append(sc(t, update=False).clone())
    return out


@pytest.mark.parametrize("name", ["delayed", "static"])
def test_state_dict_round_trip_gives_identical_next_step(name: str) -> None:
    """Save after some steps, load into a freshly converted model: the next step has the
    same outputs, gradients, scales and buffers, bit for bit."""
    m = convert_to_float8(_mlp(), name)
    if name == "static":
        with calibrate(m):
            for s in range(3):
                m(_batch(s)).pow(2).mean().backward()
        m.zero_grad()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    for s in range(4):
        _step(m, opt, _batch(10 + s))
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    fresh = convert_to_float8(_mlp(), name)
    assert fresh[0].needs_calibration == (name == "static")
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert not fresh[0].needs_calibration
    x = _batch(99)
    for a, b in zip(_scales(m, x), _scales(fresh, x), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt2 = torch.optim.SGD(fresh.parameters(), lr=1e-2)
    torch.testing.assert_close(_step(fresh, opt2, x), _step(m, opt, x), rtol=0, atol=0)
    for (k, a), (_, b) in zip(m.state_dict().items(), fresh.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)


def test_scalers_hold_the_module_buffers() -> None:
    m = Float8Linear.from_linear(nn.Linear(16, 16), "delayed")
    sc = m.scaler("input")
    assert isinstance(sc, DelayedScaler) and sc.amax_history is m.input_amax_history
    assert m.scaler("grad_output") is not None
    x = torch.randn(4, 16)
    m(x).sum().backward()
    assert float(m.input_amax_history[0]) == pytest.approx(float(x.abs().max()))
    assert bool(m.grad_output_amax_history[0] > 0)  # updated in backward, in place
    m.double()  # replaces the buffer tensors: the scalers follow
    sc = m.scaler("input")
    assert isinstance(sc, DelayedScaler) and sc.amax_history is m.input_amax_history
    st = Float8Linear.from_linear(nn.Linear(16, 16), "static")
    ssc = st.scaler("input")
    assert isinstance(ssc, StaticScaler) and ssc.calib_amax is st.input_static_amax
    assert st.scaler("weight") is None  # dynamic in the static preset
    with pytest.raises(ValueError, match="role must be one of"):
        st.scaler("bias")


def test_assign_load_rebinds_the_scalers() -> None:
    a = convert_to_float8(_mlp(), "delayed")
    a(_batch(0)).sum().backward()
    b = convert_to_float8(_mlp(), "delayed")
    b.load_state_dict(a.state_dict(), assign=True)
    sc = b[0].scaler("input")
    assert isinstance(sc, DelayedScaler) and sc.amax_history is b[0].input_amax_history
    torch.testing.assert_close(b[0].input_amax_history, a[0].input_amax_history)


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0])
def test_loaded_static_amax_must_be_finite_and_non_negative(bad: float) -> None:
    m = convert_to_float8(nn.Linear(8, 8), "static")
    with calibrate(m):
        m(torch.randn(4, 8)).sum().backward()
    sd = m.state_dict()
    sd["input_static_amax"] = torch.tensor(bad)
    fresh = convert_to_float8(nn.Linear(8, 8), "static")
    with pytest.raises(ValueError, match=r"state_dict\['input_static_amax'\] must be finite"):
        fresh.load_state_dict(sd)
    hist = convert_to_float8(nn.Linear(8, 8), "delayed").state_dict()
    hist["weight_amax_history"][3] = bad
    with pytest.raises(ValueError, match="weight_amax_history"):
        convert_to_float8(nn.Linear(8, 8), "delayed").load_state_dict(hist)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_float_inputs_are_refused(name: str, dtype: torch.dtype) -> None:
    m = convert_to_float8(nn.Linear(16, 8), name)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        m(torch.ones(4, 16, dtype=dtype))


def test_zero_dim_input_is_refused() -> None:
    m = convert_to_float8(nn.Linear(16, 8), "rowwise")
    with pytest.raises(ValueError, match="x: expected shape"):
        m(torch.tensor(1.0))


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "rowwise", "blockwise", "nvfp4"])
def test_meta_device_gives_shapes(name: str) -> None:
    """On the meta device (shape inference, deferred init) forward and backward run."""
    m = convert_to_float8(nn.Linear(32, 16, device="meta"), name)
    x = torch.randn(2, 4, 32, device="meta", requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == (2, 4, 16) and y.device.type == "meta"
    assert x.grad is not None and x.grad.shape == x.shape
    st = convert_to_float8(nn.Linear(32, 16, device="meta"), "static")
    with pytest.raises(ValueError, match="meta device"), calibrate(st):
        pass


@pytest.mark.parametrize("name", ["delayed", "static"])
@pytest.mark.parametrize("cast", ["to_bf16", "half", "bfloat16", "double"])
def test_module_casts_keep_the_scaling_state_in_float32(name: str, cast: str) -> None:
    # torchao keeps its amax buffers in FP32 under .to(dtype): an amax history in BF16
    # would round every recorded maximum (8 bits of mantissa), changing the scales.
    m = convert_to_float8(_mlp(), name)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    if name == "static":
        with calibrate(m):
            _step(m, opt, _batch(0))
    else:
        for i in range(3):
            _step(m, opt, _batch(i))
    before = {k: v.clone() for k, v in m.state_dict().items() if "amax" in k}
    assert before and any(bool((v != v.bfloat16().float()).any()) for v in before.values())
    if cast == "to_bf16":
        m.to(torch.bfloat16)
    else:
        getattr(m, cast)()
    wdtype = {"to_bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "half": torch.float16}
    assert m[0].weight.dtype == wdtype.get(cast, torch.float64)
    after = {k: v for k, v in m.state_dict().items() if "amax" in k}
    for k, v in before.items():
        assert after[k].dtype == torch.float32 and torch.equal(after[k], v), k
    for layer in (m[0], m[2]):  # the scalers still read the module's own buffers
        for role in ("input", "grad_output"):
            sc = layer.scaler(role)
            held = sc.amax_history if isinstance(sc, DelayedScaler) else sc.calib_amax  # type: ignore[union-attr]
            assert held is layer._state(role)
    # the cast module still trains and records
    x = _batch(9).to(m[0].weight.dtype)
    m(x).float().pow(2).mean().backward()
    if name == "delayed":
        assert not torch.equal(m[0].input_amax_history, before["0.input_amax_history"])


def test_cast_scale_for_is_the_scalers_scale_function() -> None:
    """One scale function: a CastConfig's tensor-wise scale of an amax is the core
    scalers' (core.scales.group_scale), margins, power-of-two rounding and non-finite
    amax included."""
    from lowprec.core.scalers import DelayedScaler
    from lowprec.float8 import CastConfig

    a = torch.tensor([0.0, 3.0, 896.0, float("inf"), float("nan")])
    for fmt in ("e4m3fn", "e5m2"):
        for margin, p2 in ((0.0, False), (1.0, True), (-0.5, False)):
            cast = CastConfig(fmt=fmt, scaling="delayed", margin=margin, power_of_two=p2)
            sc = DelayedScaler(fmt, margin=margin, power_of_two=p2)
            assert torch.allclose(cast.scale_for(a), sc.scale_of(a), rtol=0, atol=0, equal_nan=True)
