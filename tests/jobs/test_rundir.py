"""The run directory: atomic rewrites, line-atomic appends, torn last lines, resume from a
run stopped before its first checkpoint, corrupt files (issue 14, defects 2 and 3)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import lowprec.jobs.rundir as rundir
import lowprec.jobs.train as train_mod
from lowprec._json import dumps, loads
from lowprec.jobs.run_summary import summary_of
from lowprec.jobs.rundir import (
    RunError,
    RunNote,
    append_jsonl,
    load_checkpoint,
    read_config,
    read_jsonl,
    read_metrics,
    truncate_jsonl,
    write_atomic,
)
from lowprec.jobs.train import TrainConfig, train

TINY = TrainConfig(
    steps=6,
    batch_size=4,
    seq_len=16,
    width=32,
    depth=1,
    heads=2,
    warmup=2,
    eval_every=3,
    eval_batches=1,
    ckpt_every=4,
)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rundir") / "straight"
    train(TINY, out, progress=False)
    return out


def test_a_kill_during_a_rewrite_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """truncate_jsonl writes a temporary file and renames it: a kill before the rename
    (here: the rename fails) leaves every old line in place."""
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, [{"step": i, "loss": 1.0} for i in range(1, 6)])
    before = path.read_text()

    def killed(*args: object) -> None:
        raise KeyboardInterrupt  # as a SIGKILL between the write and the rename

    monkeypatch.setattr(rundir.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        truncate_jsonl(path, 2)
    assert path.read_text() == before
    monkeypatch.undo()
    truncate_jsonl(path, 2)  # the stale .tmp file is simply replaced
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_write_atomic_never_truncates_in_place(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    write_atomic(path, "old")
    ino = path.stat().st_ino

    def half_then_crash(f: object) -> None:
        f.write(b"half")  # type: ignore[attr-defined]
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        write_atomic(path, half_then_crash)
    assert path.read_text() == "old" and path.stat().st_ino == ino
    write_atomic(path, b"new")
    assert path.read_text() == "new"


def test_appends_are_whole_lines_and_a_torn_last_line_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    append_jsonl(path, [{"step": 1}, {"step": 2}])
    append_jsonl(path, [])
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # a kill in the middle of an append
    with pytest.warns(RunNote, match=r"m\.jsonl: dropped a torn last line \(line 3"):
        assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"step": 2}')  # complete JSON, but no newline: torn too
    with pytest.warns(RunNote):
        assert read_jsonl(path) == [{"step": 1}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(RunError, match="line 2 is not a JSON object"):
        read_jsonl(path)
    path.write_text('{"step": "one"}\n')
    with pytest.raises(RunError, match="non-integer step"):
        read_jsonl(path)


def test_resume_after_a_torn_metrics_line_is_exact(tmp_path: Path, straight: Path) -> None:
    """A kill mid-append tore the last metrics line: --resume drops it (with a note, never
    a JSONDecodeError), rewrites the file atomically and continues bit-exactly."""
    out = tmp_path / "torn"
    train(TINY, out, progress=False, stop_after=5)  # checkpoint at 5, metrics 1..5
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"loss": 4.1, "ste')
    with pytest.warns(RunNote, match="torn last line"):
        train(TINY, out, resume=True, progress=False)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
    assert _losses(out) == _losses(straight)


def test_resume_before_the_first_checkpoint_starts_at_step_0(
    tmp_path: Path, straight: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run killed after 3 steps, before its first checkpoint (step 4): a fresh run still
    refuses the directory, --resume starts from step 0 and logs every step once."""
    out = tmp_path / "early"
    real = train_mod._train_step
    calls = {"n": 0}

    def crash_in_4(*args: object) -> dict[str, object]:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("killed")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(train_mod, "_train_step", crash_in_4)
    with pytest.raises(RuntimeError, match="killed"):
        train(TINY, out, progress=False)
    monkeypatch.undo()
    assert not (out / "checkpoint.pt").exists() and len(read_metrics(out)) == 3
    with pytest.raises(RunError, match="already exists; pass --resume"):
        train(TINY, out, progress=False)
    train(TINY, out, resume=True, progress=False)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))
    assert _losses(out) == _losses(straight)
    with pytest.raises(RunError, match="not a run directory"):
        train(TINY, tmp_path / "nothing", resume=True, progress=False)


