"""A tiny HF causal LM and token data for the integration tests (random init, no downloads)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

VOCAB, SEQ = 64, 16


def tiny_llama(seed: int = 0) -> Any:
    """A 1-layer LlamaForCausalLM of width 32, initialised from ``seed``."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg)


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """``n`` random token sequences (fixed by ``seed``), each its own labels."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(seed: int = 0) -> Any:
    """A 1-layer GPT2LMHeadModel of width 32 (Conv1D linears, tied head, dropout)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=SEQ,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)
