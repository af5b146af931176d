"""The report never calls a failing run healthy nor blames the wrong cause (new-user
trial R): a forward overflow of FP16 is named as one (it read "the values diverged, which
no format's range explains"), a failure long after the last measurement is not blamed
on that measurement, a run whose NaN steps were skipped is not said to have stopped; a
reference is judged by its own evaluations too, a recipe with low-precision optimizer
states or loss scaling is no reference, NaN losses inside the metrics fail the run, and
malformed run files give an error naming the file and the value."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from lowprec.analysis.diagnosis import Run, diagnose
from lowprec.analysis.verdicts import is_reference_recipe, own_verdict
from lowprec.cli import main
from lowprec.jobs.report import load_run
from lowprec.jobs.run_summary import summary_of
from lowprec.jobs.rundir import RunError
from lowprec.recipes import get_recipe

TINY = [
    *("--steps", "3", "--batch-size", "2", "--seq-len", "16", "--width", "32", "--depth", "1"),
    *("--heads", "2", "--warmup", "1", "--eval-every", "3", "--eval-batches", "1"),
    "--no-progress",
]
FAILS = "fails: loss NaN/Inf at step 3"


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fp16") / "run"
    assert main(["train", *TINY, "--recipe", "fp16", "--out", str(d)]) == 0
    return d


def _with_nonfinite(run: Run, names: dict[tuple[str, str], float]) -> Run:
    """``run`` with the last step's tracked tensors ``(kind, name)`` given NaN/Inf shares."""
    last = run.tracked_steps[-1]
    recs = [
        {**r, "nonfinite": names.get((r["kind"], r["name"]), 0.0)} if r["step"] == last else r
        for r in run.numerics
    ]
    return dataclasses.replace(run, numerics=recs)


def test_a_forward_overflow_is_named_as_one(fp16_run: Path) -> None:
    """NaN/Inf first at an activation, every weight finite: an operation of the forward
    exceeded FP16's range, named between the last finite activation and the first
    non-finite one; the later gradients (100% NaN) do not lead."""
    run = _with_nonfinite(
        load_run(fp16_run),
        {("input", "blocks.0.attn.proj"): 0.11, ("output", "blocks.0.attn.proj"): 0.2,
         ("weight_grad", "head.weight"): 1.0},
    )  # fmt: skip
    notes = diagnose(run, FAILS)
    found = [n for n in notes if "NaN/Inf first appear" in n]
    assert len(found) == 1, notes
    note = found[0]
    assert note.startswith("NaN/Inf first appear in the inputs of blocks.0.attn.proj (11% of")
    assert "computed from the finite activations of blocks.0.attn.qkv" in note
    assert "exceeded FP16's range (max 65504)" in note
    assert "A loss scale does not change the forward" in note
    assert not any("no format's range explains" in n for n in notes)


def test_a_nan_weight_leads_whatever_its_place(fp16_run: Path) -> None:
    """A NaN/Inf weight came from an update: it leads even where a forward activation is
    listed before it."""
    run = _with_nonfinite(
        load_run(fp16_run),
        {("input", "blocks.0.attn.proj"): 0.1, ("weight", "head.weight"): 0.5},
    )
    note = next(n for n in diagnose(run, FAILS) if "NaN/Inf first appear" in n)
    assert note.startswith("NaN/Inf first appear in the weights of head.weight (50% of them)")
    assert "the weights themselves diverged" in note


def test_a_backward_overflow_without_loss_scaling(fp16_run: Path) -> None:
    run = _with_nonfinite(load_run(fp16_run), {("grad_output", "blocks.0.fc"): 0.3})
    note = next(n for n in diagnose(run, FAILS) if "NaN/Inf first appear" in n)
    assert "the forward finite: the backward overflowed FP16" in note


def test_a_failure_long_after_the_last_measurement_has_no_measured_cause(
    fp16_run: Path,
) -> None:
    """Numerics of step 0 only and a divergence 17 steps later: the measured underflow
    (the fp16 run has it at every step, healthy or not) is not the cause, and the advice
    to look at the learning rate is given."""
    run = load_run(fp16_run)
    last = run.tracked_steps[-1]
    first = [r for r in run.numerics if r["step"] == run.tracked_steps[0]]
    run = dataclasses.replace(
        run, numerics=first, summary={**run.summary, "diverged_at": last + 17}
    )
    notes = diagnose(run, FAILS)
    assert not any(n.startswith("The measured cause") for n in notes), notes
    assert any("explains a failure" in n and "learning rate" in n for n in notes), notes


