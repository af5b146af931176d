"""What the report states about a set of runs (lowprec.analysis.diagnosis,
lowprec.jobs.report_tables, lowprec.jobs.run_summary.summary_of), on synthetic runs: each
statement checked against the numbers it is computed from."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest

from lowprec.analysis.diagnosis import (
    Run,
    diagnose,
    gemm_findings,
)
from lowprec.analysis.run_verdicts import references, settings_differ, summary_verdicts
from lowprec.analysis.verdicts import failing
from lowprec.jobs.report_tables import summary_rows
from lowprec.jobs.run_summary import summary_cells, summary_of
from lowprec.recipes import get_recipe

_TRAIN = {"model": "reference", "steps": 30, "batch_size": 8, "seq_len": 64, "width": 64,
          "depth": 2, "heads": 4, "lr": 0.003, "warmup": 16, "seed": 0, "eval_batches": 2,
          "eval_every": 10, "ckpt_every": 30, "gemms_every": 50}  # fmt: skip
_GAP = 5  # the summary table's "gap to reference" column


def _run(recipe: str, val: float | None, name: str = "", **train: Any) -> Run:
    recipe_dict = get_recipe(recipe).to_dict()
    config = {"train": {**_TRAIN, "recipe": recipe, **train}, "recipe": recipe_dict}
    summary = {"val_loss": math.nan if val is None else val, "evaluated": val is not None,
               "act_grad_underflow": 0.0, "skipped_steps": 0, "steps": 30}  # fmt: skip
    return Run(Path(name or recipe), config, [], summary)


def test_the_gap_column_uses_each_runs_verdict_reference_in_any_order() -> None:
    """A unit-scaled run's gap is to fp32-unit (its verdict's reference), every other's to
    fp32, whatever the order of the runs (the column took the first reference for all)."""
    runs = [_run("fp32", 2.0), _run("fp32-unit", 1.8), _run("fp8-unit", 1.8018),
            _run("bf16", 2.01)]  # fmt: skip
    for order in itertools.permutations(runs):
        rows = {r[0]: r for r in summary_rows(order)}
        verdicts = dict(summary_verdicts(order, {"fp32": 0.01, "fp32-unit": 0.01}))
        assert rows["fp8-unit"][_GAP] == "+0.10% (fp32-unit)"
        assert verdicts["fp8-unit"] == "matches fp32-unit (within seed spread ±1%)"
        assert rows["bf16"][_GAP] == "+0.50% (fp32)"
        assert rows["fp32"][_GAP] == rows["fp32-unit"][_GAP] == "reference"
        pairs = zip(order, references(order), strict=True)
        refs = {r.name: None if x is None else x.name for r, x in pairs}
        assert refs == {"fp32": None, "fp32-unit": None, "fp8-unit": "fp32-unit", "bf16": "fp32"}


def test_the_reference_is_the_one_trained_with_the_runs_settings() -> None:
    """Two fp32 runs, one at another learning rate: each run is judged against the fp32
    run with its own settings, in any order (the first fp32 run was taken for all: the
    others read "not judged" or a gap to the wrong run, -1.07% for a failing one)."""
    odd, ref = _run("fp32", 3.35, name="fp32-lr0.3", lr=0.3), _run("fp32", 2.0, name="fp32")
    bad = _run("fp8-naive", 2.42)
    for order in itertools.permutations([odd, ref, bad]):
        got = dict(summary_verdicts(order, {"fp32": 0.01}))
        assert got["fp8-naive"] == "fails: +21.0% val loss vs fp32"
        rows = {r[0]: r for r in summary_rows(order)}
        assert rows["fp8-naive"][_GAP] == "+21.00% (fp32)"
        assert (
            dict(zip([r.name for r in order], references(order), strict=True))["fp8-naive"] is ref
        )
    # only the other-settings reference: not judged, naming the difference
    assert dict(summary_verdicts([odd, bad]))["fp8-naive"].startswith("not judged")


def test_a_unit_run_is_never_judged_against_plain_fp32() -> None:
    """fp32-unit trains another model than fp32 (3.7% lower val loss at the demo's 80
    steps): a unit-scaled run in a set without fp32-unit gets no reference (it read
    "-7.5% vs fp32", which would pass a failing fp8-unit run)."""
    got = dict(summary_verdicts([_run("fp32", 2.0), _run("fp8-unit", 1.85)], {"fp32": 0.01}))
    assert got["fp8-unit"].startswith("no reference") and not failing(got["fp8-unit"])
    assert "matches" not in got["fp8-unit"] and "better" not in got["fp8-unit"]
    assert references([_run("fp32", 2.0), _run("fp8-unit", 1.85)])[1] is None


def test_runs_trained_with_other_settings_are_not_judged() -> None:
    """A shorter run is not 'failing' against a longer reference: the verdict names the
    settings that differ, the page shows no cause table for it and never calls it
    healthy or failing; a run that diverged still fails, whatever its settings."""
    ref = _run("fp32", 2.0)
    short = _run("fp8-delayed", 2.3, steps=15, lr=0.01)
    assert settings_differ(short, ref) == ["steps 15 vs 30", "lr 0.01 vs 0.003"]
    assert settings_differ(_run("bf16", 2.0, eval_every=5, ckpt_every=2), ref) == []
    # a value that prints as the reference's (a hand-edited config): quoted, not "30 vs 30"
    assert settings_differ(_run("bf16", 2.0, steps="30"), ref) == ["steps '30' vs 30"]
    got = dict(summary_verdicts([ref, short], {"fp32": 0.01}))
    assert got["fp8-delayed"] == (
        "not judged: trained with other settings than fp32 (steps 15 vs 30; lr 0.01 vs 0.003)"
    )
    assert not failing(got["fp8-delayed"])
    notes = diagnose(short, got["fp8-delayed"])
    assert notes[0] == f"Verdict: {got['fp8-delayed']}."
    assert not any(n.startswith("Healthy") and "not judged" not in n for n in notes), notes
    gone = _run("fp8-naive", math.nan, seed=4)
    gone.summary["diverged_at"] = 3
    assert dict(summary_verdicts([ref, gone]))["fp8-naive"] == "fails: loss NaN/Inf at step 3"
    # the same settings: judged as before
    assert (
        dict(summary_verdicts([ref, _run("fp8-delayed", 2.3)], {"fp32": 0.01}))["fp8-delayed"]
        == "fails: +15.0% val loss vs fp32"
    )


def test_a_run_is_not_failed_by_its_diverged_reference() -> None:
    """The reference's val loss is NaN (it diverged): a run with a finite val loss is not
    judged (it read "fails: no finite val loss"), and says why; one with none still fails."""
    ref = _run("fp32", math.nan)
    ref.summary["diverged_at"] = 7
    got = dict(summary_verdicts([ref, _run("bf16", 2.0), _run("fp8-naive", math.nan)]))
    assert got["fp32"] == "fails: loss NaN/Inf at step 7"
    assert got["bf16"] == "not judged: its reference fp32 fails (loss NaN/Inf at step 7)"
    assert got["fp8-naive"] == "fails: no finite val loss"


def test_a_run_never_evaluated_is_not_judged() -> None:
    got = dict(summary_verdicts([_run("fp32", 2.0), _run("bf16", None)]))
    assert got["bf16"] == "not judged: no val loss recorded (bf16)"
    got = dict(summary_verdicts([_run("fp32", None), _run("bf16", 2.0)]))
    assert got["bf16"] == "not judged: no val loss recorded (fp32)"


def _rec(step: int, underflow: float, skipped: bool = False, **extra: Any) -> dict[str, Any]:
    return {"step": step, "loss": math.nan if skipped else 4.0, "skipped": skipped,
            "step_time": 0.1, "grad_zero_share": 0.5 if skipped else 0.01,
            "act_grad_underflow": underflow, "act_grad_zero": 0.0 if skipped else 0.02,
            **extra}  # fmt: skip


def test_summary_shares_are_means_over_the_steps_applied() -> None:
    """A skipped step's gradients hold Inf/NaN: its recorded shares (0 underflow) measure
    nothing and no longer dilute the run's mean (fp16-pure's 79% read 39.5%)."""
    cfg = {"train": {"recipe": "fp16-pure"}}
    recs = [_rec(1, 0.79), _rec(2, 0.0, skipped=True, stopped="nonfinite")]
    s = summary_of(recs, cfg)
    assert s["act_grad_underflow"] == pytest.approx(0.79, abs=0)
    assert s["grad_zero_share"] == 0.01 and s["act_grad_zero"] == 0.02
    assert s["skipped_steps"] == 1 and s["diverged_at"] == 2
    recs = [_rec(1, 0.6), _rec(2, 0.0, True), _rec(3, 0.0, True), _rec(4, 0.8)]
    assert summary_of(recs, cfg)["act_grad_underflow"] == pytest.approx(0.7, abs=1e-15)
    nothing = summary_of([_rec(1, 0.0, True)], cfg)
    assert math.isnan(nothing["act_grad_underflow"])
    cells = summary_cells(nothing)
    assert cells["act-grad underflow"] == "–" and cells["act-grad zeros"] == "–"
    assert math.isnan(nothing["val_loss"]) and not nothing["evaluated"]
    assert cells["val loss"] == "–" == cells["val bpc"]
    evald = summary_of([_rec(1, 0.3, val_loss=2.0)], cfg)
    assert evald["evaluated"] and summary_cells(evald)["val loss"] == "2.0000"
    diverged = summary_of([_rec(1, 0.3, val_loss=math.nan)], cfg)  # evaluated: NaN shown
    assert summary_cells(diverged)["val loss"] == "nan"


@pytest.mark.parametrize(
    ("recipe", "said", "not_said"),
    [
        ("fp16-dynamic-ls", "The loss scaler skipped 2 step(s)", "no loss scaling"),
        ("fp16-static-ls", "static loss scale is too high", "finds its level"),
        ("fp16-pure", "2 step(s) had Inf/NaN gradients and were not applied", "loss scaler"),
    ],
)
def test_skipped_steps_are_explained_by_the_recipes_loss_scaling(
    recipe: str, said: str, not_said: str
) -> None:
    run = _run(recipe, 2.0)
    run.summary["skipped_steps"] = 2
    text = " ".join(diagnose(run, "matches fp32 (within seed spread ±1%)"))
    assert said in text and not_said not in text, text
    if recipe == "fp16-pure":
        assert "(`--on-nonfinite skip`)" in text
        run.summary["diverged_at"] = 5  # a NaN/Inf at step 5, skipped, the run went on
        assert "the run stopped at the last" not in " ".join(diagnose(run))
        run.summary["steps"] = 5  # the run stopped there
        assert "the run stopped at the last" in " ".join(diagnose(run))


def test_a_gemm_finding_prints_the_share_it_alerts_on() -> None:
    """0.098% saturated is above the 1e-4 alert: the finding says 0.098%, not 0%."""
    op = {"format": "e4m3fn", "high_precision": False, "flushed": 0.0, "saturated": 0.00098,
          "sqnr_db": 30.0, "scale_min": 1.0, "scale_max": 1.0, "n_scales": 1}  # fmt: skip
    run = _run("fp8-tensorwise", 2.0)
    run.gemms = [{"step": 4, "layer": "q", "gemm": "input_grad", "rel_err": 0.1,
                  "operands": {"grad_output": op, "weight": {**op, "saturated": 0.0}}}]  # fmt: skip
    found = gemm_findings(run)
    assert found and "0.098% of the gradients were saturated" in found[0], found


# ---- the loss curve and the step of the comparison ------------------------------------


def _curve_run(
    recipe: str, losses: list[float], vals: dict[int, float], name: str = "", **train: Any
) -> Run:
    """A run whose metrics records hold ``losses`` (one per step) and ``vals`` (val loss by
    step); its summary is ``summary_of`` them, as ``lowprec report`` computes it."""
    steps = train.pop("steps", len(losses))
    config = {"train": {**_TRAIN, "recipe": recipe, "steps": steps, **train},
              "recipe": get_recipe(recipe).to_dict()}  # fmt: skip
    recs: list[dict[str, Any]] = []
    for i, loss in enumerate(losses, start=1):  # metrics steps count from 1
        rec = {"step": i, "loss": loss, "skipped": False, "grad_zero_share": 0.0,
               "step_time": 0.01, "act_grad_underflow": 0.0}  # fmt: skip
        if i in vals:
            rec["val_loss"] = vals[i]
        recs.append(rec)
    return Run(Path(name or recipe), config, recs, summary_of(recs, config))


def _falling(n: int, start: float = 4.17, end: float = 2.9) -> list[float]:
    return [start + (end - start) * i / (n - 1) for i in range(n)]


def _rising(n: int) -> list[float]:  # learns, then diverges far above the start
    return _falling(n // 2) + [3.0 * 1.3**i for i in range(n - n // 2)]


def test_a_diverging_reference_fails_and_judges_nothing() -> None:
    """fp32 at a learning rate that diverges (the loss climbs from 4.2 to ~200, finite):
    it read "reference", and the report called it healthy; a bf16 run that diverged the
    same way was "-6.5% vs fp32 ... Healthy". Both now fail by their own curves, and a run
    that trained well is not judged against the failed reference."""
    ref = _curve_run("fp32", _rising(40), {40: 233.6})
    bad = _curve_run("bf16", _rising(40), {40: 218.4})
    good = _curve_run("fp8-tensorwise", _falling(40), {40: 2.9})
    got = dict(summary_verdicts([ref, bad, good], {"fp32": 0.01}))
    assert got["fp32"].startswith("fails: loss rose from 4.17 at the start to "), got
    assert got["fp32"].endswith(": diverging")
    assert got["bf16"].startswith("fails: loss rose from 4.17"), got
    assert got["fp8-tensorwise"].startswith("not judged: its reference fp32 fails (loss rose")
    for run, (_, text) in zip((ref, bad, good), summary_verdicts([ref, bad, good]), strict=True):
        notes = diagnose(run, text)
        assert not any(n.startswith("Healthy") and "not judged" not in n for n in notes), notes


def test_a_loss_that_rises_from_its_best_fails() -> None:
    """A loss that falls to 2.0 and climbs back to 3.5 (below its start of 4.17; the last
    10 steps' mean 3.14 is 43% above the best 10 steps' 2.19) is diverging; a run that
    ends 10% above its best is noise."""
    back = _falling(20, 4.17, 2.0) + _falling(20, 2.0, 3.5)
    ref = _curve_run("fp32", _falling(40), {40: 2.9})
    got = dict(summary_verdicts([ref, _curve_run("bf16", back, {40: 3.4})]))
    assert got["bf16"] == (
        "fails: loss rose from 4.17 at the start to 3.14 at the end (best 2.19): diverging"
    ), got
    wobble = _falling(30, 4.17, 2.0) + [2.2] * 10  # end 2.2 = best 2.0 x 1.1: not diverging
    got = dict(summary_verdicts([ref, _curve_run("bf16", wobble, {40: 2.92})], {"fp32": 0.01}))
    assert got["bf16"].startswith("matches fp32"), got


def test_a_run_that_does_not_learn_fails() -> None:
    """lr 1e-30: the loss stays at 4.18 for 40 steps. It read "reference. Healthy" (fp32)
    and "+0.0% vs fp32 ... Healthy" (bf16). From 20 steps on, a loss that fell by less
    than 1% is not learning; a run of 12 steps is not judged by that (its loss may fall
    slowly in warm-up), and a 40-step run that fell 2% is learning."""
    flat = [4.178 + 0.01 * math.sin(i) for i in range(40)]
    ref = _curve_run("fp32", flat, {40: 4.19})
    got = dict(summary_verdicts([ref, _curve_run("bf16", list(flat), {40: 4.19})]))
    assert (
        got["fp32"].startswith("fails: loss 4.18 at the start, ") and "not learning" in got["fp32"]
    )
    assert got["bf16"].startswith("fails: loss 4.18") and got["bf16"].endswith("not learning")
    short = _curve_run("fp32", flat[:12], {12: 4.19})
    assert dict(summary_verdicts([short]))["fp32"] == "reference"
    slow = _curve_run("fp32", _falling(40, 4.17, 4.08), {40: 4.1})
    assert dict(summary_verdicts([slow]))["fp32"] == "reference"


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_a_run_of_a_few_steps_is_not_judged(steps: int) -> None:
    """A run of 1-3 steps was judged "+0.0% ... Healthy": its loss curve shows nothing,
    so it is not judged, and the numerics finding says so."""
    ref = _curve_run("fp32", _falling(40), {40: 2.9})
    run = _curve_run("bf16", _falling(40)[:steps], {steps: 4.0}, steps=steps)
    got = dict(summary_verdicts([ref, run]))
    plural = "" if steps == 1 else "s"
    assert got["bf16"] == f"not judged: too short ({steps} step{plural}; the loss curve needs 4)"
    run.numerics = [{"step": steps, "name": "h", "kind": "grad_output", "dtype": "bfloat16",
                     "below_normal": {"bf16": 0.0}, "above_max": {"bf16": 0.0}}]  # fmt: skip
    notes = diagnose(run, got["bf16"])
    assert any(n.startswith("Healthy") and "its loss is not judged (too short" in n for n in notes)


def test_val_losses_are_compared_at_the_same_step() -> None:
    """An interrupted run (20 of 40 steps) was judged by its step-20 val loss against the
    reference's step-40 one (-2.3% where the same-step gap was ~0; +3.5% for a run whose
    torn last line dropped its final evaluation). It is now compared with the reference's
    val loss at its own last evaluation, and says where; a reference that stopped before
    the run's step cannot judge it."""
    ref = _curve_run("fp32", _falling(40), {10: 3.8, 20: 3.4, 30: 3.1, 40: 2.9})
    cut = _curve_run("bf16", _falling(20), {10: 3.8, 20: 3.434}, steps=40)
    got = dict(summary_verdicts([ref, cut], {"fp32": 0.02}))
    assert got["bf16"] == "matches fp32 (within seed spread ±2%) (at step 20, where it stopped)"
    row = {r[0]: r for r in summary_rows([ref, cut])}["bf16"]
    assert row[_GAP] == "+1.00% (fp32, step 20)"
    short_ref = _curve_run("fp32", _falling(40)[:10], {10: 3.8}, steps=40)
    got = dict(summary_verdicts([short_ref, cut], {"fp32": 0.02}))
    assert got["bf16"] == "not judged: fp32 has no val loss at step 20 (its last at step 10)"


