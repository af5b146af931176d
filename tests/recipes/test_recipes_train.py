"""End-to-end: the unit-scaled and scalify recipes train the reference task.

Same seed, data, steps and learning rate for every recipe of a comparison. The bar is the
issues' 1% of val loss. Across seeds the standard model's val loss spreads about ±0.3% at
the demo scale, so for the scalify recipes noise alone does not reach 1%. The unit-scaled
model spreads more at the demo's 300 steps (±1–2% across seeds, README), where its loss is
still falling steeply. At this 120-step config the measured gaps are well inside the bar
(fp16-unit −0.01%, fp8-unit +0.03% against fp32-unit), and every run here is seeded, so
the result does not change from run to run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lowprec.jobs.train import train
from tests._helpers import REFERENCE_TASK

CFG = REFERENCE_TASK


def _val(name: str, tmp_path: Path) -> float:
    return float(train(replace(CFG, recipe=name), tmp_path / name, progress=False)["val_loss"])


@pytest.mark.slow
def test_unit_scaled_fp16_and_fp8_match_fp32_unit(tmp_path: Path) -> None:
    """fp16-unit and fp8-unit (no loss scaling, no per-tensor scales) end within 1% of the
    unit-scaled FP32 model; the unit-scaled FP32 model itself is compared with the standard
    FP32 model (the README reports the gap at the demo scale)."""
    ref = _val("fp32-unit", tmp_path)
    for name in ("fp16-unit", "fp8-unit"):
        got = _val(name, tmp_path)
        assert abs(got / ref - 1) < 0.01, (name, got, ref)
    std = _val("fp32", tmp_path)
    # Not the bar (that is against fp32-unit): a guard that unit scaling with u-μP
    # learning rates trains about as well as the standard model (a broken lr rule or scale
    # shows up as a gap of tens of percent at this length).
    assert abs(ref / std - 1) < 0.05, (ref, std)


@pytest.mark.slow
def test_scalify_recipes_match_fp32(tmp_path: Path) -> None:
    """fp16-scalify and fp8-scalify (standard model, no unit scaling, no loss scaling) end
    within 1% of FP32."""
    ref = _val("fp32", tmp_path)
    for name in ("fp16-scalify", "fp8-scalify"):
        got = _val(name, tmp_path)
        assert abs(got / ref - 1) < 0.01, (name, got, ref)
