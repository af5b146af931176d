"""Placed interrupts (issue 39): ``scripts/interrupt_stress.py`` places SIGINT, SIGTERM and
SIGKILL at named points inside the steps of ``lowprec train`` (start-up, forward,
backward, optimizer step, loss-scaler update, master-weight write-back, checkpoint
write, metrics append; :mod:`lowprec._faults`), resumes, and compares every logged step
(loss, val loss, loss scale, skipped) bit for bit with an uninterrupted run, for every
recipe family (mixed precision FP16/BF16, float8 delayed and static, unit scaling,
scalify). CI runs a bounded count; ``python scripts/interrupt_stress.py --trials 260
--chain 2 --jobs 2 --threads 1 --seed 1 --out DIR`` is the local run
(``docs/reliability.md``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowprec import _faults
from lowprec.jobs.rundir import RunError
from lowprec.jobs.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]

TINY = TrainConfig(steps=4, batch_size=4, seq_len=16, width=32, depth=1, heads=2, warmup=1,
                   eval_every=2, eval_batches=1, ckpt_every=2)  # fmt: skip


@pytest.mark.slow
def test_placed_interrupts_resume_bit_exactly(tmp_path: Path) -> None:
    out = tmp_path / "stress"
    cmd = [
        *(sys.executable, str(ROOT / "scripts" / "interrupt_stress.py"), "--trials", "12"),
        *("--chain", "2", "--jobs", "2", "--threads", "1", "--seed", "7", "--out", str(out)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    res = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert res["inexact"] == []
    # the faults did land: most placed faults fire (a point a recipe never reaches, e.g.
    # the master write-back without master weights, or a late k, does not)
    assert res["interrupts"] >= 8, res["summary"]
    assert set(res["summary"]) == {
        "fp16-dynamic-ls", "bf16", "fp8-delayed", "fp8-static", "fp8-unit", "fp16-scalify",
    }  # fmt: skip


def test_faults_arm_and_refuse_bad_specs() -> None:
    for bad in ("nowhere:1:int", "forward:0:int", "forward:x:int", "forward:1:hup", "forward"):
        with pytest.raises(ValueError, match="LOWPREC_FAULT"):
            _faults.arm(bad)
    _faults.arm(None)
    _faults.point("forward")  # unarmed: nothing happens


def test_a_run_killed_before_its_first_step_restarts_with_the_same_command(
    tmp_path: Path,
) -> None:
    # A kill at start-up leaves config.json (or its temporary file) and empty logs: the
    # same command, without --resume, starts it again instead of refusing the directory.
    ref = train(TINY, tmp_path / "ref", progress=False)
    for leftovers in ({"config.json": "{}", "metrics.jsonl": ""}, {"config.json.tmp": "{"}):
        out = tmp_path / f"killed{len(leftovers)}"
        out.mkdir()
        for name, text in leftovers.items():
            (out / name).write_text(text)
        assert train(TINY, out, progress=False)["val_loss"] == ref["val_loss"]
    # anything more (a logged step, a checkpoint, a file of the user's) is refused as before
    for extra in ({"metrics.jsonl": '{"step": 1}\n'}, {"notes.txt": "mine"}):
        out = tmp_path / f"kept-{next(iter(extra))}"
        out.mkdir()
        (out / "config.json").write_text("{}")
        for name, text in extra.items():
            (out / name).write_text(text)
        with pytest.raises(RunError, match="already exists; pass --resume"):
            train(TINY, out, progress=False)
        assert (out / next(iter(extra))).exists()


@pytest.mark.parametrize("stop", [1, 2, 3, 4, 5])
def test_resume_inside_the_static_calibration_is_exact(tmp_path: Path, stop: int) -> None:
    # fp8-static calibrates its scales on the first 4 batches. A checkpoint taken before
    # they end (a SIGINT at step 1..3) froze the scales at the partial maxima on load:
    # the stress test found losses off from step 3 (4.01934 vs 4.01941). The checkpoint now
    # holds the calibration's progress, and the resumed run goes on calibrating.
    cfg = TrainConfig(steps=8, batch_size=4, seq_len=16, width=32, depth=1, heads=2,
                      warmup=1, eval_every=4, eval_batches=1, ckpt_every=8,
                      recipe="fp8-static")  # fmt: skip
    straight = tmp_path / "straight"
    train(cfg, straight, progress=False)
    out = tmp_path / f"stop{stop}"
    assert train(cfg, out, progress=False, stop_after=stop) == {"stopped_at": stop}
    train(cfg, out, resume=True, progress=False)
    keys = ("step", "loss", "val_loss", "loss_scale", "skipped", "grad_norm")

    def logged(d: Path) -> list[tuple[object, ...]]:
        recs = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return [tuple(r.get(k) for k in keys) for r in recs]

    assert logged(out) == logged(straight)
