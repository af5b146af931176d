"""lowprec.unit.UnitConfig (validation, plain-value round trip) and lowprec.unit.apply, the
technique's entry point, against the unit_scale call it stands for."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from torch import nn

import lowprec.unit
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.unit import UnitConfig, apply, recipe_param_groups, umup_taus, unit_scale
from lowprec.unit.entry import UMUP_LR_PER_LR

CFG = ModelConfig(vocab_size=65, width=32, depth=2, heads=2, seq_len=32)


def test_config_round_trips_through_plain_values() -> None:
    c = UnitConfig(float8=True, float8_readout=True, strict=True, act_mult=2, output_mult=0.5)
    d = asdict(c)
    assert all(type(v) in (bool, float) for v in d.values())  # int mult stored as float
    assert UnitConfig(**d) == c and d["act_mult"] == 2.0


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"float8": 1}, TypeError, "float8 must be a bool"),
        ({"strict": "yes"}, TypeError, "strict must be a bool"),
        ({"act_mult": "1"}, TypeError, "act_mult must be a float"),
        ({"act_mult": True}, TypeError, "act_mult must be a float"),
        ({"softmax_mult": 0.0}, ValueError, "softmax_mult must be a finite float > 0"),
        ({"output_mult": float("nan")}, ValueError, "output_mult must be a finite"),
        ({"output_mult": -1.0}, ValueError, "output_mult"),
        ({"float8_readout": True}, ValueError, "float8_readout=True needs float8=True"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        UnitConfig(**kwargs)  # type: ignore[arg-type]


def test_apply_is_unit_scale_with_umup_residuals() -> None:
    """apply(model, cfg, reinit=True) is exactly unit_scale(model, reinit=True,
    residual=umup_taus, config=cfg): same report, same re-initialised weights (same seed) and
    bit-identical outputs and grads."""
    cfg = UnitConfig(float8=True, act_mult=1.5)
    m = CharGPT(CFG)
    torch.manual_seed(1)
    a = apply(m, cfg, reinit=True)
    torch.manual_seed(1)
    b = unit_scale(m, reinit=True, residual=umup_taus, config=cfg)
    assert a.unit_report == b.unit_report
    idx = torch.randint(0, 65, (4, 32), generator=torch.Generator().manual_seed(0))
    (la, lossa), (lb, lossb) = a(idx, idx), b(idx, idx)
    assert lossa is not None and lossb is not None
    assert torch.equal(la, lb)
    lossa.backward()
    lossb.backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb) and pa.grad is not None and pb.grad is not None, n
        assert torch.equal(pa.grad, pb.grad), n
    assert (
        lowprec.unit.apply is apply
        and apply(nn.Linear(4, 4), reinit=True).unit_report["readout"] == ""
    )


def test_recipe_param_groups_are_relative_to_the_callers_lr() -> None:
    torch.manual_seed(2)
    u = apply(CharGPT(CFG), UnitConfig())
    groups = recipe_param_groups(u, 1e-3)
    assert sum(len(g["params"]) for g in groups) == len(list(u.parameters()))
    assert all(g["lr"] == pytest.approx(1e-3 * g["lr_mult"]) for g in groups)
    # lr_mult relative to the caller's lr: the readout/embedding (u-μP mult 1) get η/lr
    assert max(g["lr_mult"] for g in groups) == pytest.approx(UMUP_LR_PER_LR)
    assert all("weight_decay" not in g for g in groups)


def test_apply_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="config must be a UnitConfig"):
        apply(nn.Linear(4, 4), {"float8": True}, reinit=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a UnitConfig or None"):
        unit_scale(nn.Linear(4, 4), reinit=True, config="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr must be a finite float > 0"):
        recipe_param_groups(apply(nn.Linear(4, 4), reinit=True), 0.0)
