"""A plan applied to a model it does not fit, and how ``lowprec tune`` and ``lowprec train
--recipe plan.json`` report their failures (new-user trial B: F1, F3, F4, F5, F6)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch import nn

import lowprec
from lowprec.autopilot import Budget, Plan
from lowprec.autopilot.guard import Guard
from lowprec.cli import main
from lowprec.float8 import Float8Config, Float8Linear
from lowprec.float8 import apply as float8_apply
from lowprec.recipes import get_recipe
from lowprec.recipes.layers import LayerRule
from tests._helpers import cli_error, world_of_one

ROOT = Path(__file__).resolve().parents[2]
ROW = Float8Config.from_name("rowwise")
TINY = [
    *("--steps", "2", "--batch-size", "2", "--seq-len", "16", "--width", "32", "--depth", "1"),
    *("--heads", "2", "--warmup", "1", "--no-progress"),
]


def _plan_recipe(*names: str) -> lowprec.Recipe:
    """A recipe as lowprec tune builds it: one rule per named layer, then the catch-all."""
    return dataclasses.replace(
        get_recipe("fp8-tensorwise"),
        name="plan-h100",
        float8_skip=(),
        layers=(*(LayerRule(n, ROW) for n in names), LayerRule("*", None)),
    )


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))


def _write_plan(path: Path, *names: str, model: str = "", version: int = 1) -> Path:
    extra = {"model": model} if model else {}
    plan = Plan(
        recipe=_plan_recipe(*names),
        cost=0.5,
        target="h100",
        budget=Budget(),
        seed=0,
        reference_loss=4.0,
        **extra,
    )
    d = plan.to_dict()
    d["version"] = version
    path.write_text(json.dumps(d))
    return path


# ---- F1: the one check, for the Python API and the CLI ---------------------------------


def test_a_plan_naming_no_layer_of_the_model_is_refused() -> None:
    """Every layer stayed BF16 silently: the plan's names are another model's."""
    recipe = _plan_recipe("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj")
    with pytest.raises(ValueError, match="none of its 2 layer rules matches") as e:
        lowprec.prepare(_model(), recipe)
    assert type(e.value).__name__ == "LayerRulesError"
    assert "plan-h100" in str(e.value) and "'model.layers.0.self_attn.q_proj'" in str(e.value)
    assert "its linear layers are '0', '2'" in str(e.value)


def test_trainer_and_distributed_paths_name_the_recipe_too() -> None:
    """The Lightning plugin and ``lowprec.distributed.prepare`` apply the recipe through the
    same check, and their refusals name the plan (they said "recipe")."""

    from lowprec.distributed.parallel import prepare as dist_prepare

    recipe = _plan_recipe("model.layers.0.mlp.up_proj")
    lightning = pytest.importorskip("lowprec.integrations.lightning")
    with pytest.raises(ValueError, match="recipe 'plan-h100': none of its 1 layer rules"):
        lightning.LowprecPrecision(recipe).convert_module(_model())
    with world_of_one():
        with pytest.raises(ValueError, match="recipe 'plan-h100': none of its 1 layer rules"):
            dist_prepare(_model(), recipe, "ddp")


def test_a_plan_with_a_misspelt_layer_warns_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lowprec.recipes.compose"):
        p = lowprec.prepare(_model(), _plan_recipe("0", "2x"))
    assert isinstance(p.model[0], Float8Linear) and type(p.model[2]) is nn.Linear
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "1 of its 2 layer rules" in warned[0] and "'2x'" in warned[0]


def test_rules_that_all_match_and_depth_relative_rules_are_quiet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No false alarm: a fitting plan, and the nvfp4-train preset's ``{last:15%}`` rule,
    which matches no block of a shallow model by design."""
    with caplog.at_level(logging.WARNING, logger="lowprec.recipes.compose"):
        lowprec.prepare(_model(), _plan_recipe("0", "2"))
        deep = nn.Sequential(*(nn.Linear(16, 16) for _ in range(2)))
        lowprec.prepare(deep, get_recipe("bf16", layers=()))  # no rules at all
        r = dataclasses.replace(
            get_recipe("fp8-tensorwise"), layers=(LayerRule("*.{last:15%}.*", None),)
        )
        lowprec.prepare(deep, r)
    assert not [r for r in caplog.records if r.name == "lowprec.recipes.compose"]


