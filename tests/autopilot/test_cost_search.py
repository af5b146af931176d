"""The cost model and the choice, on constructed numbers (no model runs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec.autopilot import search, tune
from lowprec.autopilot.cost import (
    CANDIDATES,
    GEMMS,
    check_candidates,
    check_target,
    counting_flops,
    gemm_cost,
    rate,
)
from lowprec.autopilot.sensitivity import Outcome


def test_rate_table_is_the_published_ratio_of_dense_peaks() -> None:
    assert [rate(c, "b200") for c in ("bf16", "fp8-rowwise", "mxfp8", "nvfp4")] == [1, 2, 2, 4]
    assert rate("nvfp4", "h100") == rate("nvfp4", "h200") == 2  # no FP4: runs as FP8
    assert {rate(c, "cpu") for c in CANDIDATES} == {1.0}


def test_cost_of_uniform_formats() -> None:
    flops = {("a", g): 2.0 for g in GEMMS} | {("b", g): 6.0 for g in GEMMS}
    for cand, target, want in (
        ("fp8-tensorwise", "h100", 0.5),
        ("nvfp4", "b200", 0.25),
        ("nvfp4", "h100", 0.5),
        ("bf16", "b200", 1.0),
        ("nvfp4", "cpu", 1.0),
    ):
        assert gemm_cost(flops, dict.fromkeys(flops, cand), target) == want
    # FLOP-weighted: a (1/4 of the FLOPs) in fp4, b in bf16 on b200: 1/4 · 1/4 + 3/4 · 1
    mixed = {k: ("nvfp4" if k[0] == "a" else "bf16") for k in flops}
    assert gemm_cost(flops, mixed, "b200") == pytest.approx(0.25 / 4 + 0.75)


def test_counting_flops_is_2mkn_per_gemm() -> None:
    m = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))
    with counting_flops(m) as flops:
        m(torch.zeros(2, 7, 8))
        m(torch.zeros(4, 8))
    m_tokens = 2 * 7 + 4
    assert flops[("0", "forward")] == 2 * m_tokens * 8 * 5
    assert flops[("2", "weight_grad")] == 2 * m_tokens * 5 * 3
    assert set(flops) == {(f, g) for f in ("0", "2") for g in GEMMS}
    # only GEMMs that run count: the first layer is fed data (no input gradient)
    assert flops[("0", "input_grad")] == 0.0
    assert flops[("2", "input_grad")] == 2 * m_tokens * 5 * 3


def test_counting_flops_leaves_out_the_gemms_that_do_not_run() -> None:
    """An input that needs a gradient runs ``input_grad``; a frozen weight runs no
    ``weight_grad``; under ``no_grad`` only the forward runs."""
    m = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))
    m[2].weight.requires_grad_(False)
    x = torch.zeros(4, 8, requires_grad=True)
    with counting_flops(m) as flops:
        m(x)
    f0, f2 = 2 * 4 * 8 * 5, 2 * 4 * 5 * 3
    assert [flops[("0", g)] for g in GEMMS] == [f0, f0, f0]
    assert [flops[("2", g)] for g in GEMMS] == [f2, f2, 0.0]
    with counting_flops(m) as flops, torch.no_grad():
        m(x)
    assert [flops[("0", g)] for g in GEMMS] == [f0, 0.0, 0.0]


def test_a_gemm_that_never_runs_stays_bf16_and_costs_nothing() -> None:
    """The first layer's input-gradient GEMM never runs: it was counted at its forward's
    FLOPs and, never measured (error 0), given FP4, which made a plan with no budget to
    spend read 12.5% cheaper than BF16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    batches = [(torch.randn(32, 64), torch.randn(32, 64)) for _ in range(2)]

    def loss_fn(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(b[0]), b[1])

    plan = tune(model, batches, loss_fn=loss_fn, target="b200", budget=1e-6)
    dgrad = plan.layers["0"]["gemms"]["input_grad"]
    assert dgrad["flops"] == 0.0 and dgrad["format"] == "bf16"
    assert plan.formats() == {"0": "bf16", "2": "bf16"} and plan.cost == 1.0
    assert plan.layers["0"]["flops"] == 2 * 2 * (2 * 32 * 64 * 256)  # forward + weight_grad


