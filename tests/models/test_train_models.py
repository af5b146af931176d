"""``lowprec train --model NAME``: HF architectures trained by the job, resumed exactly."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lowprec.cli import main
from lowprec.jobs.hf_models import CausalLM
from lowprec.jobs.model import CharGPT, ModelConfig, build_model, model_names
from lowprec.jobs.train import TrainConfig, build, read_metrics, train

pytest.importorskip("transformers")

TINY = TrainConfig(  # what _args gives the CLI (lr, warmup: the defaults)
    steps=4,
    batch_size=2,
    seq_len=16,
    width=32,
    depth=1,
    heads=4,
    eval_every=4,
    eval_batches=1,
    ckpt_every=2,
)


def _args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        *("--steps", "4", "--batch-size", "2", "--seq-len", "16", "--width", "32"),
        *("--depth", "1", "--heads", "4", "--eval-every", "4", "--eval-batches", "1"),
        *("--ckpt-every", "2", "--out", str(out), "--no-progress", *extra),
    ]


def test_build_model_names_and_errors() -> None:
    assert model_names()[:3] == ("reference", "llama", "gpt2")
    cfg = ModelConfig(vocab_size=20, width=32, depth=1, heads=4, seq_len=8)
    assert isinstance(build_model("reference", cfg), CharGPT)
    llama = build_model("llama", cfg)
    assert isinstance(llama, CausalLM)
    hf = llama.model.config  # type: ignore[union-attr]
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads) == (32, 1, 2)
    assert hf.vocab_size == 20
    with pytest.raises(ValueError, match="model must be one of reference, llama"):
        build_model("bert", cfg)
    with pytest.raises(ValueError, match="model must be one of"):
        TrainConfig(model="nope")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_train_hf_model_resume_is_bit_exact(tmp_path: Path, name: str) -> None:
    """4 steps straight == 2 steps, stop, resume (by the CLI, which reads the model's name
    from config.json), 2 steps: identical losses; the loss falls."""
    cfg = replace(TINY, model=name)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(cfg, straight, progress=False)
    assert json.loads((straight / "config.json").read_text())["train"]["model"] == name
    assert train(cfg, split, progress=False, stop_after=2) == {"stopped_at": 2}
    assert main(_args(split, "--resume")) == 0  # no --model: the run's own
    a = [r["loss"] for r in read_metrics(straight)]
    assert a == [r["loss"] for r in read_metrics(split)]
    assert a[-1] < a[0]
    prepared, _ = build(cfg)
    assert isinstance(prepared.model, CausalLM)


@pytest.mark.slow
def test_cli_model_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpt2"
    assert main(_args(out, "--model", "gpt2", "--recipe", "fp8-tensorwise")) == 0
    assert json.loads((out / "config.json").read_text())["train"]["model"] == "gpt2"
    state = torch.load(out / "checkpoint.pt", weights_only=True)["run"]["model"]
    assert "model.transformer.h.0.attn.c_attn.weight" in state  # HF's names, Conv1D's shape
    assert state["model.transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", "bert"])
    assert e.value.code == 2
    assert "--model" in capsys.readouterr().err
