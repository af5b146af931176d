"""u-μP learning-rate rules (lowprec.unit.umup) and the claim that sweeping only η is enough.

The full two-width sweep at the 120-step test config is ``benchmarks/bench_umup_sweep.py``
(results in ``benchmarks/results/umup_sweep_cpu.json``); the test below is its cheap
version: fewer steps, smaller batches, a grid of η a factor 4 apart.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from torch import nn

from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.jobs.train import TrainConfig, train
from lowprec.unit import umup_param_groups, unit_scale
from lowprec.unit.entry import UMUP_LR_PER_LR


def _mults(model: nn.Module, eta: float = 1.0) -> dict[str, float]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return {ids[id(p)]: g["lr_mult"] for g in umup_param_groups(model, eta) for p in g["params"]}


def test_lr_rules_by_role() -> None:
    """The module table: hidden weight and its bias η/√fan_in, norm η/√width, embedding and
    readout η (exact: the rules are closed-form)."""
    u = unit_scale(CharGPT(ModelConfig(width=64, depth=2, heads=4)), reinit=True)
    m = _mults(u)
    assert m["blocks.0.fc.weight"] == pytest.approx(64**-0.5)
    assert m["blocks.0.fc.bias"] == pytest.approx(64**-0.5)
    assert m["blocks.0.fc_out.weight"] == pytest.approx(256**-0.5)
    assert m["blocks.0.fc_out.bias"] == pytest.approx(256**-0.5)
    assert m["blocks.0.ln1.weight"] == m["blocks.0.ln1.bias"] == pytest.approx(64**-0.5)
    assert m["tok.weight"] == m["pos.weight"] == m["head.weight"] == 1.0


def test_lr_rules_scale_with_width() -> None:
    """μP: only the fan-in factors change with width (x2 width -> hidden, bias and norm
    learning rates / √2); embedding and readout stay at η."""
    a = _mults(unit_scale(CharGPT(ModelConfig(width=32, depth=1, heads=2)), reinit=True))
    b = _mults(unit_scale(CharGPT(ModelConfig(width=64, depth=1, heads=2)), reinit=True))
    for name in ("blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "ln_f.weight"):
        assert a[name] / b[name] == pytest.approx(math.sqrt(2))
    assert a["tok.weight"] == b["tok.weight"] == a["head.weight"] == b["head.weight"] == 1.0


def test_bias_of_a_conv_uses_its_fan_in() -> None:
    m = _mults(nn.Sequential(nn.Conv1d(4, 8, 3), nn.Linear(8, 2)))
    assert m["0.bias"] == pytest.approx((4 * 3) ** -0.5) == m["0.weight"]


_SWEEP = TrainConfig(steps=40, batch_size=8, seq_len=32, width=32, depth=1, heads=2, lr=3e-3,
                     warmup=5, eval_every=40, eval_batches=4, ckpt_every=1000,
                     recipe="fp32-unit")  # fmt: skip


@pytest.mark.slow
def test_best_eta_transfers_across_width(tmp_path: Path) -> None:
    """Sweeping only η: the best η of the unit-scaled CharGPT at width 32 and at width 128
    is the same grid point or one apart (grid x4), and beats the grid's ends by a margin (so
    the optimum is inside the grid, not at an edge where any width would agree)."""
    etas = (0.0625, 0.25, 1.0, 4.0)
    best = {}
    for width in (32, 128):
        loss = {}
        for eta in etas:
            cfg = TrainConfig(**{**_SWEEP.to_dict(), "width": width, "lr": eta / UMUP_LR_PER_LR})
            out = tmp_path / f"w{width}_eta{eta}"
            loss[eta] = float(train(cfg, out, progress=False)["val_loss"])
        best[width] = min(etas, key=lambda e: loss[e] if math.isfinite(loss[e]) else math.inf)
        assert best[width] not in (etas[0], etas[-1]), (width, loss)
    steps = abs(math.log(best[32] / best[128], 4))
    assert steps <= 1, best
