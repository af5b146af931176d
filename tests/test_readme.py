"""The README's quick start runs as written, and its set-up commands are what CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_start_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```python\n(.*?)```", text, re.S)
    assert block is not None, "README has a Python quick start"
    script = tmp_path / "quick_start.py"
    script.write_text(block.group(1))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("448.0 0.015625 0.001953125 0.125 17.8")
    assert (tmp_path / "scaler.pt").exists()


def test_every_python_block_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for i, code in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        out = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, f"README python block {i} failed:\n{out.stderr}"
        if "StepRecord" in code:
            assert out.stdout.strip() == "65536.0 StepRecord(scale=65536.0, skipped=False)"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/demo.sh" in readme
    commands = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.startswith("#")]
    assert commands[-1] == "bash scripts/test.sh"
