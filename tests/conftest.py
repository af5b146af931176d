"""Fixtures shared by the test folders."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun_json(script: Path, nproc: int, out: Path, *args: str) -> Any:
    """Run ``script`` on ``nproc`` processes (gloo, one thread each) with torch's launcher,
    passing ``*args`` then ``out``; the JSON that rank 0 wrote to ``out``. ``RuntimeError``
    with the end of the workers' output if the launch fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(script), *args, str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{script.name} on {nproc} processes failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
        )
    return json.loads(Path(out).read_text())


def cli_error(
    argv: list[str], capsys: pytest.CaptureFixture[str], code: int = 2, notes: bool = False
) -> str:
    """Run ``lowprec argv`` expecting it to fail with exit ``code`` and exactly one
    ``error:`` line on stderr, no traceback (``notes``: ``note: ...`` lines may precede
    it); that line."""
    from lowprec.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    lines = [
        ln for ln in err.splitlines() if ln.strip() and not (notes and ln.startswith("note: "))
    ]
    assert len(lines) == 1 and "error: " in lines[0] and "Traceback" not in err, err
    return lines[0]


class Payload:
    """An object whose unpickling creates the file ``marker`` (``open(marker, "w")``): the
    stand-in for code hidden in a file that lowprec reads."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


@pytest.fixture
def payload(tmp_path: Path) -> tuple[Payload, bytes, Path]:
    """``(object, its pickle, marker)``: unpickling either creates ``marker``."""
    marker = tmp_path / "payload-ran"
    obj = Payload(marker)
    data = pickle.dumps(obj)
    pickle.loads(data).close()  # the payload is live: unpickling it does create the file
    assert marker.exists()
    marker.unlink()
    return obj, data, marker
