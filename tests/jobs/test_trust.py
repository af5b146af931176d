"""No file lowprec reads runs code (issue 36): run directories (``checkpoint.pt``,
``config.json``, ``metrics.jsonl``), the demo's ``demo.json``, a parallel run's
checkpoint pointer, recipe dicts, and the report's chart hand-off. Each test plants a
payload that would create a file if it were unpickled (``tests/conftest.py``), loads
through the public API or the CLI, and checks that the file does not exist and that the
error is one clear line. DCP checkpoints: ``tests/distributed/test_checkpoint_trust.py``."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lowprec.cli import main
from lowprec.jobs import report
from lowprec.jobs.rundir import RunError, load_checkpoint
from lowprec.recipes import Recipe
from tests._helpers import cli_error

TINY = [
    *("--steps", "4", "--batch-size", "2", "--seq-len", "16", "--width", "32", "--depth", "1"),
    *("--heads", "2", "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2"),
    "--no-progress",
]

Payload = tuple[Any, bytes, Path]


def _error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    return cli_error(argv, capsys, notes=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trust") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def test_checkpoint_pt_payload_is_refused(
    run: Path, tmp_path: Path, payload: Payload, capsys: pytest.CaptureFixture[str]
) -> None:
    obj, _, marker = payload
    out = _copy(run, tmp_path / "run")
    torch.save({"step": 2, "run": obj, "rng": obj}, out / "checkpoint.pt")  # a pickle payload
    with pytest.raises(RunError, match=r"checkpoint .* is corrupt or unreadable"):
        load_checkpoint(out)
    assert not marker.exists()
    line = _error_line(["train", *TINY, "--steps", "6", "--out", str(out), "--resume"], capsys)
    assert "checkpoint.pt is corrupt or unreadable" in line
    assert not marker.exists()


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl"])
def test_run_directory_json_holding_a_pickle_is_refused(
    run: Path, tmp_path: Path, payload: Payload, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    _, data, marker = payload
    out = _copy(run, tmp_path / "run")
    (out / name).write_bytes(data)
    line = _error_line(["report", str(out), "-o", str(tmp_path / "r.html")], capsys)
    assert name in line
    assert not marker.exists()


def test_demo_manifest_holding_a_pickle_is_refused(
    tmp_path: Path, payload: Payload, capsys: pytest.CaptureFixture[str]
) -> None:
    _, data, marker = payload
    out = tmp_path / "demo"
    out.mkdir()
    (out / "demo.json").write_bytes(data)
    line = _error_line(["demo", "--resume", str(out), "--no-progress"], capsys)
    assert "demo.json is damaged" in line
    assert not marker.exists()


def test_parallel_checkpoint_pointer_stays_inside_the_run(tmp_path: Path) -> None:
    # checkpoint.json names the DCP directory to load: only the run's own checkpoints.
    import json

    from lowprec.jobs.parallel import _pointer

    for bad in ("../elsewhere", "/tmp", "checkpoints/step-1/../../x"):
        (tmp_path / "checkpoint.json").write_text(json.dumps({"step": 1, "dir": bad}))
        with pytest.raises(RunError, match=r"'dir' must be checkpoints/step-<k>"):
            _pointer(tmp_path)


@pytest.mark.parametrize(
    "tag",
    ["builtins:open", "os:system", "subprocess:Popen", "lowprec.jobs.report:_draw",
     "lowprec.recipes.recipe:Recipe.from_dict", "lowprec..x:y"],
)  # fmt: skip
def test_recipe_dict_names_only_lowprec_config_classes(tag: str, payload: Payload) -> None:
    # A recipe read from JSON rebuilds only lowprec's frozen config dataclasses: a tag
    # naming any other callable (or a mutable dataclass) is refused, never called.
    d = Recipe.from_name("fp8-tensorwise").to_dict()
    d["technique"][0]["config"]["input"] = {"__class__": tag, "file": str(payload[2])}
    with pytest.raises(
        ValueError, match=r"__class__: (only lowprec|.* names no|.* is not a frozen)"
    ):
        Recipe.from_dict(d)
    assert not payload[2].exists()


def _record_spec_mode(out: str) -> None:
    """Run inside a chart worker: record the mode of the hand-off file and its folder."""
    spec = Path(sys.argv[1])
    Path(out).write_text(
        f"{stat.S_IMODE(spec.stat().st_mode):o} {stat.S_IMODE(spec.parent.stat().st_mode):o}"
    )


def test_report_chart_hand_off_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pickle the report's chart workers read is made by this process in a 0700
    # directory, created 0600 and exclusively (a planted file or link is not written to).
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    outs = [tmp_path / f"mode{i}" for i in range(8)]
    with report._private_dir() as tmp:  # the report's own temporary directory
        report._draw([(_record_spec_mode, (str(o),)) for o in outs], tmp)
    assert {o.read_text() for o in outs} == {"600 700"}
    (tmp_path / "planted").write_text("x")
    with pytest.raises(FileExistsError):
        report._write_private(tmp_path / "planted", b"data")
