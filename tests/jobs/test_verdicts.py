"""The demo's verdicts and seed spread (lowprec.analysis.diagnosis), on synthetic numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lowprec.analysis.diagnosis import (
    FAIL_GAP,
    Run,
    diagnose,
    gap_spread,
    reference_of,
    verdict,
)
from lowprec.analysis.run_verdicts import summary_verdicts
from lowprec.analysis.verdicts import is_reference_recipe
from lowprec.recipes import get_recipe


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
    # Without a reference nothing is judged: never "reference", never a pass.
    assert verdict(0.0, None, 0.004).startswith("no reference")
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
    refs = [("fp32", False), ("fp32-unit", True)]
    assert reference_of(False, refs) == "fp32"
    assert reference_of(True, refs) == "fp32-unit"
    assert reference_of(True, [("fp32", False)]) is None  # never plain fp32 for a unit run
    assert reference_of(False, [("fp32-unit", True)]) is None  # never the other way
    assert reference_of(False, []) is None


def test_a_recipe_is_a_reference_by_what_it_is() -> None:
    refs = {n for n in ("fp32", "fp32-unit", "bf16", "fp8-naive", "fp8-unit", "fp16-scalify",
                        "amp-bf16", "fp8-tensorwise", "fp16-dynamic-ls")
            if is_reference_recipe(get_recipe(n).to_dict())}  # fmt: skip
    assert refs == {"fp32", "fp32-unit"}
    d = get_recipe("fp32").to_dict()
    assert is_reference_recipe({**d, "name": "my-baseline"})  # by content, not name
    assert not is_reference_recipe({}, "custom") and is_reference_recipe({}, "fp32")
    assert is_reference_recipe({"technique": "unit", "unit_fp8": False})  # flat 0.1 dict
    assert not is_reference_recipe({"technique": "float8", "float8": "naive"})


def test_summary_verdicts_pick_each_runs_reference() -> None:
    runs = [
        _run("fp32", 2.5),
        _run("fp8-naive", 3.25),
        _run("fp32-unit", 2.3),
        _run("fp8-unit", 2.3),
        _run("fp16-pure", math.nan, diverged_at=2),
    ]
    got = dict(summary_verdicts(runs, {"fp32": 0.005, "fp32-unit": 0.02}))
    assert got == {
        "fp32": "reference",
        "fp8-naive": "fails: +30.0% val loss vs fp32",
        "fp32-unit": "reference",
        "fp8-unit": "matches fp32-unit (within seed spread ±2%)",
        "fp16-pure": "fails: loss NaN/Inf at step 2",
    }


def _run(recipe: str, val: float, gemms: list | None = None, **s: object) -> Run:
    config = {"train": {"recipe": recipe}, "recipe": get_recipe(recipe).to_dict()}
    summary = {"val_loss": val, "act_grad_underflow": 0.0, "skipped_steps": 0, **s}
    return Run(Path(recipe), config, [], summary, gemms=gemms or [])


def test_no_low_precision_recipe_is_ever_the_reference() -> None:
    runs = [_run("fp8-naive", 3.0), _run("fp8-tensorwise", 2.7)]
    got = dict(summary_verdicts(runs))
    assert all(v.startswith("no reference") for v in got.values()), got
    # a custom-named fp32 run is a reference by content
    base = _run("fp32", 2.5)
    base.config["train"]["recipe"] = "baseline"
    got = dict(summary_verdicts([*runs, base]))
    assert got["fp32"] == "reference" and got["fp8-naive"].startswith(
        "fails: +20.0% val loss vs baseline"
    )


def _gemm(layer: str, gemm: str, role: str, fmt: str, flushed: float, sat: float = 0.0) -> dict:
    op = {"format": fmt, "high_precision": False, "flushed": flushed, "saturated": sat,
          "sqnr_db": 3.0, "scale_min": 1.0, "scale_max": 1.0, "n_scales": 1}  # fmt: skip
    other = {**op, "flushed": 0.0, "format": "e4m3fn"}
    return {"step": 9, "layer": layer, "gemm": gemm, "rel_err": 0.5,
            "operands": {role: op, "weight": other}}  # fmt: skip


def test_a_failing_run_is_never_healthy_and_names_its_cause() -> None:
    gemms = [
        _gemm("blocks.0.fc", "input_grad", "grad_output", "e5m2", 0.63),
        _gemm("blocks.1.fc", "input_grad", "grad_output", "e5m2", 0.41),
        _gemm("blocks.0.fc", "forward", "input", "e4m3fn", 0.02),
    ]
    runs = [_run("fp32", 2.5), _run("fp8-naive", 2.8, gemms)]
    verdicts = dict(summary_verdicts(runs, {"fp32": 0.005}))
    notes = diagnose(runs[1], verdicts["fp8-naive"])
    text = " ".join(notes)
    assert notes[0] == "Verdict: fails: +12.0% val loss vs fp32."
    assert "Healthy" not in text
    assert notes[1].startswith("The measured cause: In blocks.0.fc's input-gradient GEMM")
    assert "63% of the gradients were flushed to zero by the cast to E5M2 (scale 1" in notes[1]
    assert "1 more of the 6 cast operands too" in notes[1]
    # Failing with nothing measured to explain it: still not healthy.
    bare = diagnose(_run("fp8-tensorwise", 3.0), "fails: +20.0% val loss vs fp32")
    assert not any("Healthy" in n for n in bare)
    # Passing, nothing flushed: healthy.
    ok = diagnose(_run("fp8-tensorwise", 2.5, [_gemm("a", "forward", "input", "e4m3fn", 0.0)]),
                  "matches fp32 (within seed spread ±0.5%)")  # fmt: skip
    assert any(n.startswith("Healthy") for n in ok)


def test_each_tensor_is_judged_in_the_format_it_is_stored_in() -> None:
    """A scalify run stores activations in FP16 but its weight gradients in FP32: an FP32
    gradient with 84% of its values below FP16's smallest normal is not an FP16 underflow;
    an FP16 one is."""

    def rec(name: str, kind: str, dtype: str, share: float) -> dict:
        shares = {"fp16": share, "bf16": 0.0, "e4m3fn": 1.0, "e5m2": share}
        return {"step": 9, "name": name, "kind": kind, "dtype": dtype,
                "below_normal": shares, "above_max": {k: 0.0 for k in shares}}  # fmt: skip

    run = _run("fp16-scalify", 2.5)
    run.numerics = [rec("w", "weight_grad", "float32", 0.84)]
    notes = diagnose(run, "matches fp32 (within seed spread ±0.9%)")
    assert not any("underflow in" in n for n in notes), notes
    run.numerics.append(rec("h", "grad_output", "float16", 0.5))
    notes = diagnose(run, "matches fp32 (within seed spread ±0.9%)")
    assert any(
        n.startswith("50% of the activation gradients of h underflow in fp16") for n in notes
    )
