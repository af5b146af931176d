"""Every CLI failure is one ``error:`` line, never a traceback (issue 14, defect 8)."""

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

import pytest
import torch

from lowprec.cli import main
from tests._helpers import cli_error

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    *("--steps", "4", "--batch-size", "2", "--seq-len", "16", "--width", "32", "--depth", "1"),
    *("--heads", "2", "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2"),
    "--no-progress",
]


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    return cli_error(argv, capsys, code)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def test_unwritable_output_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    line = _fails(["train", *TINY, "--out", str(tmp_path / "file" / "run")], capsys)
    assert "cannot create output directory" in line
    if os.geteuid() == 0:  # root ignores permissions: a read-only file system instead
        line = _fails(["train", *TINY, "--out", "/sys/lowprec-test/run"], capsys)
        assert "cannot create output directory" in line


def test_corrupt_config_and_checkpoint(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    config = (bad / "config.json").read_text()
    (bad / "config.json").write_text(config[:30])
    line = _fails(["train", *TINY, "--out", str(bad), "--resume"], capsys)
    assert "config.json is corrupt" in line
    (bad / "config.json").write_text(config)
    state = torch.load(bad / "checkpoint.pt", weights_only=True)
    del state["run"]["recipe"]
    torch.save(state, bad / "checkpoint.pt")
    line = _fails(["train", *TINY, "--out", str(bad), "--resume"], capsys)
    assert "no 'recipe' in its run state" in line


def test_huge_seq_len_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "big"
    for n in ("100000000", "100000"):
        args = ["train", *TINY, "--seq-len", n, "--out", str(out)]
        assert f"--seq-len {n}" in _fails(args, capsys)
    assert not out.exists()


def test_report_on_malformed_files(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    (bad / "config.json").write_text("{not json")
    line = _fails(["report", str(bad), "-o", str(tmp_path / "a.html")], capsys)
    assert "config.json is corrupt" in line
    (bad / "config.json").write_text((run / "config.json").read_text())
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": "x"}\n')
    line = _fails(["report", str(bad), "-o", str(tmp_path / "a.html")], capsys)
    assert "metrics.jsonl" in line
    (bad / "metrics.jsonl").write_text('[1]\n{"step": 1}\n')
    assert "line 1 is not a JSON object" in _fails(["report", str(bad)], capsys)
    assert not (tmp_path / "a.html").exists()


def test_report_does_not_overwrite_without_force(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "r.html"
    page.write_text("mine")
    with pytest.raises(SystemExit) as e:
        main(["report", str(run), "-o", str(page)])
    assert e.value.code == 2 and "pass --force" in capsys.readouterr().err
    assert page.read_text() == "mine"
    assert main(["report", str(run), "-o", str(page), "--force"]) == 0
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_nonfinite_run_stops_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp16 at a huge learning rate (first seen as a traceback with fp16-scalify, which
    since keeps such values in range): one line naming the
    step and what became NaN/Inf, exit 1, every checkpoint finite."""
    out = tmp_path / "nan"
    args = ["train", *TINY, "--warmup", "1", "--recipe", "fp16", "--lr", "1e4", "--out", str(out)]
    line = _fails(args, capsys, code=1)
    assert "became NaN/Inf" in line and "--on-nonfinite stop" in line, line
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["stopped"] == "nonfinite"
    if (out / "checkpoint.pt").exists():
        state = torch.load(out / "checkpoint.pt", weights_only=True)["run"]["model"]
        assert all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())
    line = _fails([*args, "--resume", "--on-nonfinite", "skip", "--max-skips", "2"], capsys, 1)
    assert "consecutive steps skipped" in line


def test_sigterm_stops_at_a_step_boundary(tmp_path: Path) -> None:
    """SIGTERM to `python -m lowprec train`: exit 143, one message, resumable."""
    out = tmp_path / "term"
    cmd = [sys.executable, "-m", "lowprec", "train", *TINY, "--steps", "200", "--out", str(out)]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT
    )
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    assert "interrupted (SIGTERM) after step" in err and "Traceback" not in err
    steps = metrics.read_text().count("\n")
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == steps


def test_report_refuses_a_run_given_twice(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same directory twice (also spelled differently) was shown and judged twice."""
    again = tmp_path / "again"
    again.symlink_to(run)
    line = _fails(["report", str(run), str(again), "-o", str(tmp_path / "r.html")], capsys, 2)
    assert f"{again}: the same run directory as {run}; give each run once" in line
    assert not (tmp_path / "r.html").exists()


def test_settings_that_cannot_act_are_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A warm-up as long as the run (the learning rate never reaches --lr) and --guard on a
    recipe without float8 layers (nothing to move) were accepted in silence."""
    argv = ["train", *TINY, "--warmup", "6", "--guard", "--out", str(tmp_path / "a")]
    with caplog.at_level("WARNING", logger="lowprec.jobs.train"):
        assert main(argv) == 0
    text = caplog.text
    assert "--warmup 6 is not below --steps 4" in text, text
    assert "--guard: recipe fp32 has no float8 layer to move" in text, text
    caplog.clear()
    argv = ["train", *TINY, "--warmup", "2", "--recipe", "fp8-tensorwise", "--guard"]
    with caplog.at_level("WARNING", logger="lowprec.jobs.train"):
        assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "--warmup" not in caplog.text and "--guard" not in caplog.text, caplog.text


def test_tune_refuses_options_that_would_be_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tune --lr without --steps-before (the lr of no step: the plan was byte-identical
    to the default) and --candidates "" (a silent all-bf16 plan) are refused."""
    out = str(tmp_path / "plan.json")
    for argv, words in (
        (["--lr", "0.5"], ("error: --lr", "--steps-before N > 0")),
        (["--candidates", ""], ("--candidates", "no format given")),
    ):
        with pytest.raises(SystemExit) as e:
            main(["tune", *argv, "--out", out])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # argparse's usage, then one error line
        assert e.value.code == 2 and "Traceback" not in err, err
        assert all(w in last for w in words), last
    assert not (tmp_path / "plan.json").exists()


def test_a_loss_scaled_run_whose_loss_is_nan_is_not_told_to_use_loss_scaling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp16-dynamic-ls at lr 3: the forward overflows and the loss is NaN at every step.
    The error line told this loss-scaled run to "use a recipe with loss scaling"; it now
    says no loss scale cures a NaN loss. The report's verdict names the first NaN step."""
    argv = [
        "train",
        "--recipe",
        "fp16-dynamic-ls",
        "--steps",
        "40",
        "--width",
        "64",
        "--depth",
        "1",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--eval-every",
        "10",
        "--lr",
        "3",
        "--max-skips",
        "3",
        "--no-progress",
        "--out",
        str(tmp_path / "r"),
    ]
    line = cli_error(argv, capsys, code=1, notes=True)
    assert "which no loss scale cures" in line and "recipe with loss scaling" not in line, line
    from lowprec.jobs.run_summary import diverged_at
    from lowprec.jobs.rundir import read_metrics

    recs = read_metrics(tmp_path / "r")
    first = next(r["step"] for r in recs if not math.isfinite(r["loss"]))
    assert diverged_at(recs) == first < recs[-1]["step"]


def test_a_nan_loss_with_finite_weights_is_not_told_to_use_loss_scaling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp16 (no loss scaling) at lr 3, stopping at the first NaN/Inf (the default): the
    loss is NaN with every weight finite, the forward's overflow. The error line advised
    "a recipe with loss scaling" (new-user trial R: fp16-dynamic-ls then went NaN too);
    it now says no loss scale cures it. The report's diagnosis names a forward tensor."""
    out = tmp_path / "r"
    argv = ["train", "--recipe", "fp16", "--steps", "40", "--width", "64", "--depth", "1",
            "--seq-len", "32", "--batch-size", "8", "--eval-every", "10", "--lr", "3",
            "--no-progress", "--out", str(out)]  # fmt: skip
    line = cli_error(argv, capsys, code=1, notes=True)
    assert "the loss" in line and "which no loss scale cures" in line, line
    assert "recipe with loss scaling" not in line, line
