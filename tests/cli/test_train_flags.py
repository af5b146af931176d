"""``lowprec train``'s flags come from ``TrainConfig``; ``--resume --out DIR`` alone
continues a run from its ``config.json``; ``--recipe FILE.json``; usage errors name the
subcommand and the flag; every JSON file is strict; ``report -o`` into a missing folder
(issue 29, items 6 and 7).

Oracles: a straight run of the same configuration (bit-exact losses and weights), the
values written into the files, Python's strict parser (``parse_constant`` raising), and
the recipe a preset builds (a JSON copy of it trains to the same losses)."""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import lowprec.jobs.train as train_mod
from lowprec.cli import main
from lowprec.cli.main import build_parser
from lowprec.jobs.run_summary import summary_cells
from lowprec.jobs.rundir import read_metrics, read_run
from lowprec.jobs.train import TrainConfig, train
from lowprec.recipes import Recipe, get_recipe
from tests._helpers import cli_error

TINY = [
    *("--steps", "6", "--batch-size", "2", "--seq-len", "16", "--width", "32", "--depth", "1"),
    *("--heads", "2", "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2"),
    *("--warmup", "2"),
]
# The same run as a TrainConfig (the CLI's defaults for everything else).
CFG = TrainConfig(
    steps=6, batch_size=2, seq_len=16, width=32, depth=1, heads=2, eval_every=2,
    eval_batches=1, ckpt_every=2, warmup=2,
)  # fmt: skip


def _train_parser() -> Any:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["train"]  # type: ignore[attr-defined]


def _losses(out: Path) -> list[tuple[float, float | None]]:
    return [(r["loss"], r.get("val_loss")) for r in read_metrics(out)]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", weights_only=True)["run"]["model"]  # type: ignore[no-any-return]


def _strict(text: str) -> Any:
    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flags") / "straight"
    assert main(["train", *TINY, "--out", str(out), "--no-progress"]) == 0
    return out


# ---- the flags come from the config ---------------------------------------------------------


def test_every_config_field_has_a_flag_with_help() -> None:
    p = _train_parser()
    by_flag = {s: a for a in p._actions for s in a.option_strings}
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in by_flag, flag
        assert f.metadata["help"] in by_flag[flag].help, flag
        assert f"(default {f.default})" in by_flag[flag].help, flag
        assert by_flag[flag].default is None, "unset flags must be told apart (--resume)"


