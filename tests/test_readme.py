"""The README and docs/ run as written, stay inside the repository, and the README's set-up
commands are what CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "benchmarks" / "README.md", *DOCS]
README_LIMIT = 15360  # issue 13: README at most 15 KB

# The import paths a user may rely on (issue 13, item 1); everything else may move.
PUBLIC = {
    "lowprec",
    "lowprec.amp",
    "lowprec.unit",
    "lowprec.unit.functional",
    "lowprec.unit.nn",
    "lowprec.float8",
    "lowprec.scalify",
    "lowprec.analysis",
    "lowprec.recipes",
    "lowprec.distributed",
    # the trainer adapters (issue 34), each an optional extra
    "lowprec.integrations.transformers",
    "lowprec.integrations.accelerate",
    "lowprec.integrations.lightning",
    "lowprec.integrations.torchtitan",
}


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    heads = re.findall(r"^#+ (.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def _run(code: str, tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )


def test_quick_start_runs(tmp_path: Path) -> None:
    text = README.read_text()
    block = re.search(r"## Quick start\n.*?```python\n(.*?)```", text, re.S)
    assert block is not None, "README has a Python quick start"
    out = _run(block.group(1), tmp_path, "quick_start")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("448.0 0.015625 0.001953125 0.125 17.8")
    assert (tmp_path / "scaler.pt").exists()


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_python_block_runs(page: Path, tmp_path: Path) -> None:
    blocks = _python_blocks(page)
    if page == README:
        assert len(blocks) >= 6, "README has a quick start per technique"
    for i, code in enumerate(blocks):
        out = _run(code, tmp_path, f"block{i}")
        assert out.returncode == 0, f"{page.name} python block {i} failed:\n{out.stderr}"
        if "StepRecord" in code:
            assert out.stdout.strip() == "65536.0 StepRecord(scale=65536.0, skipped=False)"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_code_uses_public_import_paths(page: Path) -> None:
    for code in _python_blocks(page):
        for mod in re.findall(r"^\s*(?:from|import)\s+(lowprec[\w.]*)", code, re.M):
            assert mod in PUBLIC, f"{page.name} imports {mod}, not a public path"


def test_readme_size() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, limit {README_LIMIT}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not links in code
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # a URL
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_relative_to(ROOT), f"{page.name} links outside the repository: {link}"
        assert target.exists(), f"{page.name} links a missing file: {link}"
        if anchor:
            assert anchor in _anchors(target), f"{page.name} links a missing anchor: {link}"


def test_readme_links_every_docs_page() -> None:
    text = README.read_text()
    for doc in DOCS:
        assert f"](docs/{doc.name})" in text, f"README does not link docs/{doc.name}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/demo.sh" in readme
    commands = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.startswith("#")]
    assert commands[-1] == "bash scripts/test.sh"
