"""``lowprec train --parallel fsdp`` end to end under torch's launcher: DCP resume on the
same world size (bit-exact) and resharded 2 → 1 → 2, against one process.

Launches (2 processes unless said, the tiny reference model, global batch 8, BF16 recipe
with FP32 master weights):

1. ``lowprec train --nproc-per-node 2 --parallel fsdp --steps 3`` (the convenience that
   starts ``torch.distributed.run``): run B, checkpoint at step 3; B is copied to B2;
2. ``torchrun ... --resume --steps 6`` on B;
3. ``torchrun ... --steps 6`` from scratch: run A, uninterrupted;
4. ``torchrun --nproc-per-node 1 ... --resume --steps 5`` on B2 (2 → 1);
5. ``torchrun --nproc-per-node 2 ... --resume --steps 6`` on B2 (1 → 2).

Ctrl-C (``test_sigint_*``): a real SIGINT to ``torchrun`` (which forwards it to its
workers) during a 6-step run, for ``fsdp`` and ``ddp``; then ``--resume``. The fsdp run is
compared with A, the ddp one with an uninterrupted ddp run.

Tolerance of the resharded run against A: the restored state is bit-exact, but after a
change of world size the BF16 gradients of other row splits are summed: BF16 roundings
(2^-8) of the update, as between 2 processes and one: 1e-3 relative on the loss
(measured ~1e-5).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lowprec.jobs.train import TrainConfig, read_metrics, train

pytestmark = pytest.mark.slow

ARGS = [
    "--recipe", "bf16", "--batch-size", "8", "--seq-len", "32", "--width", "32",
    "--depth", "1", "--heads", "2", "--eval-every", "3", "--eval-batches", "2",
    "--ckpt-every", "2", "--no-progress",
]  # fmt: skip
CFG = TrainConfig(
    recipe="bf16", steps=6, batch_size=8, seq_len=32, width=32, depth=1, heads=2,
    eval_every=3, eval_batches=2, ckpt_every=2,
)  # fmt: skip


def _torchrun(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(n), "-m", "lowprec", "train", *ARGS, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("train_parallel")
    a, b, b2 = tmp / "A", tmp / "B", tmp / "B2"
    conv = [sys.executable, "-m", "lowprec", "train", "--nproc-per-node", "2"]
    first = subprocess.run(
        [*conv, *ARGS, "--parallel", "fsdp", "--steps", "3", "--out", str(b)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out_b3 = _ok(first)
    shutil.copytree(b, b2)
    _ok(_torchrun(2, "--parallel", "fsdp", "--steps", "6", "--resume", "--out", str(b)))
    _ok(_torchrun(2, "--parallel", "fsdp", "--steps", "6", "--out", str(a)))
    _ok(_torchrun(1, "--parallel", "fsdp", "--steps", "5", "--resume", "--out", str(b2)))
    ptr_1 = json.loads((b2 / "checkpoint.json").read_text())
    _ok(_torchrun(2, "--parallel", "fsdp", "--steps", "6", "--resume", "--out", str(b2)))
    one = tmp / "one"
    train(CFG, one, progress=False)
    return {"A": a, "B": b, "B2": b2, "one": one, "stdout_b3": out_b3, "ptr_1": ptr_1}


def test_same_world_size_resume_is_bit_exact(runs: dict[str, Any]) -> None:
    a, b = runs["A"], runs["B"]
    assert _losses(b) == _losses(a)  # every step, its loss to the last bit
    assert [r["step"] for r in read_metrics(b)] == list(range(1, 7))
    va = [r["val_loss"] for r in read_metrics(a) if "val_loss" in r]
    assert [r["val_loss"] for r in read_metrics(b) if "val_loss" in r] == va


def test_resharded_resume_continues_within_tolerance(runs: dict[str, Any]) -> None:
    a, b2 = _losses(runs["A"]), _losses(runs["B2"])
    assert b2[:3] == a[:3]  # written by the 2-process run before the copy
    assert runs["ptr_1"]["world_size"] == 1 and runs["ptr_1"]["step"] == 5
    worst = max(abs(x - y) / abs(y) for x, y in zip(b2, a, strict=True))
    assert worst <= 1e-3, (b2, a)


def test_two_processes_match_one_process_run(runs: dict[str, Any]) -> None:
    # The global batch is split over the ranks: the 2-process run sees the data of one.
    a, one = _losses(runs["A"]), _losses(runs["one"])
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, one, strict=True))
    assert worst <= 1e-3, (a, one)  # BF16 gradient sums, as in test_parallel.py
    assert one[-1] < one[0]


def test_run_directory_of_a_parallel_run(runs: dict[str, Any]) -> None:
    a = runs["A"]
    config = json.loads((a / "config.json").read_text())
    assert config["parallel"] == {"mode": "fsdp", "world_size": 2}
    ptr = json.loads((a / "checkpoint.json").read_text())
    assert ptr == {"step": 6, "dir": "checkpoints/step-00000006", "world_size": 2,
                   "parallel": "fsdp"}  # fmt: skip
    # One complete DCP directory: the older ones are removed once the pointer moved on.
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["step-00000006"]
    assert (a / ptr["dir"] / ".metadata").is_file()
    assert json.loads((a / "summary.json").read_text())["steps"] == 6
    # Rank 0 prints the summary table once.
    assert runs["stdout_b3"].count("run ") == 1


# ---- Ctrl-C: a real SIGINT to torchrun ------------------------------------------------------

RC_WORKER = Path(__file__).with_name("_rc_worker.py")


def _interrupt(out: Path) -> dict[str, Any]:
    """Start a 6-step 2-process run of ``out.name``'s mode, send SIGINT to torchrun once
    the first step is logged, and return what each process reported."""
    mode = out.name.split("-")[0]
    rc_dir = out.parent / f"{out.name}-rc"
    rc_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", str(RC_WORKER), str(rc_dir), "train", *ARGS, "--parallel", mode]
    cmd += ["--steps", "6", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Its own session, as a terminal's Ctrl-C reaches only torchrun in a background job.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=env,
    )  # fmt: skip
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=240)
    pointer = json.loads((out / "checkpoint.json").read_text())
    return {
        "torchrun_rc": proc.returncode,
        "rcs": {f.name: int(f.read_text()) for f in rc_dir.iterdir()},
        "stdout": stdout,
        "stderr": stderr,
        "steps_logged": [r["step"] for r in read_metrics(out)],
        "pointer": pointer,
        "ckpt_files": sorted(p.name for p in (out / pointer["dir"]).iterdir()),
    }


@pytest.fixture(scope="module")
def interrupted(runs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sigint")
    res: dict[str, Any] = {}
    for mode in ("fsdp", "ddp"):
        cut = tmp / f"{mode}-cut"
        res[mode] = _interrupt(cut)
        _ok(_torchrun(2, "--parallel", mode, "--steps", "6", "--resume", "--out", str(cut)))
        res[mode]["cut"] = cut
    straight = tmp / "ddp-straight"
    _ok(_torchrun(2, "--parallel", "ddp", "--steps", "6", "--out", str(straight)))
    res["fsdp"]["straight"], res["ddp"]["straight"] = runs["A"], straight
    return res


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_sigint_stops_every_rank_at_one_step_and_resume_is_exact(
    interrupted: dict[str, Any], mode: str
) -> None:
    r = interrupted[mode]
    k = r["pointer"]["step"]
    assert 1 <= k < 6, r["stderr"][-3000:]  # stopped early, at a step boundary
    # Both workers stopped after step k, wrote their DCP shards of step k (checked below)
    # and exited 130 (torchrun itself re-raises the signal it received: status 1, not ours
    # to set). Known issue (docs/distributed.md): in one CI run under load a DDP worker
    # other than rank 0 had not exited 30 s after its shard was written and torchrun
    # killed it (no status file); rank 0's status and the checkpoint are asserted always.
    assert r["rcs"].get("rc.0") == 130, r["stderr"][-3000:]
    if r["rcs"].get("rc.1") != 130:
        assert "rc.1" not in r["rcs"] and "forcefully exiting via 9" in r["stderr"], r["rcs"]
    assert r["steps_logged"] == list(range(1, k + 1))
    assert r["pointer"] == {"step": k, "dir": f"checkpoints/step-{k:08d}", "world_size": 2,
                            "parallel": mode}  # fmt: skip
    assert r["ckpt_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # both ranks
    assert f"interrupted (SIGINT) after step {k}" in r["stderr"]
    assert r["stderr"].count("interrupted (SIGINT)") == 1  # rank 0 alone reports
    # --resume: every step logged once, the losses of the uninterrupted run to the bit.
    cut, straight = read_metrics(r["cut"]), read_metrics(r["straight"])
    assert [x["step"] for x in cut] == list(range(1, 7))
    assert [x["loss"] for x in cut] == [x["loss"] for x in straight]
    assert [x.get("val_loss") for x in cut] == [x.get("val_loss") for x in straight]


@pytest.mark.parametrize(("mode", "comm"), [("fsdp", "bf16"), ("ddp", "fp8")])
def test_grad_comm_trains_within_its_formats_bound(
    runs: dict[str, Any], tmp_path: Path, mode: str, comm: str
) -> None:
    """``--grad-comm``: the gradients reduced in BF16 (FSDP2's reduce_dtype) or FP8 (DDP's
    E4M3 hook, sums in FP32) against run A (FSDP2, FP32 reduce-scatter). Bounds: BF16 sums
    round each partial sum to 2^-9 relative: 1e-3 on the loss, as between 2 processes and
    one. E4M3 keeps 3 mantissa bits, rounded twice (the pieces, then the sum): each reduced
    gradient within 2^-3 of its value, so Adam's update, and the loss's move from step 1,
    within 2^-3 (plus the same 1e-3).
    The run differs from A at all (the reduction was really replaced) and records it."""
    out = tmp_path / f"{mode}-{comm}"
    _ok(_torchrun(2, "--parallel", mode, "--grad-comm", comm, "--steps", "6", "--out", str(out)))
    got, a = _losses(out), _losses(runs["A"])
    assert got != a
    rel = 2.0**-3 if comm == "fp8" else 0.0
    for x, y in zip(got, a, strict=True):
        assert abs(x - y) <= rel * abs(a[0] - y) + 1e-3 * abs(y), (got, a)
    assert json.loads((out / "config.json").read_text())["train"]["grad_comm"] == comm


def test_float8_under_fsdp_measures_its_gemms(tmp_path: Path) -> None:
    """fp8-tensorwise under FSDP2 with the FP8 all-gather (the weight arrives quantized)
    while the run measures its GEMMs every step: it trains, and gemms.jsonl holds the
    forward GEMMs (an unset generator made this fail before)."""
    out = tmp_path / "fp8"
    args = ("--parallel", "fsdp", "--steps", "2", "--gemms-every", "1", "--out", str(out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", "-m", "lowprec", "train", *ARGS, *args]
    cmd[cmd.index("bf16")] = "fp8-tensorwise"
    _ok(subprocess.run(cmd, capture_output=True, text=True, timeout=300))
    recs = [json.loads(line) for line in (out / "gemms.jsonl").read_text().splitlines()]
    assert any(r.get("gemm") == "forward" for r in recs), recs[:2]
    assert all(math.isfinite(x) for x in _losses(out))
