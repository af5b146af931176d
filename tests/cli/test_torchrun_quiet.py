"""``lowprec train --nproc-per-node N`` starts torch's launcher through
``lowprec.cli.torchrun``: a SIGINT that stops the run ends it with 130 and no traceback
(torch's own launcher printed its ``SignalException`` traceback, 30 lines, after the
workers' one-line report)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def test_an_interrupted_launch_exits_130_without_a_traceback(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *a: sys.exit(130))\n"
        f"pathlib.Path({str(ready)!r}).write_text('1')\n"
        "time.sleep(120)\n"
    )
    cmd = [sys.executable, "-m", "lowprec.cli.torchrun", "--standalone", "--nproc-per-node",
           "1", str(worker)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not ready.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-2000:]


def test_the_convenience_starts_the_quiet_launcher(monkeypatch: Any) -> None:
    import argparse

    import lowprec.cli.parallel as par

    seen: list[list[str]] = []

    class Done:
        pid = 0

        def __init__(self, cmd: list[str], **kw: Any) -> None:
            seen.append(cmd)

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(par.subprocess, "Popen", Done)
    args = argparse.Namespace(parser=None, parallel="ddp", out=Path("o"), recipe="fp32",
                              nproc_per_node=2)  # fmt: skip
    assert par.launch(args, ["train", "--parallel", "ddp", "--nproc-per-node", "2"]) == 0
    assert seen[0][1:5] == ["-m", "lowprec.cli.torchrun", "--standalone", "--nproc-per-node"]
