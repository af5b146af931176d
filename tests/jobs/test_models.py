"""Tests for the reference model and its data."""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.jobs.data import CharData, corpus_text
from lowprec.jobs.model import CharGPT, ModelConfig


def test_corpus_is_shipped_and_split() -> None:
    text = corpus_text()
    assert len(text) == 1115394 and text.startswith("First Citizen:")
    data = CharData(seq_len=32, batch_size=4, seed=0)
    assert data.vocab_size == 65
    n_val = int(len(text) * 0.1)
    assert len(data.splits["val"]) == n_val
    assert len(data.splits["train"]) == len(text) - n_val
    assert data.decode(data.splits["train"][:14]) == "First Citizen:"


def test_batches_are_deterministic_and_shifted() -> None:
    a, b = CharData(32, 4, seed=1), CharData(32, 4, seed=1)
    x1, y1 = a.batch("train", 7)
    x2, y2 = b.batch("train", 7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (4, 32) and y1.shape == (4, 32)
    assert torch.equal(x1[:, 1:], y1[:, :-1]), "targets are the inputs shifted by one"
    assert not torch.equal(a.batch("train", 8)[0], x1)
    assert not torch.equal(CharData(32, 4, seed=2).batch("train", 7)[0], x1)
    assert not torch.equal(a.batch("val", 7)[0], x1)
    with pytest.raises(ValueError, match="split must be"):
        a.batch("test", 0)


def test_model_shapes_and_initial_loss() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=65, width=64, depth=2, heads=4, seq_len=32)
    model = CharGPT(cfg)
    x, y = CharData(32, 8, seed=0).batch("train", 0)
    logits, loss = model(x, y)
    assert logits.shape == (8, 32, 65)
    assert loss is not None and loss.dtype == torch.float32
    # At init the logits are near zero: the loss is near ln(65) = 4.174 (std 0.02 weights).
    assert abs(float(loss.detach()) - math.log(65)) < 0.05
    assert model(x)[1] is None
    with pytest.raises(ValueError, match="exceeds seq_len"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_causal_masking() -> None:
    """Changing a later token never changes the logits of earlier positions."""
    torch.manual_seed(0)
    model = CharGPT(ModelConfig(vocab_size=10, width=32, depth=2, heads=2, seq_len=16)).eval()
    x = torch.randint(0, 10, (1, 16))
    x2 = x.clone()
    x2[0, 10] = (x[0, 10] + 1) % 10
    a, b = model(x)[0], model(x2)[0]
    assert torch.equal(a[:, :10], b[:, :10]) and not torch.equal(a[:, 10:], b[:, 10:])


def test_fp32_sensitive_ops_in_half_precision() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=65, width=32, depth=1, heads=2, seq_len=16)
    ref = CharGPT(cfg)
    half = CharGPT(cfg)
    half.load_state_dict(ref.state_dict())
    half.bfloat16()
    x, y = CharData(16, 4, seed=0).batch("train", 0)
    l32, l16 = ref(x, y)[1], half(x, y)[1]
    assert l32 is not None and l16 is not None
    # BF16 weights and activations (8 bits of precision) move the loss by well under 1%.
    assert abs(float(l16.detach()) - float(l32.detach())) / float(l32.detach()) < 0.01


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"width": 0}, "width must be a positive int"), ({"width": 30, "heads": 4}, "divisible")],
)
def test_bad_model_config(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_bad_data_args() -> None:
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        CharData(0, 4)
    with pytest.raises(ValueError, match="shorter than seq_len"):
        CharData(64, 4, text="abc" * 100)
