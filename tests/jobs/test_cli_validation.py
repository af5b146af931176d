"""``lowprec train`` and ``lowprec formats`` refuse bad values up front: one ``error:`` line
naming the flag, exit status 2, and no run directory or file created (docs/cli.md).

Each case was a user's report: ``--lr 1e308`` crashed the first step (exit 1) after
writing ``config.json``, so the same command with a sane lr was then refused; ``--seed
99999999999999999999`` printed torch's ``Overflow when unpacking long long``, no flag named,
and left an empty ``--out``; ``--width 30 --heads 4`` named fields, not flags; a resume with
``--steps`` below the steps done exited 0 doing nothing and rewrote ``summary.json``;
``formats --snr snr.txt`` printed the table, then matplotlib's error."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from lowprec.cli import main
from lowprec.jobs.rundir import read_metrics
from lowprec.jobs.train import train
from tests._helpers import TINY as TINY_CFG

TINY = [
    *("--steps", "4", "--batch-size", "2", "--seq-len", "16", "--width", "32", "--depth", "1"),
    *("--heads", "2", "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2"),
    "--no-progress",
]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    """Run ``lowprec argv`` expecting exit ``code``, nothing on stdout and exactly one
    ``error:`` line on stderr, the last (argparse's usage may precede it), no traceback;
    that line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == code, err
    assert out == "", out
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and err.rstrip("\n").endswith(errors[0]), err
    assert "Traceback" not in err
    usage = err.splitlines()[:-1]
    assert all(ln.startswith(("usage: ", " ")) for ln in usage), err
    return errors[0]


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``folder``: its modification time and its bytes' digest; not the
    run's ``.lock`` (its holder's pid, written by every process that takes the lock)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ".lock")
    digest = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, digest[p]) for p in files}


