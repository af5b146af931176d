"""HF transformers architectures for the training job: tiny configs, random init, no downloads.

``lowprec train --model NAME`` trains one of these on the shipped character corpus instead of
the reference model. Each entry maps the reference model's shape
(:class:`~lowprec.jobs.model.ModelConfig`: vocabulary, ``width``, ``depth``, ``heads``,
``seq_len``) to the architecture's own config, so the same options size every model:

=============  ==============================================================================
``llama``      ``LlamaForCausalLM``: pre-norm RMSNorm, SwiGLU MLP (``4·width``), rotary
               positions, grouped-query attention (``heads // 2`` key/value heads), SDPA
``gpt2``       ``GPT2LMHeadModel``: pre-norm LayerNorm, ``Conv1D`` linears (weight ``(in, out)``),
               learned positions, dropout 0.1 (embeddings, attention, residual), tied head
``qwen2``      ``Qwen2ForCausalLM``: Llama's layout with biased q/k/v projections, GQA
``gpt_neox``   ``GPTNeoXForCausalLM``: parallel attention and MLP residual branches, partial
               rotary positions, fused q/k/v projection
``gemma``      ``GemmaForCausalLM``: embedding multiplied by √width, ``(1 + w)`` RMSNorm,
               GeGLU MLP, multi-query attention (one key/value head), tied head
``phi``        ``PhiForCausalLM``: parallel attention and MLP on one shared LayerNorm,
               partial rotary positions, biased linears, tanh GELU
``falcon``     ``FalconForCausalLM``: ``FalconLinear`` (an ``nn.Linear`` subclass, own
               ``forward``), parallel branches summed in place (``+=``), multi-query
               attention, fused q/k/v
``qwen3moe``   ``Qwen3MoeForCausalLM``: Llama-style attention with QK norm; each MLP is 8
               experts (hidden ``2·width``, 3-D weights in one ``Qwen3MoeExperts`` module),
               top-2 routing with renormalised weights
``mixtral``    ``MixtralForCausalLM``: Llama's attention; 8 experts (hidden ``2·width``),
               top-2 routing
=============  ==============================================================================

The MoE models' loss adds the model's load-balancing loss (``router_aux_loss_coef · aux``,
as the HF model adds it when it computes the loss itself).

transformers is the optional extra ``lowprec[hf]``; it is imported only when a model is built.
The model is wrapped in :class:`CausalLM`, which gives it the reference model's contract
``model(idx, targets=None) -> (logits, loss)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lowprec.amp import cross_entropy_fp32

if TYPE_CHECKING:
    from lowprec.jobs.model import ModelConfig

__all__ = ["HF_MODELS", "CausalLM", "build_hf_model", "hf_config_kwargs", "require_transformers"]


def require_transformers() -> Any:
    """The ``transformers`` module; ``ImportError`` naming the extra when it is missing."""
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(
            "HF transformers models need the optional dependency transformers: "
            "pip install 'lowprec[hf]'"
        ) from e


def _kv_heads(heads: int) -> int:
    """Grouped-query attention: half as many key/value heads when ``heads`` is even."""
    return heads // 2 if heads % 2 == 0 else heads


def _llama(c: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_size": c.width,
        "intermediate_size": 4 * c.width,
        "num_hidden_layers": c.depth,
        "num_attention_heads": c.heads,
        "num_key_value_heads": _kv_heads(c.heads),
        "max_position_embeddings": c.seq_len,
        "tie_word_embeddings": False,
    }


def _gpt2(c: ModelConfig) -> dict[str, Any]:
    return {"n_embd": c.width, "n_layer": c.depth, "n_head": c.heads, "n_positions": c.seq_len}


def _gpt_neox(c: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_size": c.width,
        "intermediate_size": 4 * c.width,
        "num_hidden_layers": c.depth,
        "num_attention_heads": c.heads,
        "max_position_embeddings": c.seq_len,
    }


def _gemma(c: ModelConfig) -> dict[str, Any]:
    return {**_llama(c), "num_key_value_heads": 1, "head_dim": c.width // c.heads,
            "tie_word_embeddings": True}  # fmt: skip


def _falcon(c: ModelConfig) -> dict[str, Any]:
    return {"hidden_size": c.width, "num_hidden_layers": c.depth, "num_attention_heads": c.heads}


_EXPERTS, _TOP_K = 8, 2  # the MoE models: 8 experts, each token routed to 2


def _moe(c: ModelConfig) -> dict[str, Any]:
    """Llama's attention and shape, its MLP replaced by ``8`` experts of hidden size
    ``2·width`` with top-2 routing (as much compute per token as the dense ``4·width`` MLP);
    ``output_router_logits`` so the model returns its load-balancing loss."""
    return {
        **_llama(c),
        "intermediate_size": 2 * c.width,
        "num_local_experts": _EXPERTS,
        "num_experts_per_tok": _TOP_K,
        "output_router_logits": True,
    }


def _qwen3moe(c: ModelConfig) -> dict[str, Any]:
    return {**_moe(c), "moe_intermediate_size": 2 * c.width, "norm_topk_prob": True,
            "head_dim": c.width // c.heads}  # fmt: skip


# name -> (config class, model class, config kwargs of a ModelConfig, one-line description)
HF_MODELS: dict[str, tuple[str, str, Callable[[ModelConfig], dict[str, Any]], str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _llama, "Llama: RMSNorm, SwiGLU, RoPE, GQA"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _gpt2, "GPT-2: Conv1D linears, dropout, tied"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _llama, "Qwen2: Llama with q/k/v biases"),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        _gpt_neox,
        "GPT-NeoX: parallel residual branches, partial RoPE",
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", _gemma, "Gemma: scaled embedding, (1+w) norm"),
    "phi": ("PhiConfig", "PhiForCausalLM", _gpt_neox, "Phi: parallel branches, one shared norm"),
    "falcon": ("FalconConfig", "FalconForCausalLM", _falcon, "Falcon: Linear subclass, MQA"),
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        _qwen3moe,
        "Qwen3-MoE: 8 experts (3-D weights), top-2, QK norm",
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _moe, "Mixtral: 8 experts, top-2"),
}


def hf_config_kwargs(name: str, cfg: ModelConfig) -> dict[str, Any]:
    """The HF config keyword arguments of architecture ``name`` sized by ``cfg``."""
    if name not in HF_MODELS:
        raise ValueError(f"name must be one of {sorted(HF_MODELS)}, got {name!r}")
    kw = HF_MODELS[name][2](cfg)
    # No special tokens: the character vocabulary has none (HF's defaults lie outside it).
    kw.update(vocab_size=cfg.vocab_size, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return kw


class CausalLM(nn.Module):
    """An HF causal LM with the reference model's contract: ``forward(idx, targets=None)``
    returns ``(logits, loss)``, the loss the mean next-token cross-entropy in nats computed
    in FP32 (``targets`` are already shifted, as :class:`~lowprec.jobs.data.CharData` makes
    them). The HF model is ``self.model`` (``self.model.save_pretrained`` works as usual).
    """

    def __init__(self, model: nn.Module, seq_len: int) -> None:
        super().__init__()
        self.model = model
        self.seq_len = seq_len

    @property
    def dummy_inputs(self) -> dict[str, Tensor]:
        """Example inputs, as HF models carry them (what ``unit_scale`` runs once)."""
        p = next(self.model.parameters())
        return {"idx": torch.zeros(2, self.seq_len, dtype=torch.long, device=p.device)}

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if idx.dim() != 2:
            raise ValueError(f"idx: expected (batch, time) token ids, got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.seq_len:
            raise ValueError(f"idx: sequence length {idx.shape[1]} exceeds seq_len {self.seq_len}")
        out = self.model(input_ids=idx, use_cache=False)
        logits: Tensor = out.logits if hasattr(out, "logits") else out[0]
        loss = None if targets is None else cross_entropy_fp32(logits, targets)
        aux = getattr(out, "aux_loss", None)  # an MoE model's load-balancing loss
        if loss is not None and aux is not None:
            coef = float(getattr(self.model.config, "router_aux_loss_coef", 0.0))
            loss = loss + coef * aux.float()
        return logits, loss


def build_hf_model(name: str, cfg: ModelConfig, **overrides: Any) -> CausalLM:
    """Architecture ``name`` (:data:`HF_MODELS`) sized by ``cfg``, randomly initialised
    (from torch's global RNG, as HF initialises), wrapped in :class:`CausalLM`.
    ``overrides`` go to the HF config (e.g. ``attn_implementation="eager"``)."""
    tf = require_transformers()
    kw = hf_config_kwargs(name, cfg)  # refuses unknown names
    config_cls, model_cls, _, _ = HF_MODELS[name]
    kw.update(overrides)
    config = getattr(tf, config_cls)(**kw)
    model = getattr(tf, model_cls)(config)
    model.train()
    return CausalLM(model, cfg.seq_len)
