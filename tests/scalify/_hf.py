"""Tiny HF models (random init) shared by the scalify tests on HF transformers."""

from __future__ import annotations

import torch
import transformers
from torch import nn


def llama(attn: str) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def gpt2(attn: str) -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16,
        bos_token_id=0, eos_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)  # dropout 0.1 (the default), training mode


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
