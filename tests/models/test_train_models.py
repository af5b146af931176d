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


@pytest.mark.parametrize("name", ["qwen3moe", "mixtral"])
def test_moe_models_add_their_load_balancing_loss(name: str) -> None:
    """The MoE models: 8 experts in one module of 3-D weights per layer, top-2 routing; the
    job's loss is the FP32 cross-entropy plus ``router_aux_loss_coef`` times the model's
    own load-balancing loss, whose gradient reaches the router."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=30, width=32, depth=2, heads=4, seq_len=16)
    m = build_model(name, cfg)
    assert isinstance(m, CausalLM)
    hf = m.model.config  # type: ignore[union-attr]
    assert (hf.num_local_experts, hf.num_experts_per_tok) == (8, 2)
    mlp = m.model.model.layers[0].mlp  # type: ignore[union-attr]
    assert mlp.experts.gate_up_proj.shape == (8, 2 * 64, 32)  # (experts, gate+up, width)
    x = torch.randint(0, 30, (2, 16))
    y = torch.randint(0, 30, (2, 16))
    logits, loss = m(x, y)
    assert loss is not None
    out = m.model(input_ids=x, use_cache=False)
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    aux = out.aux_loss
    assert float(aux.detach()) > 1.0  # E·Σ f_i·P_i is about top_k at a uniform router: 2
    coef = hf.router_aux_loss_coef
    assert torch.allclose(loss, ce + coef * aux, rtol=0, atol=1e-6)
    # the router's gradient: the cross-entropy's plus coef times the auxiliary loss's
    grads = []
    for part in ("all", "ce", "aux"):
        m.zero_grad()
        logits, loss = m(x, y)
        assert loss is not None
        ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        {"all": loss, "ce": ce, "aux": (loss - ce) / coef}[part].backward()
        grads.append(mlp.gate.weight.grad.clone())
    g_all, g_ce, g_aux = grads
    assert g_aux.abs().max() > 0
    assert torch.allclose(g_all, g_ce + coef * g_aux, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_cli_trains_a_moe_model(tmp_path: Path) -> None:
    out = tmp_path / "moe"
    assert main(_args(out, "--model", "qwen3moe", "--recipe", "bf16")) == 0
    recs = read_metrics(out)
    assert len(recs) == 4 and all(r["loss"] == r["loss"] for r in recs)
    state = torch.load(out / "checkpoint.pt", weights_only=True)["run"]["model"]
    assert state["model.model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 128, 32)