def test_cli_refuses_a_plan_for_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _write_plan(
        tmp_path / "llama.json",
        "model.model.layers.0.self_attn.q_proj",
        model="--model llama --width 32 --depth 1 --heads 2 --seq-len 16",
    )
    out = tmp_path / "run"
    line = cli_error(["train", *TINY, "--recipe", str(plan), "--out", str(out)], capsys, 2)
    assert f"--recipe {plan}: the plan, tuned on --model llama" in line, line
    assert "this run's model (--model reference --width 32" in line, line
    assert "none of its 1 layer rules matches" in line, line
    assert not any(out.iterdir())  # nothing trained; the same --out takes the next try


def test_cli_prints_the_misspelt_rule_warning_as_a_warning_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The layer-rule WARNING (a logging record) printed as a bare message in the CLI."""
    plan = _write_plan(tmp_path / "p.json", "blocks.0.fc", "blocks.0.fcx")
    assert main(["train", *TINY, "--recipe", str(plan), "--out", str(tmp_path / "r")]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "layer rules" in ln]
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: recipe 'plan-h100': 1 of its 2 layer rules"), lines
    assert "'blocks.0.fcx'" in lines[0], lines


def test_tune_records_the_model_in_the_plan(tmp_path: Path) -> None:
    from lowprec.jobs.tune import TuneConfig

    cfg = TuneConfig(model="llama", width=32, depth=1, heads=2, seq_len=16)
    assert cfg.model_flags() == "--model llama --width 32 --depth 1 --heads 2 --seq-len 16"
    p = Plan.from_dict(json.loads(_write_plan(tmp_path / "p.json", "0", model="m").read_text()))
    assert p.model == "m"


# ---- F6: the CLI reads a plan as Plan.load does ----------------------------------------


def test_cli_refuses_a_plan_of_another_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _write_plan(tmp_path / "v2.json", "blocks.0.fc", version=2)
    with pytest.raises(ValueError, match="plan version must be 1, got 2"):
        Plan.load(plan)
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--recipe", str(plan), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "plan version must be 1, got 2" in err, err
    assert not (tmp_path / "r").exists()


# ---- F5: divergence before tuning is named by its flags ---------------------------------


def test_tune_names_the_flags_when_steps_before_diverge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tune", "--steps-before", "1", "--lr", "1e6", "--width", "16", "--heads", "1"]
    argv += ["--depth", "1", "--seq-len", "16", "--out", str(tmp_path / "n4.json")]
    line = cli_error(argv, capsys, 2)
    assert "diverged during --steps-before 1 training at --lr 1e+06" in line, line
    assert "loss_fn" not in line and "reference loss" not in line, line
    assert not (tmp_path / "n4.json").exists()


# ---- F4: SIGINT and SIGTERM during tune ---------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_tune_stops_on_a_signal_with_a_true_message(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "lowprec", "tune", "--width", "64", "--depth", "2"]
    cmd += ["--heads", "2", "--seq-len", "64", "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # the first measured layer: tuning is under way
    time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err
    assert err.strip() == f"lowprec tune: interrupted ({sig.name}); no plan written to {out}"
    assert "checkpoint" not in err and not out.exists()
    assert not list(tmp_path.iterdir())


# ---- F3: percentages in the guard's reasons -------------------------------------------------


def test_guard_reason_percentages_have_no_exponent() -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    model = float8_apply(model, "tensorwise")
    guard = Guard(model)
    rec = {
        "layer": "0",
        "gemm": "forward",
        "rel_err": 0.01,
        "operands": {"weight": {"saturated": 0.9993, "flushed": 0.0}},
    }
    why = guard._reasons([rec])["0"]
    assert why == "forward: 99.9% of weight saturated", why


def test_cli_warns_of_a_plan_tuned_at_other_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plan tuned on the same model at width 64 used at width 32: its layer names fit,
    so it trained without a word (new-user trial C); now one warning line names both."""
    plan = _write_plan(
        tmp_path / "p.json",
        "blocks.0.fc",
        model="--model reference --width 64 --depth 1 --heads 2 --seq-len 16",
    )
    assert main(["train", *TINY, "--recipe", str(plan), "--out", str(tmp_path / "r")]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert len(lines) == 1, lines
    assert "the plan was tuned on --model reference --width 64" in lines[0], lines
    assert "not on this run's model (--model reference --width 32" in lines[0], lines
    same = _write_plan(
        tmp_path / "same.json",
        "blocks.0.fc",
        model="--model reference --width 32 --depth 1 --heads 2 --seq-len 16",
    )
    assert main(["train", *TINY, "--recipe", str(same), "--out", str(tmp_path / "s")]) == 0
    assert "warning:" not in capsys.readouterr().err
