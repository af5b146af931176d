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

Tolerance of the resharded run against A: the restored state is bit-exact, but after a
change of world size the BF16 gradients of other row splits are summed: BF16 roundings
(2^-8) of the update, as between 2 processes and one: 1e-3 relative on the loss
(measured ~1e-5).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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
