"""Activation checkpointing and the recipes' torch function modes.

``torch.utils.checkpoint`` runs a layer's forward again in backward outside the modes the
forward ran in (it restores autocast and the RNG only). A new user's trial measured a unit
recipe's gradients 16x to 3e7x off under reentrant checkpointing (the layers recomputed
without the unit mode), silently, and an FP16/BF16 recipe's LayerNorm gradients 1e-4 to
4e-2 relative off (softmax and normalisations recomputed without ``SensitiveInFp32``). A
unit model now refuses to train with HF's activation checkpointing enabled, and
``compute()`` warns for the modes it would lose. (Float8 layers' own state is replayed:
``tests/float8/test_checkpointing.py``.)
"""

from __future__ import annotations

import logging

import pytest
import torch

from lowprec.recipes import prepare

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_unit_model_refuses_to_train_with_activation_checkpointing(use_reentrant: bool) -> None:
    run = prepare(_llama(), "fp32-unit")
    run.model.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
    with pytest.raises(NotImplementedError, match="gradient_checkpointing_disable"):
        with run.compute():
            run.model(input_ids=IDS, labels=IDS)
    with torch.no_grad():  # nothing is recomputed without a backward: it runs
        assert torch.isfinite(run.model(input_ids=IDS, labels=IDS).loss)
    run.model.gradient_checkpointing_disable()
    with run.compute():
        run.model(input_ids=IDS, labels=IDS).loss.backward()


def test_compute_warns_that_checkpointed_layers_lose_its_fp32_modes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lowprec.core.warn import _WARNED

    _WARNED.discard("compute:checkpointing:bf16")
    run = prepare(_llama(), "bf16")
    with caplog.at_level(logging.WARNING, logger="lowprec"), run.compute():
        run.model(input_ids=IDS, labels=IDS)
    assert "activation checkpointing" not in caplog.text  # not enabled: no warning
    run.model.gradient_checkpointing_enable({"use_reentrant": True})
    with caplog.at_level(logging.WARNING, logger="lowprec"), run.compute():
        run.model(input_ids=IDS, labels=IDS).loss.backward()
    assert "recipe bf16: activation checkpointing recomputes layers" in caplog.text