def test_a_diverged_run_measured_long_before_says_so() -> None:
    """fp16 at lr 3: NaN at step 8, numerics measured at step 0 only. The report blamed
    step 0's underflow ("use loss scaling") for the failure; it now says the measurements
    are from 8 steps before the divergence. A dynamic loss scaler's skipped steps in a
    diverged run are not called expected."""
    run = _curve_run("fp16-dynamic-ls", [4.17] * 8 + [math.nan] * 4, {})
    run.summary["diverged_at"] = 8
    run.summary["skipped_steps"] = 4
    run.numerics = [{"step": 0, "name": "h", "kind": "grad_output", "dtype": "float16",
                     "below_normal": {"fp16": 0.97}, "above_max": {"fp16": 0.0}}]  # fmt: skip
    notes = diagnose(run, "fails: loss NaN/Inf at step 8")
    assert any(
        n.startswith("The numerics were last measured at step 0, 8 steps before") for n in notes
    )
    assert not any("expected while a dynamic loss scale" in n for n in notes), notes
    assert any("diverged all the same" in n for n in notes), notes
    # a loss-scaled run is not told to use loss scaling
    assert any("its loss scaling notwithstanding" in n for n in notes), notes
    assert not any("use loss scaling with skipped steps" in n for n in notes), notes


