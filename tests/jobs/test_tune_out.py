"""``lowprec tune`` checks ``--out`` and its values before any work (tuning takes
minutes): one ``error:`` line naming the flag, exit 2, nothing written; an existing plan
is kept unless ``--force``, as ``lowprec report`` keeps its page (docs/cli.md).

The report: ``lowprec tune --out /proc/p.json`` tuned the whole model, then failed with
``error: No such file or directory: /proc/p.json.tmp``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import lowprec.cli.tune as cli_tune
from lowprec.cli import main
from lowprec.jobs.tune import TuneConfig

SMALL = ["--target", "b200", "--width", "32", "--depth", "1", "--heads", "2"]
SMALL += ["--seq-len", "16", "--batch-size", "4", "--batches", "1"]


@pytest.fixture
def no_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any call of the tuning fails the test: a refusal must come before the work."""

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("run_tune was called")

    monkeypatch.setattr(cli_tune, "run_tune", never)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and err.rstrip("\n").endswith(errors[0]), err
    assert "Traceback" not in err and err.startswith("usage: lowprec tune"), err
    return errors[0]


@pytest.mark.usefixtures("no_tuning")
@pytest.mark.parametrize(
    ("out", "line"),
    [
        ("/proc/p.json", "--out: cannot write in the folder /proc: "),
        ("/proc/lowprec/p.json", "--out: cannot write in the folder /proc: "),
        ("{tmp}/file/p.json", "--out: cannot create the folder {tmp}/file: {tmp}/file is not a "
         "directory"),
        ("{tmp}/plan.txt", "--out: expected a .json file, got {tmp}/plan.txt"),
        ("{tmp}/dir.json", "--out: {tmp}/dir.json is a directory; give a file name (plan.json)"),
        ("{tmp}/old.json", "--out: {tmp}/old.json already exists; pass --force to overwrite it"),
    ],
)  # fmt: skip
def test_tune_checks_out_before_any_work(
    out: str, line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "old.json").write_text("{}")
    out, line = out.format(tmp=tmp_path), line.format(tmp=tmp_path)
    got = _refused(["tune", *SMALL, "--out", out], capsys)
    assert got.startswith(f"lowprec tune: error: {line}"), got
    assert (tmp_path / "old.json").read_text() == "{}"  # kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.json", "file", "old.json"]
    assert not Path("/proc/lowprec").exists()


@pytest.mark.usefixtures("no_tuning")
@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--lr", "1e308"], "argument --lr: must be a positive finite number from 1.18e-38 "
         "(float32's smallest normal) to 1e+06, got 1e+308"),
        (["--lr", "inf"], "argument --lr: must be a positive finite number, got inf"),
        (["--seed", "99999999999999999999"], "argument --seed: must be from 0 to 2^63 - 1, "
         "got 99999999999999999999"),
        (["--steps-before", "-1"], "argument --steps-before: must be from 0 to 2^63 - 1, got -1"),
        (["--width", "0"], "argument --width: must be from 1 to 2^63 - 1, got 0"),
        (["--budget", "1e308"], "argument --budget: must be a number from 1e-09 to 1000, got "
         "1e+308"),
        (["--budget", "0"], "argument --budget: must be a number from 1e-09 to 1000, got 0.0"),
    ],
)  # fmt: skip
def test_tune_values_name_the_flag(
    flags: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    got = _refused(["tune", *SMALL, *flags, "--out", str(out)], capsys)
    assert got == f"lowprec tune: error: {line}"
    assert not out.exists()


def test_tune_config_bounds() -> None:
    for kwargs, match in (
        ({"lr": 1e308}, "lr must be a positive finite number from"),
        ({"seed": 2**63}, r"seed must be at most 2\^63 - 1"),
        ({"steps_before": 2**70}, r"steps_before must be at most 2\^63 - 1"),
        ({"budget": 1e308}, "budget must be a number from 1e-09 to 1000"),
        ({"budget": True}, "budget must be a number"),
    ):
        with pytest.raises(ValueError, match=match):
            TuneConfig(**kwargs)  # type: ignore[arg-type]


def test_tune_force_overwrites_an_existing_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "plan.json"  # a missing folder is created
    assert main(["tune", *SMALL, "--out", str(out)]) == 0
    first = out.read_text()
    capsys.readouterr()
    _refused(["tune", *SMALL, "--seed", "1", "--out", str(out)], capsys)
    assert out.read_text() == first
    assert main(["tune", *SMALL, "--seed", "1", "--out", str(out), "--force"]) == 0
    assert json.loads(out.read_text())["kind"] == "lowprec-plan"
    assert [p.name for p in out.parent.iterdir()] == ["plan.json"]  # no .tmp, no probe left
