"""Issue 15 item 5: the loss scalers are drop-ins for ``torch.amp.GradScaler``.

Oracle: ``torch.amp.GradScaler`` itself, run side by side on an identical FP32 model
(bitwise: both unscale by a power of two, then the same clip and SGD)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lowprec.amp import DynamicLossScaler, MasterWeights, NoLossScaler, StaticLossScaler


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 4)


def test_get_scale_and_is_enabled_match_gradscaler() -> None:
    theirs = torch.amp.GradScaler("cpu")
    assert DynamicLossScaler().get_scale() == theirs.get_scale() == 2.0**16
    assert DynamicLossScaler().is_enabled() is theirs.is_enabled() is True
    assert StaticLossScaler(8.0).get_scale() == 8.0 and StaticLossScaler(8.0).is_enabled()
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert NoLossScaler().is_enabled() is off.is_enabled() is False
    assert NoLossScaler().get_scale() == off.get_scale() == 1.0


def test_clip_loop_matches_gradscaler_bitwise() -> None:
    """scale → backward → unscale_ → clip_grad_norm_ → step → update, with an Inf
    injected at step 2: same parameters, same skips, same scales as GradScaler."""
    ours = DynamicLossScaler(2.0**10, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    m1, m2 = _model(), _model()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    for t in range(6):
        x = torch.randn(16, 8)
        for m, o, s in ((m1, o1, ours), (m2, o2, theirs)):
            s.scale(m(x).square().mean()).backward()
            if t == 2:
                m.weight.grad[0, 0] = math.inf  # type: ignore[index]
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            s.step(o)
            s.update()
            o.zero_grad()
        assert ours.get_scale() == theirs.get_scale(), t
        for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
            assert torch.equal(p, q), t
    assert [r.skipped for r in ours.history] == [False, False, True, False, False, False]
    # 1024 → 2048 after 2 good steps → 1024 at the skip → 2048 after 2 good → 2048
    assert ours.get_scale() == 2.0**11


def test_gradscaler_call_order_rules() -> None:
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = StaticLossScaler(4.0)
    s.scale(m(torch.randn(2, 8)).sum()).backward()
    s.unscale_(o)
    with pytest.raises(RuntimeError, match="already called"):
        s.unscale_(o)
    assert s.step(o) is True
    with pytest.raises(RuntimeError, match="already called"):
        s.step(o)
    with pytest.raises(RuntimeError, match="already called"):
        s.unscale_(o)
    s.update()
    s.scale(m(torch.randn(2, 8)).sum()).backward()
    assert s.step(o) is True  # a new step after update()
    with pytest.raises(RuntimeError, match="closure"):
        s.step(o, closure=lambda: None)


def test_update_new_scale_scale_lists_and_gradscaler_state() -> None:
    s = DynamicLossScaler(init_scale=8.0, max_scale=64.0)
    s.update(new_scale=32.0)
    assert s.get_scale() == 32.0
    s.update(new_scale=torch.tensor(16.0))
    assert s.get_scale() == 16.0
    with pytest.raises(ValueError, match="new_scale"):
        s.update(new_scale=128.0)
    a, b = s.scale([torch.tensor(1.0), (torch.tensor(2.0),)])
    assert float(a) == 16.0 and float(b[0]) == 32.0
    with pytest.raises(TypeError, match="outputs"):
        s.scale(1.0)
    # a GradScaler checkpoint loads: its scale, factors, interval and growth tracker
    g = torch.amp.GradScaler("cpu", init_scale=2.0**9, growth_factor=4.0, growth_interval=5)
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    g.scale(m(torch.randn(2, 8)).sum()).backward()
    g.step(o)
    g.update()
    t = DynamicLossScaler()
    t.load_state_dict(g.state_dict())
    assert t.get_scale() == g.get_scale() == 2.0**9
    assert (t.growth_factor, t.growth_interval, t._good_steps) == (4.0, 5, 1)
    with pytest.raises(ValueError, match="growth_interval"):
        t.load_state_dict({**g.state_dict(), "growth_interval": 0})


def test_no_loss_scaler_is_gradscaler_disabled() -> None:
    """unscale_ does nothing (the model's FP16 gradients stay as they are, so clipping
    them before step reaches the FP32 masters), step always applies."""
    m = nn.Linear(4, 2).half()
    o = MasterWeights(m.parameters(), lambda ps: torch.optim.SGD(ps, lr=1.0))
    s = NoLossScaler()
    m.weight.grad = torch.full_like(m.weight, 2.0)
    m.bias.grad = torch.full_like(m.bias, 2.0)
    w0 = o.master_params[0].detach().clone()
    s.unscale_(o)
    s.unscale_(o)  # no once-per-step rule when disabled, as GradScaler(enabled=False)
    torch.nn.utils.clip_grad_value_(m.parameters(), 0.5)
    assert s.step(o) is True
    assert torch.equal(o.master_params[0], w0 - 0.5)