def test_the_demo_judges_each_runs_curve_and_its_references() -> None:
    """The demo's table (demo_judge.judge) follows the same rules as the report: a
    reference that does not learn fails, and the runs against it are not judged (they
    read "matches fp32" against it); a run whose own curve diverges fails."""
    from lowprec.jobs.demo_judge import judge
    from lowprec.jobs.run_summary import loss_curve

    def result(recipe: str, losses: list[float], val: float) -> dict[str, Any]:
        return {"recipe": recipe, "val_loss": val, "diverged_at": None, "skipped_steps": 0,
                "act_grad_underflow": 0.0, **loss_curve(losses)}  # fmt: skip

    flat = [4.18] * 40
    results = [result("fp32", flat, 4.18), result("bf16", flat, 4.18),
               result("fp8-tensorwise", _falling(40), 2.9)]  # fmt: skip
    judge(results, {"fp32": 0.01})
    got = {r["recipe"]: r["verdict"] for r in results}
    assert got["fp32"].endswith("(40 steps): not learning"), got
    assert got["bf16"].endswith("not learning"), got
    assert got["fp8-tensorwise"].startswith("not judged: its reference fp32 fails (loss 4.18")
    results = [result("fp32", _falling(40), 2.9), result("bf16", _rising(40), 200.0),
               result("fp8-tensorwise", _falling(40), 2.9)]  # fmt: skip
    judge(results, {"fp32": 0.01})
    got = {r["recipe"]: r["verdict"] for r in results}
    assert got["fp32"] == "reference" and got["bf16"].endswith(": diverging"), got
    assert got["fp8-tensorwise"] == "matches fp32 (within seed spread ±1%)"


def test_a_run_that_skipped_nan_losses_until_it_stopped_diverged_at_the_first() -> None:
    """fp16-dynamic-ls at lr 3: the loss NaN at every step from 15, the run stopped at 39
    (25 skips in a row). It read "fails: loss NaN/Inf at step 39"; it diverged at 15. A
    stop on NaN gradients with a finite loss stays at the stop's step."""
    recs: list[dict[str, Any]] = [{"step": i, "loss": 4.0 - 0.01 * i} for i in range(1, 15)]
    recs += [{"step": i, "loss": math.nan} for i in range(15, 40)]
    recs[-1]["stopped"] = "nonfinite"
    from lowprec.jobs.run_summary import diverged_at

    assert diverged_at(recs) == 15
    grads = [{"step": i, "loss": 3.0} for i in range(1, 6)]
    grads[-1]["stopped"] = "nonfinite"
    assert diverged_at(grads) == 5
    one = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": math.inf, "stopped": "nonfinite"}]
    assert diverged_at(one) == 2
