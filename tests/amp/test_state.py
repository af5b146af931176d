"""Issue 14, defect 5: loss-scaler configs and loaded states are validated; loading is all
or nothing; MasterWeights.load_state_dict writes the masters into the model."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from lowprec.amp import DynamicLossScaler, MasterWeights, StaticLossScaler

BAD_NUMBERS = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize(
    "arg", ["init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"]
)
def test_dynamic_scaler_refuses_non_finite_config(arg: str, value: float) -> None:
    with pytest.raises(ValueError, match=arg):
        DynamicLossScaler(**{arg: value})


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"growth_factor": "2"}, TypeError, "growth_factor"),
        ({"backoff_factor": True}, TypeError, "backoff_factor"),
        ({"growth_interval": 2.0}, TypeError, "growth_interval"),
        ({"growth_interval": -3}, ValueError, "growth_interval"),
        ({"min_scale": -1.0}, ValueError, "min_scale"),
        ({"max_scale": 0.0}, ValueError, "max_scale"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, ValueError, "min_scale"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor"),
    ],
)
def test_dynamic_scaler_refuses_bad_config(
    kwargs: dict[str, Any], err: type[Exception], match: str
) -> None:
    with pytest.raises(err, match=match):
        DynamicLossScaler(**kwargs)


def test_dynamic_scaler_state_dict_holds_its_config() -> None:
    s = DynamicLossScaler(
        init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7,
        min_scale=2.0, max_scale=64.0,
    )  # fmt: skip
    state = s.state_dict()
    assert state["config"] == {
        "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 7,
        "min_scale": 2.0, "max_scale": 64.0,
    }  # fmt: skip
    t = DynamicLossScaler()  # default config: the loaded one replaces it
    t.load_state_dict(state)
    assert t.config() == s.config() and t.loss_scale == 8.0
    # a state saved before the config was recorded keeps the loader's config
    old = {k: v for k, v in state.items() if k != "config"}
    u = DynamicLossScaler(init_scale=4.0, growth_interval=9, min_scale=1.0, max_scale=16.0)
    u.load_state_dict(old)
    assert u.growth_interval == 9 and u.loss_scale == 8.0


def _bad_states() -> list[tuple[dict[str, Any], type[Exception], str]]:
    good = DynamicLossScaler(init_scale=16.0, max_scale=2.0**20).state_dict()
    cfg = good["config"]
    return [
        ({**good, "scale": -1.0}, ValueError, r"state\['scale'\]"),
        ({**good, "scale": math.nan}, ValueError, r"state\['scale'\]"),
        ({**good, "scale": math.inf}, ValueError, r"state\['scale'\]"),
        ({**good, "scale": 2.0**21}, ValueError, r"state\['scale'\] must lie"),
        ({**good, "scale": 0.5}, ValueError, r"state\['scale'\] must lie"),
        ({**good, "scale": "1"}, TypeError, r"state\['scale'\]"),
        ({**good, "good_steps": -1}, ValueError, "good_steps"),
        ({**good, "good_steps": 1.5}, TypeError, "good_steps"),
        ({**good, "history": [(1.0,)]}, ValueError, "history"),
        ({**good, "history": [(math.nan, False)]}, ValueError, "history"),
        ({**good, "config": {**cfg, "growth_factor": math.nan}}, ValueError, "growth_factor"),
        ({**good, "config": {**cfg, "max_scale": 8.0}}, ValueError, r"state\['scale'\] must lie"),
        ({**good, "config": {**cfg, "bogus": 1}}, ValueError, "bogus"),
        ({k: v for k, v in good.items() if k != "scale"}, ValueError, "scale"),
    ]


@pytest.mark.parametrize(("state", "err", "match"), _bad_states())
def test_dynamic_scaler_load_is_validated_and_all_or_nothing(
    state: dict[str, Any], err: type[Exception], match: str
) -> None:
    s = DynamicLossScaler(init_scale=4.0, growth_interval=5)
    before = s.state_dict()
    with pytest.raises(err, match=match):
        s.load_state_dict(state)
    assert s.state_dict() == before, "a refused state must leave the scaler unchanged"


@pytest.mark.parametrize("scale", [-1.0, 0.0, math.nan, math.inf])
def test_static_loss_scaler_refuses_bad_loaded_scale(scale: float) -> None:
    s = StaticLossScaler(4.0)
    with pytest.raises(ValueError, match=r"state\['scale'\]"):
        s.load_state_dict({**s.state_dict(), "scale": scale})
    assert s.loss_scale == 4.0


def _trained() -> tuple[nn.Module, MasterWeights]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).half()
    opt = MasterWeights(model.parameters(), lambda ps: torch.optim.Adam(ps, lr=0.1))
    for _ in range(3):
        model(torch.randn(2, 4).half()).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_master_weights_load_writes_the_masters_into_the_model() -> None:
    src_model, src = _trained()
    state = copy.deepcopy(src.state_dict())  # the optimizer's state_dict holds references
    torch.manual_seed(1)
    model = nn.Linear(4, 3).half()  # different weights
    opt = MasterWeights(model.parameters(), lambda ps: torch.optim.Adam(ps, lr=0.1))
    opt.load_state_dict(state)
    for p, q, m in zip(model.parameters(), src_model.parameters(), opt.master_params, strict=True):
        assert torch.equal(p, q), "model parameters = the masters rounded to FP16"
        assert torch.equal(p, m.half())
    # one more identical step gives identical parameters (the resume is exact)
    for mdl, o in ((src_model, src), (model, opt)):
        torch.manual_seed(2)
        mdl(torch.randn(2, 4).half()).float().square().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), src_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("what", ["count", "shape", "dtype", "optimizer"])
def test_master_weights_load_is_all_or_nothing(what: str) -> None:
    _, src = _trained()
    state = src.state_dict()
    masters = state["master"]
    if what == "count":
        state["master"] = masters[:1]
    elif what == "shape":
        state["master"] = [masters[0][:, :2], masters[1]]
    elif what == "dtype":
        state["master"] = [masters[0].long(), masters[1]]
    else:
        state["optimizer"] = {"state": {}, "param_groups": []}
    torch.manual_seed(1)
    model = nn.Linear(4, 3).half()
    opt = MasterWeights(model.parameters(), lambda ps: torch.optim.Adam(ps, lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    mbefore = [m.detach().clone() for m in opt.master_params]
    with pytest.raises((ValueError, TypeError)):
        opt.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(mbefore, opt.master_params, strict=True))


def test_scaler_history_is_bounded_and_counts_every_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    """``history`` grew one record a step without limit, in memory and in every saved
    state (16 MB at 1M steps in a new user's trial). It now keeps the last HISTORY_LIMIT
    steps (4 here), ``skipped_steps`` still counts all, and a loaded state continues the
    count; the scale still backs off on the step that follows the trimming."""
    from lowprec.amp import loss_scaling

    monkeypatch.setattr(loss_scaling, "HISTORY_LIMIT", 4)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = DynamicLossScaler(init_scale=2.0**10, growth_interval=1000)
    pattern = [i % 3 == 0 for i in range(23)]  # 8 skipped of 23
    for skip in pattern:
        p.grad = torch.full((2,), math.inf if skip else 1.0)
        s.step(opt)
        s.update()
        assert len(s.history) < 8
    assert s.skipped_steps == sum(pattern) == 8
    assert s.loss_scale == 2.0**10 * 0.5**8  # every skip backed off
    state = s.state_dict()
    assert len(state["history"]) == 4
    t = DynamicLossScaler(init_scale=2.0**10, growth_interval=1000)
    t.load_state_dict(copy.deepcopy(state))
    assert t.skipped_steps == 8 and t.loss_scale == s.loss_scale
    # a state saved before the limit (a long history, no count) keeps its count too
    old = {**state, "history": [(1.0, True)] * 10}
    del old["skipped_before"]
    t.load_state_dict(old)
    assert t.skipped_steps == 10 and len(t.history) == 4