def test_resume_refuses_lost_history(tmp_path: Path) -> None:
    out = tmp_path / "lost"
    train(TINY, out, progress=False, stop_after=4)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:1] + lines[2:]))  # step 2 deleted
    with pytest.raises(RunError, match=r"does not hold steps 1\.\.4"):
        train(TINY, out, resume=True, progress=False)


def test_corrupt_config_and_checkpoint_give_run_errors(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(TINY, out, progress=False, stop_after=4)
    config = (out / "config.json").read_text()
    (out / "config.json").write_text(config[:20])
    with pytest.raises(RunError, match=r"config\.json is corrupt or unreadable"):
        train(TINY, out, resume=True, progress=False)
    (out / "config.json").write_text("[1, 2]")
    with pytest.raises(RunError, match="expected an object with a 'train' object"):
        read_config(out, "--resume")
    (out / "config.json").write_text(config)
    state = load_checkpoint(out)
    del state["run"]["recipe"]
    torch.save(state, out / "checkpoint.pt")
    with pytest.raises(RunError, match="no 'recipe' in its run state"):
        train(TINY, out, resume=True, progress=False)
    torch.save({"step": 4}, out / "checkpoint.pt")
    with pytest.raises(RunError, match="missing keys"):
        load_checkpoint(out)
    with pytest.raises(RunError, match="missing keys"):  # mapped: checked the same
        load_checkpoint(out, mmap=True)


def test_a_mapped_checkpoint_is_the_read_one(straight: Path) -> None:
    """``mmap=True`` (the resume's early look at the step) gives the same state: every
    tensor equal, every other value equal; ``mmap`` must be a bool."""
    read, mapped = load_checkpoint(straight), load_checkpoint(straight, mmap=True)
    flat_read, spec_read = torch.utils._pytree.tree_flatten(read)
    flat_mapped, spec_mapped = torch.utils._pytree.tree_flatten(mapped)
    assert spec_read == spec_mapped and len(flat_read) > 10
    for a, b in zip(flat_read, flat_mapped, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b or (a != a and b != b)  # NaN equals NaN here
    assert mapped["step"] == TINY.steps
    with pytest.raises(TypeError, match="mmap must be a bool, got int"):
        load_checkpoint(straight, mmap=1)  # type: ignore[arg-type]


def test_sizes_are_checked_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "big"
    with pytest.raises(RunError, match="--seq-len 10000000 is too long for the corpus"):
        train(replace(TINY, seq_len=10_000_000), out, progress=False)
    with pytest.raises(RunError, match=r"--seq-len 100000 .* GiB, more than this machine"):
        train(replace(TINY, seq_len=100_000), out, progress=False)
    # the weights' training state too (a width of 100000 failed allocating, leaving out/)
    with pytest.raises(RunError, match=r"--width 100000 / --depth 1: .* GiB, more than"):
        train(replace(TINY, width=100_000, heads=2, depth=1), out, progress=False)
    assert not out.exists()
    from lowprec.jobs.tune import TuneConfig, run_tune

    with pytest.raises(RunError, match=r"--batch-size 100000 .* GiB, more than"):
        run_tune(TuneConfig(batch_size=100_000, seq_len=256), tmp_path / "plan.json")
    assert not (tmp_path / "plan.json").exists()


def test_unwritable_output_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunError, match="cannot create output directory"):
        train(TINY, tmp_path / "file" / "run", progress=False)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(RunError, match=r"cannot create|not writable"):
            train(TINY, ro / "run", progress=False)


def test_summary_marks_only_real_divergence() -> None:
    cfg = {"train": {"recipe": "x"}}
    base = {"skipped": False, "grad_zero_share": 0.0, "step_time": 0.1}
    nan = float("nan")
    recovered = [{**base, "step": 1, "loss": 4.0}, {**base, "step": 2, "loss": nan}]
    recovered += [{**base, "step": 3, "loss": 3.9}]
    assert summary_of(recovered, cfg)["diverged_at"] is None
    ended = [*recovered, {**base, "step": 4, "loss": nan}, {**base, "step": 5, "loss": nan}]
    assert summary_of(ended, cfg)["diverged_at"] == 4
    stopped = [*recovered, {**base, "step": 4, "loss": 3.0, "stopped": "nonfinite"}]
    assert summary_of(stopped, cfg)["diverged_at"] == 4
    text = dumps(summary_of(ended, cfg))  # strict JSON: no bare NaN
    assert json.loads(text, parse_constant=_refuse)["train_loss"] == "NaN"
    assert math.isnan(loads(text)["train_loss"])


def _refuse(token: str) -> None:
    raise ValueError(f"bare {token}: not strict JSON")


def test_strict_json_encoding_of_nonfinite_numbers(tmp_path: Path) -> None:
    """NaN and ±Inf anywhere become the strings "NaN", "Infinity", "-Infinity" (JSON has
    no such numbers); the readers give floats back, and still read the bare tokens of
    files written before."""
    inf = float("inf")
    value = {"a": math.nan, "b": [1.5, -inf, {"c": inf}], "d": "text", "e": None, "f": 2}
    text = dumps(value)
    assert text == (
        '{"a": "NaN", "b": [1.5, "-Infinity", {"c": "Infinity"}], "d": "text", "e": null, "f": 2}'
    )
    back = loads(text)
    assert math.isnan(back["a"]) and back["b"] == [1.5, -inf, {"c": inf}]
    assert {k: back[k] for k in "def"} == {"d": "text", "e": None, "f": 2}
    with pytest.raises(TypeError):
        dumps({"x": object()})
    path = tmp_path / "m.jsonl"
    append_jsonl(path, [{"step": 1, "loss": math.nan}, {"step": 2, "loss": inf}])
    for line in path.read_text().splitlines():
        json.loads(line, parse_constant=_refuse)
    truncate_jsonl(path, 1)
    assert path.read_text() == '{"step": 1, "loss": "NaN"}\n'
    path.write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": -Infinity}\n')  # before
    recs = read_jsonl(path)
    assert math.isnan(recs[0]["loss"]) and recs[1]["loss"] == -inf


def test_tracker_save_is_strict_json(tmp_path: Path) -> None:
    """Tracker.save (lowprec.analysis.tracking), the other JSON-lines writer, writes a
    non-finite number as a string (its statistics are finite for any tensor, so the
    record here is set by hand), and the readers give the float back."""
    from lowprec.analysis.tracking import Tracker

    m = torch.nn.Linear(3, 2)
    tracker = Tracker(m, ("fp16",), auto_step=False)
    tracker.enabled = True
    m(torch.ones(1, 3))
    tracker.remove()
    tracker.records[0]["rms"] = float("inf")
    path = tracker.save(tmp_path / "n.jsonl")
    lines = [json.loads(ln, parse_constant=_refuse) for ln in path.read_text().splitlines()]
    assert lines[0]["rms"] == "Infinity" and len(lines) == len(tracker.records) >= 3
    assert read_jsonl(path, ("step", "name"))[0]["rms"] == float("inf")


def test_a_checkpoint_of_another_size_is_refused_in_a_short_line(tmp_path: Path) -> None:
    """A checkpoint of a wider model in the run's directory: one short line naming the
    first mismatches and how many more (torch's message listed every tensor: 3 KB)."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(replace(TINY, steps=2, ckpt_every=1), a, progress=False, stop_after=1)
    train(replace(TINY, steps=2, ckpt_every=1, width=64), b, progress=False, stop_after=1)
    (a / "checkpoint.pt").write_bytes((b / "checkpoint.pt").read_bytes())
    with pytest.raises(RunError, match=r"does not fit \(.* and \d+ more\)") as e:
        train(replace(TINY, steps=2, ckpt_every=1), a, resume=True, progress=False)
    assert "\n" not in str(e.value) and len(str(e.value)) < 600
