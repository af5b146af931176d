"""Tests for the demo job (the main job)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from lowprec.cli import main
from lowprec.jobs.demo import DEMO_RECIPES, QUICK_CONFIG, run_demo
from lowprec.jobs.train import RunError

TINY = replace(
    QUICK_CONFIG,
    steps=6,
    batch_size=2,
    seq_len=16,
    width=32,
    depth=1,
    heads=2,
    eval_every=3,
    eval_batches=1,
    ckpt_every=3,
)


def test_demo_table_plot_and_results(tmp_path: Path) -> None:
    console = Console(record=True, width=200)
    out = tmp_path / "demo"
    results = run_demo(
        out, recipes=["fp32", "fp16", "bf16"], console=console, progress=False, config=TINY
    )
    text = console.export_text()
    for col in ("val bpc", "gap to fp32", "skipped", "act-grad underflow", "ms/step"):
        assert col in text
    assert [r["recipe"] for r in results] == ["fp32", "fp16", "bf16"]
    assert results[0]["val_gap_to_fp32"] == 0.0
    png = out / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"] == results and saved["config"]["steps"] == 6
    # FP16 without loss scaling: even at 32 tokens a batch, a fifth of the activation
    # gradients are FP16 subnormals; FP32 and BF16 (FP32's exponent range) have only the
    # structural zeros (~0.6% here).
    by = {r["recipe"]: r for r in results}
    assert by["fp16"]["act_grad_underflow"] > 0.1
    assert by["fp32"]["act_grad_underflow"] < 0.02 and by["bf16"]["act_grad_underflow"] < 0.02
    with pytest.raises(RunError, match="already exists"):
        run_demo(out, recipes=["fp32"], progress=False, config=TINY)


def test_demo_rejects_unknown_recipe(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="valid: fp32"):
        run_demo(tmp_path / "x", recipes=["fp32", "nope"], progress=False, config=TINY)
    assert not (tmp_path / "x").exists()


def test_default_recipes_cover_the_issue() -> None:
    assert set(DEMO_RECIPES) == {
        "fp32",
        "bf16",
        "fp16",
        "fp16-static-ls",
        "fp16-dynamic-ls",
        "amp-bf16",
        "fp8-tensorwise",
        "fp8-delayed",
        "fp8-rowwise",
        "mxfp8",
        "fp32-unit",
        "fp16-unit",
        "bf16-unit",
        "fp8-unit",
        "fp16-scalify",
        "fp8-scalify",
    }


@pytest.mark.slow
def test_cli_demo_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The smoke run a user would try first: every demo recipe, well under a minute."""
    out = tmp_path / "quick"
    assert main(["demo", "--quick", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    for name in DEMO_RECIPES:
        assert name in text
    assert (out / "loss_curves.png").is_file()


def test_cli_demo_seed_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "seeded"
    assert (
        main(
            [
                "demo",
                "--quick",
                "--seed",
                "3",
                "--recipes",
                "fp32",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == 3
    for bad, msg in ((["--seed", "-1"], "--seed"), (["--recipes", "fp9"], "valid: fp32")):
        with pytest.raises(SystemExit) as e:
            main(["demo", "--quick", "--out", str(tmp_path / "x"), *bad])
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["demo", "--quick", "--recipes", "fp32", "--out", str(out)])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err