def test_bad_target_and_candidates_name_the_argument() -> None:
    with pytest.raises(ValueError, match="target must be one of h100, h200, b200, cpu"):
        check_target("a100")
    with pytest.raises(ValueError, match="candidates: unknown 'fp3'"):
        check_candidates(["fp3"])
    with pytest.raises(TypeError, match="candidates must be a sequence"):
        check_candidates("nvfp4")
    assert check_candidates(["nvfp4"]) == ("bf16", "nvfp4")  # bf16 always, table order


# Errors as shares of the budget: an outlier GEMM that FP4 ruins, a tame one.
ERR = {
    ("tame", "forward"): {"bf16": 0.0, "fp8-rowwise": 0.001, "mxfp8": 0.002, "nvfp4": 0.01},
    ("outl", "forward"): {"bf16": 0.0, "fp8-rowwise": 0.002, "mxfp8": 0.003, "nvfp4": 50.0},
}
FLOPS = {("tame", "forward"): 1.0, ("outl", "forward"): 1.0}


def test_start_gives_the_tame_gemm_fp4_and_the_outlier_gemm_fp8_on_b200() -> None:
    choice = search.start(FLOPS, ERR, "b200")
    assert choice == {("tame", "forward"): "nvfp4", ("outl", "forward"): "fp8-rowwise"}


def test_where_fp4_brings_nothing_the_safer_format_wins_the_tie() -> None:
    # h100: nvfp4 costs what FP8 costs; ties go to the smaller error.
    assert set(search.start(FLOPS, ERR, "h100").values()) == {"fp8-rowwise"}
    # cpu: every rate is 1, so bf16 (error 0) wins every tie.
    assert set(search.start(FLOPS, ERR, "cpu").values()) == {"bf16"}


def test_fallbacks_are_safer_and_cheapest_first_bf16_last() -> None:
    e = ERR[("tame", "forward")]
    assert search.fallbacks(e, "nvfp4", "b200") == ["fp8-rowwise", "bf16"]
    assert search.fallbacks(e, "mxfp8", "b200") == ["fp8-rowwise", "bf16"]  # as costly, safer
    assert search.fallbacks(e, "bf16", "b200") == []


def test_repair_moves_the_worst_gemm_until_within_budget() -> None:
    choice = {k: "nvfp4" for k in FLOPS}
    runs = []

    def evaluate(ch: object) -> Outcome:
        runs.append(dict(ch))  # type: ignore[call-overload]
        bad = sum(ERR[k][c] for k, c in ch.items())  # type: ignore[attr-defined]
        return Outcome(bad, 0.0)

    out, outcome, moved = search.repair(choice, ERR, "b200", evaluate, lambda o: o.loss_delta)
    assert moved == [("outl", "forward")]
    assert out == {("tame", "forward"): "nvfp4", ("outl", "forward"): "fp8-rowwise"}
    assert outcome.loss_delta == pytest.approx(0.012) and len(runs) == 2


def test_layer_config_per_gemm() -> None:
    assert search.layer_config({g: "bf16" for g in GEMMS}) is None
    cfg = search.layer_config(
        {"forward": "fp8-rowwise", "input_grad": "bf16", "weight_grad": "nvfp4"}
    )
    assert cfg is not None
    assert cfg.high_precision_gemms == ("input_grad",)
    assert cfg.input.granularity == "axis"  # the forward's candidate is the base
    assert cfg.for_gemm("weight_grad").grad_output.fmt == "e2m1"
    assert cfg.name == "fwd=fp8-rowwise,dgrad=bf16,wgrad=nvfp4"
    assert search.layer_config(dict.fromkeys(GEMMS, "nvfp4")).name == "nvfp4"  # type: ignore[union-attr]
