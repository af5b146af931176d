"""Real signals at random moments of ``python -m lowprec train``, then resume until done.

Per recipe family (mixed precision, float8 delayed scaling, unit scaling, scalify) an
uninterrupted run gives the reference; then two trials each interrupt a run and its
resume at seeded random moments:

* trial 0: SIGINT during the run, SIGKILL during the resume, resume to the end;
* trial 1: SIGKILL during the run, two SIGINTs (an abort) during the resume, resume to
  the end.

After every interruption the run directory must hold steps ``1..m`` exactly once with the
reference's losses (``m`` at least the checkpoint's step: a kill during a resume loses no
history), and a SIGINT must stop at a step boundary with its checkpoint at the last logged
step. At the end every step is logged exactly once, with the reference's losses, val
losses and numerics records: resume is bit-exact.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
ARGS = [
    *("--steps", str(STEPS), "--batch-size", "4", "--seq-len", "16", "--width", "32"),
    *("--depth", "1", "--heads", "2", "--eval-every", "3", "--eval-batches", "1"),
    *("--ckpt-every", "2", "--no-progress"),
]
FAMILIES = {
    "mixed": "fp16-dynamic-ls",
    "float8": "fp8-delayed",
    "unit": "fp16-unit",
    "scalify": "fp16-scalify",
}
# One intra-op thread: the same arithmetic in every process, and no oversubscription.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TIMEOUT = 300.0


def _start(recipe: str, out: Path, resume: bool) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "lowprec", "train", "--recipe", recipe, *ARGS, "--out", str(out)]
    return subprocess.Popen(
        [*cmd, *(["--resume"] if resume else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=ROOT,
    )


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _wait(proc: subprocess.Popen[str], ready: object) -> None:
    """Poll until ``ready()`` or the process ends."""
    deadline = time.monotonic() + TIMEOUT
    while proc.poll() is None and not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the run did not reach the interruption point")
        time.sleep(0.002)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = proc.communicate(timeout=TIMEOUT)
    assert "Traceback" not in err, err
    return proc.returncode, err


def _records(out: Path) -> list[dict[str, object]]:
    text = (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def _checkpoint_step(out: Path) -> int:
    if not (out / "checkpoint.pt").exists():
        return 0
    return int(torch.load(out / "checkpoint.pt", weights_only=True)["step"])


def _check_prefix(out: Path, ref: list[dict[str, object]], where: str) -> int:
    """The directory holds steps 1..m once each with the reference's numbers, m >= the
    checkpoint's step; returns m."""
    recs = _records(out)
    m = len(recs)
    assert [r["step"] for r in recs] == list(range(1, m + 1)), where
    assert [r["loss"] for r in recs] == [r["loss"] for r in ref[:m]], where
    assert [r.get("val_loss") for r in recs] == [r.get("val_loss") for r in ref[:m]], where
    assert m >= _checkpoint_step(out), f"{where}: history lost before the checkpoint"
    return m


def _sigint_run(proc: subprocess.Popen[str], out: Path, at: int, rng: random.Random) -> None:
    _wait(proc, lambda: _lines(out / "metrics.jsonl") >= at)
    time.sleep(rng.uniform(0.0, 0.05))
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    rc, err = _finish(proc)
    if rc == 130:  # stopped at a step boundary, its checkpoint at the last logged step
        assert "interrupted (SIGINT) after step" in err, err
        assert _checkpoint_step(out) == len(_records(out)), err
    else:
        assert rc == 0, err  # the signal came after the last step


def _sigkill(proc: subprocess.Popen[str], ready: object, rng: random.Random) -> None:
    _wait(proc, ready)
    time.sleep(rng.uniform(0.0, 0.03))
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=TIMEOUT)


def _double_sigint(proc: subprocess.Popen[str], ready: object, rng: random.Random) -> None:
    _wait(proc, ready)
    time.sleep(rng.uniform(0.0, 0.05))
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        time.sleep(rng.uniform(0.0, 0.01))
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    rc, err = _finish(proc)
    assert rc in (0, 130), err


def _resume_to_end(recipe: str, out: Path) -> None:
    rc, err = _finish(_start(recipe, out, resume=True))
    assert rc == 0, err


def _trial(name: str, trial: int, ref_dir: Path, out: Path) -> None:
    recipe, ref = FAMILIES[name], _records(ref_dir)
    rng = random.Random(f"{name}-{trial}")
    metrics = out / "metrics.jsonl"
    first = _start(recipe, out, resume=False)
    if trial == 0:
        _sigint_run(first, out, rng.randint(1, STEPS - 4), rng)
    else:
        at = rng.randint(1, STEPS - 3)
        _sigkill(first, lambda: _lines(metrics) >= at, rng)
    m = _check_prefix(out, ref, f"{name} trial {trial}: after the first interruption")
    resumed = _start(recipe, out, resume=True)
    old = _inode(metrics)
    if trial == 0:  # SIGKILL right after the atomic rewrite, or during the steps
        more = rng.randint(0, 3)
        _sigkill(
            resumed,
            lambda: _inode(metrics) != old and _lines(metrics) >= min(m + more, STEPS),
            rng,
        )
    else:
        _double_sigint(resumed, lambda: _lines(metrics) >= min(m + 1, STEPS), rng)
    _check_prefix(out, ref, f"{name} trial {trial}: after the interrupted resume")
    _resume_to_end(recipe, out)
    recs = _records(out)
    assert len(recs) == len(ref) == STEPS
    assert recs == [{**r, "step_time": s["step_time"]} for r, s in zip(ref, recs, strict=True)]
    numerics = sorted((out / "numerics.jsonl").read_text().splitlines())
    assert numerics == sorted((ref_dir / "numerics.jsonl").read_text().splitlines()), name
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS


def _family(name: str, tmp: Path) -> None:
    ref_dir = tmp / f"{name}-ref"
    rc, err = _finish(_start(FAMILIES[name], ref_dir, resume=False))
    assert rc == 0, err
    assert [r["step"] for r in _records(ref_dir)] == list(range(1, STEPS + 1))
    for trial in range(2):
        _trial(name, trial, ref_dir, tmp / f"{name}-{trial}")


def test_real_signals_resume_bit_exactly(tmp_path: Path) -> None:
    """All families, two at a time (the CI machine has two cores)."""
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(_family, name, tmp_path) for name in FAMILIES]:
            f.result()
