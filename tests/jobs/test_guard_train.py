"""lowprec train --guard: the moves are made, recorded, and a resumed run continues exactly.

Oracle for resuming: the same run without interruption; every metrics line (losses bit for
bit) and every recorded move must be equal.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lowprec.cli.main import main
from lowprec.jobs.report import write_report
from lowprec.jobs.rundir import GUARD, METRICS, load_checkpoint
from lowprec.jobs.train import TrainConfig, train

TINY = TrainConfig(
    recipe="fp8-naive", steps=8, width=32, depth=1, heads=2, seq_len=16, batch_size=4,
    eval_every=4, ckpt_every=3, gemms_every=2, guard=True,
)  # fmt: skip


def _lines(out: Path, name: str) -> list[dict]:
    path = out / name
    if not path.exists():
        return []
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    for r in recs:
        r.pop("step_time", None)
    return recs


def test_the_guard_moves_failing_layers_and_records_them(tmp_path: Path) -> None:
    train(TINY, tmp_path / "a", progress=False)
    moves = _lines(tmp_path / "a", GUARD)
    assert moves, "scale-1 FP8 gradients of a fresh model flush: the guard must move"
    first = moves[0]
    assert first["step"] == 1 and first["frm"] == "naive" and first["to"] == "tensorwise"
    assert "flushed to zero" in first["reason"]
    metrics = _lines(tmp_path / "a", METRICS)
    assert sum(r.get("guard_moves", 0) for r in metrics) == len(moves)
    state = load_checkpoint(tmp_path / "a")
    assert [m["layer"] for m in state["guard"]["moves"]] == [m["layer"] for m in moves]
    page = write_report([tmp_path / "a"], tmp_path / "r.html", detail=False).read_text()
    assert "<h3>The guard's moves</h3>" in page and f"The guard moved {len(moves)} layer(s)" in page


def test_without_guard_nothing_moves(tmp_path: Path) -> None:
    train(replace(TINY, guard=False), tmp_path / "b", progress=False)
    assert not (tmp_path / "b" / GUARD).exists()


@pytest.mark.parametrize("stop", [1, 4, 5])
def test_resume_continues_exactly_with_the_moves_applied(tmp_path: Path, stop: int) -> None:
    train(TINY, tmp_path / "straight", progress=False)
    assert train(TINY, tmp_path / "cut", progress=False, stop_after=stop) == {"stopped_at": stop}
    train(TINY, tmp_path / "cut", resume=True, progress=False)
    for name in (METRICS, GUARD):
        assert _lines(tmp_path / "cut", name) == _lines(tmp_path / "straight", name), name


def test_cli_flag(tmp_path: Path) -> None:
    rc = main(
        ["train", "--recipe", "fp8-naive", "--guard", "--steps", "4", "--width", "32",
         "--depth", "1", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
         "--gemms-every", "2", "--out", str(tmp_path / "c"), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["train"]["guard"] is True and cfg["train"]["gemms_every"] == 2
    assert (tmp_path / "c" / GUARD).exists()


@pytest.mark.parametrize(("recipe", "want"), [("fp32", 12.0), ("bf16", 14.0)])
def test_the_summary_counts_the_training_state(tmp_path: Path, recipe: str, want: float) -> None:
    """Bytes per parameter of parameters + masters + AdamW moments, by storage: FP32 4+8,
    BF16 2 + FP32 master 4 + moments 8 (+ AdamW's per-tensor step counters: < 1%)."""
    s = train(replace(TINY, recipe=recipe, guard=False, steps=2), tmp_path / recipe,
              progress=False)  # fmt: skip
    assert want <= s["state_bytes_per_param"] < want * 1.01