# ---- values out of range: refused before --out exists -----------------------------------


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--lr", "1e308"],  # crashed step 1: float32 overflow in the optimizer
            "lowprec train: error: argument --lr: must be a positive finite number from "
            "1.18e-38 (float32's smallest normal) to 1e+06, got 1e+308",
        ),
        (
            ["--lr", "1e-320"],  # zero in float32: the run trained nothing
            "lowprec train: error: argument --lr: must be a positive finite number from "
            "1.18e-38 (float32's smallest normal) to 1e+06, got 1e-320",
        ),
        (
            ["--seed", "99999999999999999999"],  # torch.manual_seed's overflow, no flag named
            "lowprec train: error: argument --seed: must be at most 2^63 - 1 = "
            "9223372036854775807, got 99999999999999999999",
        ),
        (
            ["--seed", str(2**64 - 1)],  # torch takes it, but seed + 1 seeds the generator
            "lowprec train: error: argument --seed: must be at most 2^63 - 1 = "
            f"9223372036854775807, got {2**64 - 1}",
        ),
        (
            ["--warmup", "1" + "0" * 400],  # lr * (step + 1) / warmup: int too large for float
            "lowprec train: error: argument --warmup: must be at most 2^63 - 1 = "
            f"9223372036854775807, got 1{'0' * 400}",
        ),
        (
            ["--eval-batches", "100000000"],  # evaluated for hours; an interrupt waits for it
            "lowprec train: error: argument --eval-batches: must be at most 10000, got "
            "100000000 (every evaluation reads that many batches, and an interrupt waits for "
            "it; 10000 batches of 16 × 64 read the validation split 90 times)",
        ),
        (
            ["--width", "30", "--heads", "4"],
            "lowprec train: error: --width 30 must be divisible by --heads 4",
        ),
        (
            ["--heads", "5"],  # TINY's --width 32
            "lowprec train: error: --width 32 must be divisible by --heads 5",
        ),
    ],
)
def test_train_refuses_a_bad_value_naming_the_flag(
    flags: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert _refused(["train", *TINY, *flags, "--out", str(out)], capsys) == line
    assert not out.exists()


def test_train_takes_the_largest_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = ["train", *TINY, "--steps", "1", "--seed", str(2**63 - 1), "--out", str(out)]
    assert main(args) == 0
    assert (out / "summary.json").is_file()


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["demo", "--quick", "--seed", str(2**63)],
         f"lowprec demo: error: argument --seed: must be from 0 to 2^63 - 1, got {2**63}"),
        (["demo", "--quick", "--seeds", "0", "99999999999999999999"],
         "lowprec demo: error: argument --seeds: must be from 0 to 2^63 - 1, got "
         "99999999999999999999"),
        (["demo", "--quick", "--seeds", "1", "-1"],
         "lowprec demo: error: argument --seeds: must be from 0 to 2^63 - 1, got -1"),
        (["demo", "--quick", "--seed", "1.5"],
         "lowprec demo: error: argument --seed: expected an integer, got '1.5'"),
        (["train", *TINY, "--max-skips", "0"],
         "lowprec train: error: argument --max-skips: must be from 1 to 2^63 - 1, got 0"),
        (["train", *TINY, "--max-skips", str(2**64)],
         f"lowprec train: error: argument --max-skips: must be from 1 to 2^63 - 1, got {2**64}"),
        (["train", *TINY, "--parallel", "ddp", "--nproc-per-node", "0"],
         "lowprec train: error: argument --nproc-per-node: must be from 1 to 2^63 - 1, got 0"),
    ],
)  # fmt: skip
def test_int_flags_share_one_bounded_parser(
    argv: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """demo's seeds, train's --max-skips and --nproc-per-node, like tune's ints, are
    checked where they are parsed: from their least value to 2^63 - 1 (a 20-digit demo
    seed was accepted, then failed in torch.manual_seed)."""
    out = tmp_path / "out"
    assert _refused([*argv, "--out", str(out)], capsys) == line
    assert not out.exists()


# ---- --resume with no steps left: refused, the run directory untouched ------------------


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "a"
    assert main(["train", *TINY, "--out", str(out)]) == 0  # 4 steps, summary.json
    return out


def test_resume_below_the_steps_done_is_refused(
    finished: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(finished)
    args = ["train", "--resume", "--out", str(finished), "--no-progress", "--steps", "2"]
    assert _refused(args, capsys) == (
        f"lowprec train: error: --steps 2 is not above the 4 steps {finished} has done; give "
        "more steps to continue it"
    )
    assert _snapshot(finished) == before


@pytest.mark.parametrize("steps", [["--steps", "4"], []])  # its own --steps, given or not
def test_resume_of_a_complete_run_does_nothing(
    finished: Path, steps: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 0 (resuming until done stays idempotent: tests/jobs/test_interrupts.py resumes
    a run that may have finished), a note, the stored summary's table, nothing written."""
    before = _snapshot(finished)
    assert main(["train", "--resume", "--out", str(finished), "--no-progress", *steps]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"note: --resume: {finished} is complete (all its 4 steps are done): nothing to do; "
        "give --steps above 4 to continue it\n"
    )
    assert f"run {finished}" in out
    assert _snapshot(finished) == before


def test_resume_of_a_stopped_run_needs_steps_above_its_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b"
    assert train(TINY_CFG, out, progress=False, stop_after=2) == {"stopped_at": 2}
    before = _snapshot(out)
    assert not (out / "summary.json").exists()
    line = _refused(["train", "--resume", "--out", str(out), "--steps", "1"], capsys)
    assert line == (
        f"lowprec train: error: --steps 1 is not above the 2 steps {out} has done; "
        "give more steps to continue it"
    )
    assert _snapshot(out) == before
    assert main(["train", "--resume", "--out", str(out), "--steps", "3", "--no-progress"]) == 0
    assert (out / "summary.json").is_file()


def _steps_recorded(out: Path) -> int:
    steps: int = json.loads((out / "config.json").read_text())["train"]["steps"]
    return steps


def test_an_extended_run_resumed_again_is_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume with more ``--steps`` records them in ``config.json``, so a later plain
    ``--resume`` is the complete run (a note, exit 0, nothing written), not a refusal of
    the steps the run started with (it said ``--steps 4 is not above the 6 steps``)."""
    out = tmp_path / "a"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    assert _steps_recorded(out) == 4
    assert main(["train", "--resume", "--out", str(out), "--steps", "6", "--no-progress"]) == 0
    assert _steps_recorded(out) == 6
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "summary.json").read_text())["steps"] == 6
    capsys.readouterr()
    before = _snapshot(out)
    assert main(["train", "--resume", "--out", str(out), "--no-progress"]) == 0
    assert capsys.readouterr().err == (
        f"note: --resume: {out} is complete (all its 6 steps are done): nothing to do; "
        "give --steps above 6 to continue it\n"
    )
    assert _snapshot(out) == before
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_an_extension_killed_midway_resumes_without_steps(tmp_path: Path) -> None:
    """An extension to 12 steps stopped at step 10 (as a kill after its checkpoint) is
    resumed by a plain ``--resume`` to the 12 steps, with the losses of an extension that
    was not stopped."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out in (straight, split):
        train(TINY_CFG, out, progress=False)  # 8 steps, complete
    long = replace(TINY_CFG, steps=12)
    train(long, straight, resume=True, progress=False)
    assert train(long, split, resume=True, progress=False, stop_after=10) == {"stopped_at": 10}
    assert _steps_recorded(split) == 12 and not (split / "summary.json").exists()
    assert main(["train", "--resume", "--out", str(split), "--no-progress"]) == 0
    losses = [(r["step"], r["loss"]) for r in read_metrics(split)]
    assert [s for s, _ in losses] == list(range(1, 13))
    assert losses == [(r["step"], r["loss"]) for r in read_metrics(straight)]
    assert _steps_recorded(straight) == 12


# ---- lowprec formats --snr: the path checked before anything is printed -----------------


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("snr.txt", "must end in a format matplotlib writes ("),
        ("snr", "must end in a format matplotlib writes ("),
        ("/proc/lowprec-x.png", "--snr: cannot write in the folder /proc: "),
        ("{tmp}/file/x.png", "--snr: cannot create the folder {tmp}/file: {tmp}/file is not a "
         "directory"),
        ("{tmp}/d.png", "--snr: {tmp}/d.png is a directory; give a file name"),
    ],
)  # fmt: skip
def test_formats_checks_snr_before_printing(
    path: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "d.png").mkdir()
    path, why = path.format(tmp=tmp_path), why.format(tmp=tmp_path)
    line = _refused(["formats", "--snr", path], capsys)  # stdout empty: no table
    assert line.startswith("lowprec formats: error: ") and "--snr" in line and why in line, line
    if "matplotlib" in why:
        assert "png, ps, raw" in line and f"{Path(path).suffix or 'no suffix'}" in line


def test_formats_snr_into_a_missing_folder_still_works(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "snr.svg"
    assert main(["formats", "--snr", str(out), "--kmin", "-2", "--kmax", "2"]) == 0
    assert out.is_file() and f"wrote {out}" in capsys.readouterr().out


def test_a_file_as_out_and_an_empty_recipe_file_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out naming a file said "already exists; pass --resume" (resuming a file?); an
    empty recipe file said "is not a recipe ('name')" (a bare KeyError)."""
    f = tmp_path / "file"
    f.write_text("mine")
    line = _refused(["train", *TINY, "--out", str(f)], capsys)
    assert line.endswith(f"output directory {f} is a file, not a directory; give another path")
    assert f.read_text() == "mine"
    (tmp_path / "empty.json").write_text("{}")
    line = _refused(["train", *TINY, "--recipe", str(tmp_path / "empty.json")], capsys)
    assert line.endswith("is not a recipe (no key 'name')")
