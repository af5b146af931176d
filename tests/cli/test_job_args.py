"""Arguments of ``lowprec demo``, ``train`` and ``report`` that were taken silently or
reported wrongly: repeated values, an empty path, a file as a demo directory, a run
directory that does not exist; and the demo's header with several seeds."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from lowprec.cli import main
from lowprec.jobs.demo import run_demo
from tests._helpers import TINY


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``lowprec argv`` fails with exit 2, the command's usage and one error line, no
    traceback; that line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    return errors[0]


@pytest.mark.parametrize(
    ("flag", "values", "twice"),
    [("--seeds", ["0", "0"], "0"), ("--seeds", ["1", "2", "1"], "1"),
     ("--recipes", ["fp32", "fp32"], "fp32"), ("--recipes", ["bf16", "fp16", "bf16"], "bf16")],
)  # fmt: skip
def test_demo_refuses_a_repeated_seed_or_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, values: list[str], twice: str
) -> None:
    """`--seeds 0 0` trained one seed and reported no spread; `--recipes fp32 fp32` one
    recipe: silently. Refused, naming the flag and the value, before anything is made."""
    out = tmp_path / "demo"
    line = _usage_error(["demo", "--quick", "--no-progress", "--out", str(out), flag, *values],
                        capsys)  # fmt: skip
    assert line == f"lowprec demo: error: {flag}: {twice} is given twice; give each once"
    assert not out.exists()


def test_demo_resume_of_a_file_is_not_a_demo_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--resume /etc/passwd` said `error: Not a directory: /etc/passwd/demo.json`, exit 1."""
    f = tmp_path / "file"
    f.write_text("not a demo")
    line = _usage_error(["demo", "--resume", str(f)], capsys)
    assert line == f"lowprec demo: error: --resume: {f} is not a demo directory (not a directory)"


@pytest.mark.parametrize(
    "argv",
    [["train", "--out", ""], ["demo", "--quick", "--out", ""], ["demo", "--resume", ""],
     ["report", "RUN", "-o", ""], ["report", ""], ["tune", "--out", ""],
     ["formats", "--snr", ""]],
)  # fmt: skip
def test_an_empty_path_is_refused_as_empty(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
) -> None:
    """`--out ''` was the current directory: "output directory . already exists; pass
    --resume" (train, demo), or a report read `.` as a run; tune said "expected a .json
    file, got ."."""
    monkeypatch.chdir(tmp_path)
    line = _usage_error(argv, capsys)
    assert "an empty path" in line, line
    assert list(tmp_path.iterdir()) == []


def test_report_of_a_missing_directory_says_it_does_not_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "is not a directory"."""
    missing = tmp_path / "some" / "nonexistent"
    with pytest.raises(SystemExit) as e:
        main(["report", str(missing), "-o", str(tmp_path / "r.html")])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err == (
        f"lowprec report: error: {missing} does not exist (expected a run directory of "
        "`lowprec train`)\n"
    )


def test_demo_header_lists_the_seeds(tmp_path: Path) -> None:
    """With `--seeds 0 1` the header said "seed 0"."""
    text = io.StringIO()
    cfg = replace(TINY, steps=4, eval_every=2, ckpt_every=4)
    run_demo(tmp_path / "d", recipes=["fp32"], seeds=[0, 1], progress=False, config=cfg,
             console=Console(file=text, width=250))  # fmt: skip
    header = text.getvalue().splitlines()[0]
    assert "seeds 0 1 (rows: seed 0)" in header, header