def test_skipped_steps_of_a_run_that_finished_are_not_a_stop(fp16_run: Path) -> None:
    """``--on-nonfinite skip``: the run diverged (NaN losses) but ran every planned step."""
    run = load_run(fp16_run)
    steps = run.planned_steps
    assert steps is not None
    s = {**run.summary, "diverged_at": 2, "skipped_steps": 2, "steps": steps}
    notes = diagnose(dataclasses.replace(run, summary=s), FAILS)
    skipped = next(n for n in notes if "were not applied" in n)
    assert "(`--on-nonfinite skip`)" in skipped and "stopped" not in skipped
    stopped = diagnose(dataclasses.replace(run, summary={**s, "steps": steps - 1}), FAILS)
    assert any("the run stopped at the last" in n for n in stopped)


# ---- verdicts ------------------------------------------------------------------------------


def _recs(losses: list[float], vals: dict[int, float]) -> list[dict[str, Any]]:
    out = []
    for i, loss in enumerate(losses, start=1):
        r: dict[str, Any] = {"step": i, "loss": loss, "skipped": False,
                             "grad_zero_share": 0.0, "step_time": 0.1}  # fmt: skip
        if i in vals:
            r["val_loss"] = vals[i]
        out.append(r)
    return out


CFG = {"train": {"recipe": "fp32", "steps": 30}}
FALLING = [4.2 - 0.03 * i for i in range(30)]


def test_a_reference_is_judged_by_its_own_evaluations() -> None:
    """A val loss that ends 3x above its best fails (it read "reference"/"Healthy", and
    every other run was judged against it); a small rise (noise, 3%) does not."""
    bad = summary_of(_recs(FALLING, {10: 3.9, 20: 3.25, 30: 9.0}), CFG)
    assert own_verdict(bad) == (
        "fails: val loss rose from 3.25 at step 20 to 9 at the end (diverging or overfitting)"
    )
    ok = summary_of(_recs(FALLING, {10: 3.9, 20: 3.25, 30: 3.35}), CFG)
    assert own_verdict(ok) is None


def test_nan_losses_inside_the_metrics_fail_the_run() -> None:
    losses = [math.nan if 11 <= i <= 20 else x for i, x in enumerate(FALLING, start=1)]
    s = summary_of(_recs(losses, {30: 3.3}), CFG)
    assert s["diverged_at"] is None
    assert own_verdict(s) == "fails: loss NaN/Inf at 10 steps not skipped (the first at step 11)"
    skipped = [{**r, "skipped": not math.isfinite(r["loss"])} for r in _recs(losses, {30: 3.3})]
    assert own_verdict(summary_of(skipped, CFG)) is None  # skipped steps are reported apart
    mid_val = summary_of(_recs(FALLING, {10: 3.9, 20: math.nan, 30: 3.3}), CFG)
    assert own_verdict(mid_val) == "fails: val loss NaN/Inf at step 20"


@pytest.mark.parametrize(
    ("change", "reference"),
    [({}, True), ({"optimizer_state": "8bit"}, False), ({"optimizer_state": "bf16"}, False),
     ({"optimizer_state": "fp32"}, True), ({"loss_scaling": "static"}, False),
     ({"stochastic_rounding": True}, False), ({"param_dtype": "bf16"}, False)],
)  # fmt: skip
def test_a_reference_trains_every_state_in_fp32(change: dict[str, Any], reference: bool) -> None:
    assert is_reference_recipe({**get_recipe("fp32").to_dict(), **change}) is reference


# ---- malformed files --------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("value", [None, "abc", True])
def test_a_non_numeric_val_loss_names_the_file(fp16_run: Path, tmp_path: Path, value: Any) -> None:
    d = _copy(fp16_run, tmp_path / "run")
    lines = (d / "metrics.jsonl").read_text().splitlines()
    rec = json.loads(lines[-1])
    assert "val_loss" in rec
    lines[-1] = json.dumps({**rec, "val_loss": value})
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RunError, match=r"metrics\.jsonl: record 3 has a non-numeric val_loss"):
        load_run(d)


@pytest.mark.parametrize(
    ("operands", "why"),
    [(None, "operands that are not an object"),
     ({"input": None}, "operand 'input' that is not an object"),
     ({"input": {"flushed": "lots"}}, "non-numeric flushed of operand 'input'"),
     ({"input": {"sqnr_db": "x"}}, "non-numeric sqnr_db of operand 'input'")],
)  # fmt: skip
def test_a_malformed_gemm_record_names_the_file(
    fp16_run: Path, tmp_path: Path, operands: Any, why: str
) -> None:
    d = _copy(fp16_run, tmp_path / "run")
    rec = {"step": 0, "layer": "x", "gemm": "forward", "operands": operands}
    (d / "gemms.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(RunError, match=rf"gemms\.jsonl: record 1 has (a )?{why}"):
        load_run(d)
    ok = {"step": 0, "layer": "x", "gemm": "forward",
          "operands": {"input": {"flushed": 0.1, "sqnr_db": None}}}  # fmt: skip
    (d / "gemms.jsonl").write_text(json.dumps(ok) + "\n")
    load_run(d)
