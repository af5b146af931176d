"""``make_trainer`` under ``accelerate launch`` with 2 CPU processes (DDP over gloo): the
replicas stay identical and a resumed run is bit-identical to the uninterrupted one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_ddp_trainer.py")
# fp8-delayed: amax histories reduced over the ranks; bf16-unit: u-muP's sqrt(N) gradient
# hook; fp16-scalify: a wrapper model inside DDP; fp16-dynamic-ls: the loss scaler.
RECIPES = ["fp8-delayed", "bf16-unit", "fp16-scalify", "fp16-dynamic-ls"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_accelerate_launch_two_processes_ddp(tmp_path: Path) -> None:
    # --multi_gpu selects Accelerate's torchrun launcher (--cpu would want mpirun); the
    # script's TrainingArguments(use_cpu=True, ddp_backend="gloo") keep it on the CPU.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           str(SCRIPT), str(tmp_path), *RECIPES]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for recipe in RECIPES:
        results = [json.loads((tmp_path / recipe / f"result_{r}.json").read_text()) for r in (0, 1)]
        for res in results:
            assert res["world"] == 2 and res["wrapped"] == "DistributedDataParallel"
            assert res["replicas_equal"], f"{recipe}: the two replicas' parameters differ"
            assert res["resumed_equal"], f"{recipe}: the resumed run's parameters differ"
            assert res["resumed_losses"] == res["losses"] and len(res["losses"]) == 4
            assert res["steps"] == 4
        assert results[0]["losses"] == results[1]["losses"], "the logged loss is the ranks' mean"
    # lowprec.integrations.accelerate.prepare on the same processes (fp8-delayed, each rank
    # its own data): the amax histories are reduced over the ranks, the replicas identical.
    for r in (0, 1):
        res = json.loads((tmp_path / "accelerate" / f"accelerate_{r}.json").read_text())
        assert res["wrapped"] == "DistributedDataParallel" and res["steps"] == 3
        assert res["replicas_equal"] and res["scales_equal"]
