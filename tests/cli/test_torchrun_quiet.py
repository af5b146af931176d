"""``lowprec train --nproc-per-node N`` starts torch's launcher through
``lowprec.cli.torchrun``: a SIGINT that stops the run ends it with 130 and no traceback
(torch's own launcher printed its ``SignalException`` traceback, 30 lines, after the
workers' one-line report). A failed worker ends it with that worker's status and at most
one ``error:`` line of the launcher's (torch's printed a ``ChildFailedError`` traceback
and a failure table after rank 0's one line)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

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


def _launch(tmp_path: Path, body: str) -> tuple[int, str]:
    """Run ``body`` as the worker script on 2 processes; the status and stderr."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, signal, sys, time\nrank = int(os.environ['RANK'])\n" + body)
    cmd = [sys.executable, "-m", "lowprec.cli.torchrun", "--standalone", "--nproc-per-node",
           "2", str(worker)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize(
    ("body", "code", "line"),
    [
        # rank 0's own error line (as lowprec's CLI prints it), the other rank waiting
        ("if rank == 0:\n    print('lowprec: error: bad', file=sys.stderr)\n    sys.exit(2)\n"
         "time.sleep(60)\n", 2, None),
        # another rank fails first: the launcher names it
        ("if rank == 1:\n    sys.exit(3)\ntime.sleep(60)\n", 3,
         "lowprec: error: worker rank 1 (pid {pid}) exited with status 3 (LOWPREC_TRACEBACK=1 "
         "prints each rank's traceback)"),
        # a worker killed by a signal: 128 + its number
        ("if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n", 137,
         "lowprec: error: worker rank 1 (pid {pid}) was killed by SIGKILL"),
    ],
)  # fmt: skip
def test_a_failed_worker_ends_the_launch_with_one_line(
    tmp_path: Path, body: str, code: int, line: str | None
) -> None:
    rc, err = _launch(tmp_path, body)
    assert rc == code, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.strip()]  # (torch's launcher logs too)
    if line is None:
        assert errors == ["lowprec: error: bad"], err[-3000:]
    else:
        assert len(errors) == 1, err[-3000:]
        head, tail = line.split("{pid}")
        assert re.fullmatch(re.escape(head) + r"\d+" + re.escape(tail), errors[0]), errors


def test_notes_and_warnings_print_once_for_all_ranks(tmp_path: Path) -> None:
    """``--resume`` of a complete run under ``--nproc-per-node 2``: the note that nothing is
    left to do printed once per rank (rank 0 reports for all, as for errors)."""
    out = tmp_path / "r"
    argv = [sys.executable, "-m", "lowprec", "train", "--parallel", "ddp", "--nproc-per-node",
            "2", "--steps", "2", "--width", "32", "--depth", "1", "--heads", "2", "--seq-len",
            "16", "--batch-size", "4", "--eval-every", "2", "--no-progress",
            "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run([*argv, "--resume"], capture_output=True, text=True, env=env,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    # counted in the text: two ranks' lines written at once may share a line
    assert again.stderr.count("note:") == 1, again.stderr[-3000:]
    assert again.stderr.count("is complete (all its 2 steps are done)") == 1, again.stderr
