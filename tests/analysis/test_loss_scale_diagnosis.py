"""NaN/Inf gradients of a run whose loss scaler skipped its steps are the loss scale's
overflow of the format, not a divergence (new-user trial B, F2); percentages in the
report's sentences never print with an exponent (F3)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lowprec.analysis.diagnosis import diagnose
from lowprec.cli import main
from lowprec.jobs.report import load_run
from lowprec.recipes import get_recipe

TINY = [
    *("--steps", "3", "--batch-size", "2", "--seq-len", "16", "--width", "32", "--depth", "1"),
    *("--heads", "2", "--warmup", "1", "--eval-every", "3", "--eval-batches", "1"),
    "--no-progress",
]


@pytest.fixture(scope="module")
def huge_scale_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fp16 with a static loss scale of 2^40: every step's scaled gradients overflow."""
    d = tmp_path_factory.mktemp("hugels")
    recipe = {**get_recipe("fp16-static-ls").to_dict(), "name": "fp16-hugels"}
    (d / "hugels.json").write_text(json.dumps({**recipe, "loss_scale": 2.0**40}))
    assert main(["train", *TINY, "--recipe", str(d / "hugels.json"), "--out", str(d / "run")]) == 0
    return d / "run"


def _nan_note(notes: list[str]) -> str:
    found = [n for n in notes if "NaN/Inf first appear" in n]
    assert len(found) == 1, notes
    return found[0]


def test_skipped_steps_blame_the_loss_scale_not_a_divergence(huge_scale_run: Path) -> None:
    run = load_run(huge_scale_run)
    assert run.summary["skipped_steps"] == 3
    note = _nan_note(diagnose(run))
    assert "diverged" not in note, note
    assert "skipped all 3 steps (no update applied)" in note, note
    assert "static loss scale 2^40" in note and "overflow FP16 (max 65504)" in note, note


def test_nan_weights_or_no_skips_still_read_as_a_divergence(huge_scale_run: Path) -> None:
    """The rule is not this run's: a NaN weight (an update made it NaN) is a divergence of
    the weights; a run whose scaler skipped nothing overflowed in its backward."""
    run = load_run(huge_scale_run)
    last = run.tracked_steps[-1]
    weight = next(r for r in run.numerics if r["step"] == last and r["kind"] == "weight")
    nan_weight = {**weight, "nonfinite": 1.0}
    diverged = dataclasses.replace(run, numerics=[*run.numerics, nan_weight])
    assert "the weights themselves diverged" in _nan_note(diagnose(diverged))
    unskipped = dataclasses.replace(run, metrics=[{**m, "skipped": False} for m in run.metrics])
    assert "the backward overflowed FP16" in _nan_note(diagnose(unskipped))


@pytest.mark.parametrize(
    ("share", "text"),
    [(0.9993, "99.9%"), (1.0, "100%"), (0.99996, "100%"), (0.00123, "0.123%"), (0.0, "0%"),
     (1e-8, "<0.001%"), (0.5, "50%")],
)  # fmt: skip
def test_percent_never_prints_an_exponent(share: float, text: str) -> None:
    from lowprec.analysis.verdicts import percent

    assert percent(share) == text
