"""Tiny random HF transformers MoE models (built from their configs, no download) shared
by the MoE tests of unit scaling, scalify and float8 and the FSDP2 MoE worker."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"]
VOCAB = 64


def config(family: str, layers: int = 2, hidden: int = 32, **extra: Any) -> Any:
    """A tiny config of ``family`` (4 experts, top-2; DeepSeek-V3: 8 experts in 2 groups)."""
    import transformers as T

    c: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(**c, intermediate_size=48, moe_intermediate_size=24,
                                shared_expert_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, **extra)  # fmt: skip
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(**c, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                                num_experts=4, num_experts_per_tok=2, **extra)  # fmt: skip
    if family == "mixtral":
        return T.MixtralConfig(**c, intermediate_size=48, num_local_experts=4,
                               num_experts_per_tok=2, **extra)  # fmt: skip
    if family == "olmoe":
        return T.OlmoeConfig(**c, intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                             **extra)  # fmt: skip
    if family == "gpt_oss":
        kinds = ["sliding_attention", "full_attention"] * layers
        return T.GptOssConfig(**c, head_dim=8, intermediate_size=24, num_local_experts=4,
                              num_experts_per_tok=2, layer_types=kinds[:layers],
                              sliding_window=16, **extra)  # fmt: skip
    if family != "deepseek_v3":
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return T.DeepseekV3Config(
        **c, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1 if layers > 1 else 0, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **extra,
    )  # fmt: skip


def model(
    family: str, layers: int = 2, seed: int = 0, routers: bool = True, **extra: Any
) -> nn.Module:
    """A plain model of ``family``; the 3-D expert weights and parameters HF leaves empty
    drawn ``N(0, 0.05²)``, and with ``routers`` the routers' weights too (some families
    initialise them to zeros: every token then ties between experts)."""
    import transformers as T

    torch.manual_seed(seed)
    m = T.AutoModelForCausalLM.from_config(config(family, layers, **extra))
    router = ("gate.weight", "router.weight") if routers else ()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 3 or n.endswith(router) or not bool(torch.isfinite(p).all()):
                p.normal_(0.0, 0.05)
    return m


def ids(batch: int = 2, seq: int = 12, seed: int = 1) -> Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