def test_warmup_flag_reaches_the_config_and_the_schedule(
    tmp_path: Path, straight: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w"
    args = ["train", *TINY, "--warmup", "4", "--lr", "0.004", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["warmup"] == 4 and config["train"]["lr"] == 0.004
    lrs = [r["lr"] for r in read_metrics(out)]
    assert lrs[:4] == pytest.approx([0.001, 0.002, 0.003, 0.004])  # lr * (k + 1) / 4
    assert [r["lr"] for r in read_metrics(straight)][:2] == pytest.approx([0.0015, 0.003])
    with pytest.raises(SystemExit):
        main(["train", "--warmup", "-1"])
    assert "argument --warmup: must be a non-negative int, got -1" in capsys.readouterr().err


def test_config_values_are_checked_per_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, msg in (
        (["--steps", "0"], "argument --steps: must be a positive int, got 0"),
        (["--lr", "inf"], "argument --lr: must be a positive finite number, got inf"),
        (["--seed", "-3"], "argument --seed: must be a non-negative int, got -3"),
        (["--depth", "1.5"], "argument --depth: expected an integer, got '1.5'"),
        (["--width", "30", "--heads", "4"], "--width 30 must be divisible by --heads 4"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["train", *bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err, err
        assert err.startswith("usage: lowprec train"), err


# ---- usage errors --------------------------------------------------------------------------


def test_a_mistyped_flag_shows_train_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", "--stepz", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: lowprec train [-h]"), err
    assert "lowprec train: error: unrecognized arguments: --stepz 2 (did you mean --steps?)" in err
    with pytest.raises(SystemExit):
        main(["report", "run", "--titel", "x"])
    err = capsys.readouterr().err
    assert err.startswith("usage: lowprec report") and "did you mean --title?" in err


def test_unknown_recipe_says_recipe_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--recipe", "nope"])
    err = capsys.readouterr().err
    assert "argument --recipe: unknown name 'nope'; valid: fp32, bf16" in err
    assert "recipe: recipe" not in err and "--recipe: recipe:" not in err
    with pytest.raises(SystemExit):
        main(["demo", "--recipes", "nope"])
    err = capsys.readouterr().err
    assert "argument --recipes: unknown name 'nope'" in err and "recipe: unknown" not in err


# ---- --resume --out DIR ------------------------------------------------------------------


def test_resume_with_out_alone_equals_the_straight_run(tmp_path: Path, straight: Path) -> None:
    split = tmp_path / "split"
    assert train(CFG, split, progress=False, stop_after=3) == {"stopped_at": 3}
    assert main(["train", "--resume", "--out", str(split), "--no-progress"]) == 0
    assert [r["step"] for r in read_metrics(split)] == list(range(1, 7))
    assert _losses(split) == _losses(straight)
    a, b = _weights(straight), _weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (straight, split))
    assert {k: v for k, v in sa.items() if k != "step_time_ms"} == {
        k: v for k, v in sb.items() if k != "step_time_ms"
    }
    # --steps may change: two more steps, the first six unchanged
    assert main(["train", "--resume", "--out", str(split), "--steps", "8", "--no-progress"]) == 0
    assert [r["step"] for r in read_metrics(split)] == list(range(1, 9))
    assert json.loads((split / "config.json").read_text())["train"]["steps"] == 8, (
        "config.json records the steps of the last resume, so a plain --resume is complete"
    )


def test_a_conflicting_flag_is_named(
    tmp_path: Path, straight: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    base = ["train", "--resume", "--out", str(run), "--no-progress"]
    for flag, value, saved in (
        ("--lr", "0.1", "lr 0.003"),
        ("--width", "64", "width 32"),
        ("--warmup", "5", "warmup 2"),
        ("--recipe", "bf16", "recipe fp32"),
        ("--model", "llama", "model 'reference'"),
    ):
        line = cli_error([*base, flag, value], capsys)
        assert f"--resume: {flag} {value} conflicts with the run in {run} ({saved})" in line, line
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before, "nothing changed"
    # the flags of the run itself are accepted
    assert main([*base, *TINY, "--steps", "7"]) == 0
    assert len(read_metrics(run)) == 7
    # the API names the field and both values
    with pytest.raises(ValueError, match=r"different configuration \(lr 0.003 in the run, 0.001"):
        train(replace(CFG, lr=1e-3), run, resume=True, progress=False)


# ---- --recipe FILE.json --------------------------------------------------------------------


def test_recipe_from_a_json_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A JSON copy of the bf16 preset under another name trains to the preset's losses,
    is recorded whole in config.json and resumes from it with --out alone."""
    d = get_recipe("bf16").to_dict()
    d["name"], d["description"] = "my-bf16", "bf16, from a file"
    path = tmp_path / "my.json"
    path.write_text(json.dumps(d))
    args = ["train", *TINY, "--no-progress"]
    assert main([*args, "--recipe", "bf16", "--out", str(tmp_path / "preset")]) == 0
    capsys.readouterr()
    mine = tmp_path / "mine"
    assert main([*args, "--recipe", str(path), "--out", str(mine)]) == 0
    assert "my-bf16" in capsys.readouterr().out
    config = json.loads((mine / "config.json").read_text())
    assert config["recipe"] == d and config["train"]["recipe"] == "my-bf16"
    assert _losses(mine) == _losses(tmp_path / "preset")
    assert json.loads((mine / "summary.json").read_text())["recipe"] == "my-bf16"
    split = tmp_path / "split"
    train(replace(CFG, recipe=Recipe.from_dict(d)), split, progress=False, stop_after=3)
    assert main(["train", "--resume", "--out", str(split), "--no-progress"]) == 0
    assert _losses(split) == _losses(tmp_path / "preset")
    # the same file again on resume is no conflict; another recipe is
    assert main(["train", "--resume", "--out", str(mine), "--recipe", str(path), "--steps",
                 "7", "--no-progress"]) == 0  # fmt: skip
    line = cli_error(["train", "--resume", "--out", str(mine), "--recipe", "bf16"], capsys)
    assert "--recipe bf16 conflicts with the run" in line and "(recipe my-bf16)" in line


@pytest.mark.parametrize(
    ("content", "msg"),
    [
        (None, "argument --recipe: cannot read {p}: No such file or directory"),
        ("{not json", "argument --recipe: {p} is not JSON"),
        ('{"name": "x", "bogus": 1}', "argument --recipe: {p} is not a recipe (recipe dict has "
         "unknown keys ['bogus'])"),
        ('{"name": "x", "param_dtype": "fp8"}', "argument --recipe: {p} is not a recipe"),
    ],
)  # fmt: skip
def test_bad_recipe_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, msg: str
) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        main(["train", "--recipe", str(path), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg.format(p=path) in err, err
    assert not (tmp_path / "run").exists()


# ---- strict JSON ---------------------------------------------------------------------------


def test_every_file_of_a_nan_run_is_strict_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp16 (no loss scaling) at lr 1e4 diverges at step 2: its summary holds NaN and Inf. Every
    JSON file parses with a strict parser; the readers give the numbers back as floats."""
    out = tmp_path / "nan"
    args = ["train", *TINY, "--recipe", "fp16", "--lr", "1e4", "--out", str(out)]
    cli_error(args, capsys, code=1)
    summary = _strict((out / "summary.json").read_text())
    assert summary["val_loss"] == "NaN" and summary["diverged_at"] == 2
    assert summary["train_loss"] in ("NaN", "Infinity")
    _strict((out / "config.json").read_text())
    lines = [
        _strict(line)
        for name in ("metrics.jsonl", "numerics.jsonl")
        for line in (out / name).read_text().splitlines()
    ]
    assert any(v in ("NaN", "Infinity", "-Infinity") for r in lines for v in r.values())
    _, metrics, _ = read_run(out)
    assert not math.isfinite(metrics[-1]["loss"]) and isinstance(metrics[-1]["loss"], float)
    # the report reads it and shows the non-finite numbers
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 0
    assert "diverged" in (tmp_path / "r.html").read_text()
    # and resume reads it: a skip run goes on (and stops after 2 skips)
    line = cli_error(["train", "--resume", "--out", str(out), "--on-nonfinite", "skip",
                      "--max-skips", "2"], capsys, code=1)  # fmt: skip
    assert "consecutive steps skipped" in line
    _strict((out / "summary.json").read_text())
    # step 2, redone under skip, evaluates where the stopped process did not: the same
    # numbers, no resume mismatch (it was reported as "not bit-exact")
    _, metrics, _ = read_run(out)
    assert [r["step"] for r in metrics] == [1, 2, 3] and metrics[1]["skipped"]
    assert not any("resume_mismatch" in r for r in metrics), metrics


# ---- the progress bar and the table --------------------------------------------------------


class _Bar:
    """Stands in for the progress bar: keeps what it was given."""

    shown: ClassVar[list[dict[str, float]]] = []

    def __init__(self, *args: object, **kw: object) -> None:
        pass

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, step: int, rec: dict[str, float], skipped: int) -> None:
        _Bar.shown.append(dict(rec))


def test_the_bar_ends_on_the_numbers_of_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bar shows the mean loss of the last 10 steps and the median step time, as the
    final table; also across a resume (the earlier steps count). Twelve steps: the last
    step (tracked, slow) is not the median, and the loss is not the last step's."""
    monkeypatch.setattr(train_mod, "Progress", _Bar)
    cfg = replace(CFG, steps=12, eval_every=6)
    out = tmp_path / "r"
    train(cfg, out, stop_after=5)
    _Bar.shown.clear()
    summary = train(cfg, out, resume=True)
    last = _Bar.shown[-1]
    assert len(_Bar.shown) == 7
    assert last["loss"] == summary["train_loss"]
    assert 1e3 * last["step_time"] == pytest.approx(summary["step_time_ms"], rel=1e-12)
    recs = read_metrics(out)
    assert last["loss"] != recs[-1]["loss"]
    assert last["step_time"] != recs[-1]["step_time"]
    cells = summary_cells(summary)
    assert f"{last['loss']:.4f}" == cells["train loss"]
    assert f"{1e3 * last['step_time']:.0f}" == cells["ms/step"]


# ---- report -o -----------------------------------------------------------------------------


def test_report_into_a_missing_folder_creates_it_and_says_so(
    tmp_path: Path, straight: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "a" / "b" / "r.html"
    assert main(["report", str(straight), "-o", str(page)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {page} (created the folder {page.parent})"
    assert page.read_text().startswith("<!DOCTYPE html>")
    again = page.parent / "s.html"
    assert main(["report", str(straight), "-o", str(again)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {again}"
    (tmp_path / "file").write_text("x")
    line = cli_error(["report", str(straight), "-o", str(tmp_path / "file" / "c" / "r.html")],
                     capsys)  # fmt: skip
    assert f"cannot create the folder {tmp_path / 'file' / 'c'}: {tmp_path / 'file'} is not a " \
        "directory" in line  # fmt: skip
    line = cli_error(["report", str(straight), "-o", str(tmp_path / "file" / "r.html")], capsys)
    assert f"{tmp_path / 'file'} is not a directory" in line
    assert (tmp_path / "file").read_text() == "x"
    # the folder is probed, not judged by its permission bits (root passes those for /proc)
    line = cli_error(["report", str(straight), "-o", "/proc/lowprec-r.html"], capsys)
    assert "cannot write in the folder /proc: " in line, line
    (tmp_path / "d.html").mkdir()  # a directory in place of the page: named before any work
    line = cli_error(["report", str(straight), "-o", str(tmp_path / "d.html")], capsys)
    assert f"{tmp_path / 'd.html'} is a directory; give a file name" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "d.html", "file"]


def test_docs_cli_lists_every_train_flag() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    flags = {s for a in _train_parser()._actions for s in a.option_strings if s.startswith("--")}
    missing = sorted(f for f in flags - {"--help"} if f"`{f}" not in text)
    assert not missing, f"docs/cli.md does not document {missing}"
    for f in fields(TrainConfig):
        row = f"| `--{f.name.replace('_', '-')}` | {f.default} |"
        assert row in text, f"docs/cli.md: no row {row!r} (the flag and its default)"


def test_a_preset_name_is_never_read_as_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bf16").write_text("not a recipe")
    d = get_recipe("fp16").to_dict()
    (tmp_path / "mine").write_text(json.dumps(d))  # an existing file without .json
    p = _train_parser()
    assert p.parse_args(["--recipe", "bf16"]).recipe == "bf16"
    assert p.parse_args(["--recipe", "mine"]).recipe == Recipe.from_dict(d)
