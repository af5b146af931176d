"""The demo's verdicts and seed spread (lowprec.analysis.diagnosis), on synthetic numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lowprec.analysis.diagnosis import (
    FAIL_GAP,
    Run,
    gap_spread,
    reference_of,
    summary_verdicts,
    verdict,
)


def test_a_large_gap_fails_and_says_by_how_much() -> None:
    assert verdict(0.30, "fp32", 0.004) == "fails: +30.0% val loss vs fp32"
    # A failure needs both: beyond the seed spread and beyond FAIL_GAP.
    assert verdict(FAIL_GAP * 1.01, "fp32", FAIL_GAP * 2).startswith("matches fp32")


def test_within_spread_matches_and_names_underflow() -> None:
    assert verdict(0.003, "fp32", 0.004) == "matches fp32 (within seed spread ±0.4%)"
    assert verdict(-0.004, "fp32", 0.004).startswith("matches")  # the bound is inclusive
    text = verdict(0.003, "fp32", 0.004, underflow=0.94)
    assert text.startswith("activation gradients underflow (94%)") and "within seed spread" in text


def test_between_spread_and_failure_is_worse_or_better() -> None:
    assert verdict(0.02, "fp32", 0.004) == "worse: +2.0% vs fp32, beyond seed spread (±0.4%)"
    assert verdict(-0.08, "fp32", 0.004).startswith("better: -8.0% vs fp32")


def test_divergence_reference_and_missing_numbers() -> None:
    assert verdict(None, "fp32", 0.004, diverged_at=2) == "fails: loss NaN/Inf at step 2"
    assert verdict(math.nan, "fp32", 0.004) == "fails: no finite val loss"
    assert verdict(0.0, None, 0.004) == "reference"
    # No measured spread: the gap is reported, not judged, unless it is a failure.
    assert verdict(0.01, "fp32", None) == "+1.0% vs fp32 (seed spread not measured)"
    assert verdict(0.30, "fp32", None).startswith("fails")
    assert verdict(0.0, "fp32", 0.01, skipped=1).endswith("; 1 step skipped")


def test_gap_spread_is_the_median_sd_of_paired_gaps() -> None:
    ref = [2.0, 2.2, 2.1]
    # a: gaps +1%, -1%, 0  -> sd 1%; b: constant +5% -> sd 0; c: 0, +2%, -2% -> sd 2%.
    val = {
        "fp32": ref,
        "a": [2.0 * 1.01, 2.2 * 0.99, 2.1],
        "b": [v * 1.05 for v in ref],
        "c": [2.0, 2.2 * 1.02, 2.1 * 0.98],
    }
    assert gap_spread(val, "fp32") == pytest.approx(0.01)
    # A constant offset is not noise: the spread is of the gap, paired by seed.
    assert gap_spread({"fp32": ref, "b": val["b"]}, "fp32") == pytest.approx(0.0, abs=1e-12)
    # Non-finite runs are left out; one seed or no other recipe gives no spread.
    assert gap_spread({**val, "nan": [math.nan] * 3}, "fp32") == pytest.approx(0.01)
    assert gap_spread({"fp32": [2.0], "a": [2.1]}, "fp32") is None
    assert gap_spread({"fp32": ref}, "fp32") is None
    assert gap_spread(val, "fp32-unit") is None


def test_reference_of() -> None:
    runs = ["fp32", "fp8-unit", "fp32-unit", "fp16"]
    assert reference_of("fp16", False, runs) == "fp32"
    assert reference_of("fp8-unit", True, runs) == "fp32-unit"
    assert reference_of("fp8-unit", True, ["fp32", "fp8-unit"]) == "fp32"
    assert reference_of("fp32", False, runs) is None
    assert reference_of("fp32-unit", True, runs) is None
    assert reference_of("fp16", False, ["fp16"]) is None


def test_summary_verdicts_pick_each_runs_reference() -> None:
    def run(recipe: str, val: float, technique: str | None = None, **s: object) -> Run:
        tech = [{"technique": technique, "config": {}}] if technique else []
        config = {"train": {"recipe": recipe}, "recipe": {"technique": tech}}
        summary = {"val_loss": val, "act_grad_underflow": 0.0, "skipped_steps": 0, **s}
        return Run(Path(recipe), config, [], summary)

    runs = [
        run("fp32", 2.5),
        run("fp8-naive", 3.25, "float8"),
        run("fp32-unit", 2.3, "unit"),
        run("fp8-unit", 2.3, "unit"),
        run("fp16-pure", math.nan, diverged_at=2),
    ]
    got = dict(summary_verdicts(runs, {"fp32": 0.005, "fp32-unit": 0.02}))
    assert got == {
        "fp32": "reference",
        "fp8-naive": "fails: +30.0% val loss vs fp32",
        "fp32-unit": "reference",
        "fp8-unit": "matches fp32-unit (within seed spread ±2%)",
        "fp16-pure": "fails: loss NaN/Inf at step 2",
    }
