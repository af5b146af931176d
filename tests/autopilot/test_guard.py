"""The guard's moves (lowprec.autopilot.guard) on constructed measurements, and their replay.

Oracles: hand-made GEMM records with a known flushed share / error, and a loss series with
one known spike; the replayed model must equal the moved one layer by layer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec.autopilot.guard import Guard, GuardConfig, Move, next_safer
from lowprec.float8 import Float8Config, Float8Linear, apply


def _model(cfg: str | Float8Config = "naive") -> nn.Module:
    torch.manual_seed(0)
    return apply(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), cfg)


def _rec(layer: str, flushed: float = 0.0, sat: float = 0.0, err: float = 0.05) -> dict:
    ops = {"grad_output": {"flushed": flushed, "saturated": sat}, "weight": {"flushed": 0.0}}
    return {"step": 0, "layer": layer, "gemm": "input_grad", "rel_err": err, "operands": ops}


def test_the_ladder() -> None:
    names = []
    cfg: Float8Config | None = Float8Config.from_name("naive")
    while cfg is not None:
        names.append(cfg.name)
        cfg = next_safer(cfg)
    assert names == ["naive", "tensorwise"]
    assert next_safer(Float8Config.from_name("mxfp4")).name == "rowwise"  # type: ignore[union-attr]
    # per GEMM: only the NVFP4 weight gradient moves (to FP8 row-wise)
    assert next_safer(Float8Config.from_name("tensorwise-wgrad-nvfp4")).name == (  # type: ignore[union-attr]
        "fwd=tensorwise,dgrad=tensorwise,wgrad=rowwise"
    )
    assert next_safer(None) is None


def test_a_move_never_makes_a_gemm_less_precise() -> None:
    """Per GEMM: the GEMMs on the layer's lowest rung go one rung up, the others keep
    their config. A per-GEMM plan's layer (FP4 input gradient, BF16 forward and weight
    gradient) moved as a whole to FP8 row-wise: its BF16 GEMMs became FP8."""
    mx, hp = Float8Config.from_name("mxfp4"), ("forward", "weight_grad")
    moved = next_safer(mx.replace(name="fwd=bf16,dgrad=mxfp4,wgrad=bf16", high_precision_gemms=hp))
    rowwise = Float8Config.from_name("rowwise")
    want = rowwise.replace(name="fwd=bf16,dgrad=rowwise,wgrad=bf16", high_precision_gemms=hp)
    assert moved == want
    assert next_safer(moved) is None  # then high precision
    # FP8 forward, an FP4 override for the weight gradient: only that GEMM moves
    tw, nv = Float8Config.from_name("tensorwise"), Float8Config.from_name("nvfp4")
    moved = next_safer(tw.replace(name="mix", gemms=(("weight_grad", nv),)))
    assert moved == tw.replace(
        name="fwd=tensorwise,dgrad=tensorwise,wgrad=rowwise", gemms=(("weight_grad", rowwise),)
    )
    assert next_safer(moved) is None  # every GEMM is on the FP8 rung: high precision next
    # no scaling with a high-precision GEMM: the scaled GEMMs become tensor-wise, BF16 stays
    naive = Float8Config.from_name("naive").replace(high_precision_gemms=("weight_grad",))
    moved = next_safer(naive)
    assert moved is not None and moved.high_precision_gemms == ("weight_grad",)
    assert moved.input == tw.input and moved.grad_output == tw.grad_output and moved.gemms == ()


def test_a_per_gemm_move_is_replayed_exactly() -> None:
    cfg = Float8Config.from_name("mxfp4").replace(
        name="fwd=bf16,dgrad=mxfp4,wgrad=bf16", high_precision_gemms=("forward", "weight_grad")
    )
    m = _model(cfg)
    (mv,) = Guard(m).check(3, [_rec("0", flushed=0.7)], 2.0)
    assert (mv.frm, mv.to) == (cfg.name, "fwd=bf16,dgrad=rowwise,wgrad=bf16")
    assert m[0].recipe.high_precision_gemms == ("forward", "weight_grad")
    fresh = _model(cfg)
    Guard(fresh).replay([Move.from_dict(mv.to_dict())])
    assert fresh[0].recipe == m[0].recipe and fresh[2].recipe == m[2].recipe


def test_measured_failures_move_only_the_failing_layer() -> None:
    m = _model()
    g = Guard(m)
    assert g.check(5, [_rec("0", flushed=0.1), _rec("2", flushed=0.3)], 2.0) == [
        Move(5, "2", "naive", "tensorwise", "input_grad: 30% of grad_output flushed to zero")
    ]
    assert m[0].recipe.name == "naive" and m[2].recipe.name == "tensorwise"
    (mv,) = g.check(6, [_rec("2", sat=0.02)], 2.0)  # saturation: next rung, high precision
    assert (mv.layer, mv.to) == ("2", "high precision") and type(m[2]) is nn.Linear
    assert g.check(7, [_rec("2", err=0.9)], 2.0) == []  # already high precision
    (mv,) = g.check(8, [_rec("0", err=0.31)], 2.0)
    assert mv.reason == "input_grad: GEMM relative error 0.31"


def test_a_loss_spike_moves_the_layer_with_the_largest_error_once_per_cooldown() -> None:
    m = _model("tensorwise")
    g = Guard(m, GuardConfig(warmup=3, cooldown=5, spike=0.5))
    g.check(1, [_rec("0", err=0.05), _rec("2", err=0.12)], 2.0)
    for step in (2, 3):
        assert g.check(step, [], 2.0) == []
    (mv,) = g.check(4, [], 3.5)  # 3.5 > 1.5 × 2.0
    assert (mv.layer, mv.to) == ("2", "high precision") and mv.reason.startswith("loss spike")
    assert g.check(5, [], 5.0) == []  # cooldown
    assert g.check(10, [], 9.0)[0].layer == "0"


def test_replay_and_state_resume_exactly() -> None:
    m = _model()
    g = Guard(m, GuardConfig(warmup=1))
    g.check(3, [_rec("0", flushed=0.5)], 2.0)
    g.check(4, [_rec("0", flushed=0.5)], 2.5)
    state = g.state_dict()
    fresh = _model()
    g2 = Guard(fresh, GuardConfig(warmup=1))
    g2.replay([Move.from_dict(d) for d in state["moves"]])
    g2.load_state_dict(state)
    assert [type(a) for a in m] == [type(b) for b in fresh]
    assert g2.state_dict() == state
    x = torch.randn(4, 8)
    fresh.load_state_dict(m.state_dict())
    torch.testing.assert_close(fresh(x), m(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="differ"):
        Guard(_model()).load_state_dict(state)


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="flush_limit"):
        GuardConfig(flush_limit=0)
    with pytest.raises(ValueError, match="ema"):
        GuardConfig(ema=1.0)
    with pytest.raises(ValueError, match="warmup"):
        GuardConfig(warmup=0)
    with pytest.raises(TypeError, match="model"):
        Guard("m")  # type: ignore[arg-type]
    assert isinstance(_model()[0], Float8Linear)
