"""Float8Linear's delayed/static scaling runs on the core scalers, with their state in the
module's buffers: state_dict round trips, rebinding after ``.to()``, reducible tensors."""

from __future__ import annotations

import io

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
