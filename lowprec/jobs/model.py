"""The reference model: a small GPT-style character-level transformer.

``CharGPT`` is pre-norm (``x + attn(ln(x))``, ``x + mlp(ln(x))``), with learned token and
position embeddings, causal multi-head attention written out (so the softmax can run in
FP32), a 4x GELU MLP, a final LayerNorm and an untied linear head. Initialisation follows
GPT-2: ``N(0, 0.02)``, the residual projections ``N(0, 0.02 / sqrt(2·depth))``.

Its data is :class:`lowprec.jobs.data.CharData` (re-exported here for older imports).

:func:`build_model` builds a model by name: ``reference`` (this one) or an HF transformers
architecture of :mod:`lowprec.jobs.hf_models` (``llama``, ``gpt2``, ...), sized by the same
:class:`ModelConfig`; every one is called as ``model(idx, targets) -> (logits, loss)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowprec.amp import cross_entropy_fp32, layer_norm_fp32, softmax_fp32
from lowprec.jobs.data import CharData, corpus_text  # re-exported
from lowprec.jobs.hf_models import HF_MODELS, build_hf_model

__all__ = ["CharData", "CharGPT", "ModelConfig", "build_model", "corpus_text", "model_names"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a :class:`CharGPT`. ``fp32_sensitive`` runs softmax and LayerNorm in FP32."""

    vocab_size: int = 65
    width: int = 128
    depth: int = 2
    heads: int = 4
    seq_len: int = 64
    fp32_sensitive: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "width", "depth", "heads", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be divisible by heads ({self.heads})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _LayerNorm(nn.LayerNorm):
    """LayerNorm that computes in FP32 when asked (``fp32=True``), output in input dtype."""

    def __init__(self, width: int, fp32: bool) -> None:
        super().__init__(width)
        self.fp32 = fp32

    def forward(self, x: Tensor) -> Tensor:
        if not self.fp32 or x.dtype == torch.float32:
            return super().forward(x)
        return layer_norm_fp32(x, self.normalized_shape, self.weight, self.bias, self.eps)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention ``softmax(q kᵀ/√d + causal mask) v``.

    ``attention_fn`` is the attention hook (:mod:`lowprec.float8.attention`): ``None``
    computes the formula here (softmax in FP32 with ``fp32_sensitive``); a function called
    with ``F.scaled_dot_product_attention``'s arguments replaces it (FP8 attention).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attention_fn: Callable[..., Tensor] | None = None
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.fp32_softmax = cfg.fp32_sensitive
        mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.attention_fn is not None:
            y = self.attention_fn(q, k, v, is_causal=True, scale=1.0 / math.sqrt(c // self.heads))
            return self.proj(y.transpose(1, 2).reshape(b, t, c))  # type: ignore[no-any-return]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        mask: Tensor = self.mask  # type: ignore[assignment]
        att = att.masked_fill(~mask[:t, :t], float("-inf"))
        att = softmax_fp32(att) if self.fp32_softmax else torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = _LayerNorm(cfg.width, cfg.fp32_sensitive)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = _LayerNorm(cfg.width, cfg.fp32_sensitive)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.fc_out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.fc_out(F.gelu(self.fc(self.ln2(x))))
        return out


class CharGPT(nn.Module):
    """GPT-style character LM; ``forward(idx, targets=None)`` returns ``(logits, loss)``.

    The loss is the mean cross-entropy in nats, computed in FP32 whatever the model's dtype.

    Example:
        >>> m = CharGPT(ModelConfig(vocab_size=10, width=32, depth=1, heads=2, seq_len=8))
        >>> idx = torch.zeros(2, 8, dtype=torch.long)
        >>> logits, loss = m(idx, idx)
        >>> logits.shape, loss.shape
        (torch.Size([2, 8, 10]), torch.Size([]))
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln_f = _LayerNorm(cfg.width, cfg.fp32_sensitive)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name:
                nn.init.ones_(p)
            elif name.endswith(("attn.proj.weight", "fc_out.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.depth))
            else:
                nn.init.normal_(p, std=0.02)

    @property
    def dummy_inputs(self) -> dict[str, Tensor]:
        """Example inputs, as HF models carry them: what :func:`lowprec.unit.unit_scale`
        runs once to find the adds of the modules ``torch.fx`` cannot trace (this root's
        sequence-length check, the attention's mask slice)."""
        p = self.tok.weight
        return {"idx": torch.zeros(2, self.cfg.seq_len, dtype=torch.long, device=p.device)}

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"idx: sequence length {t} exceeds seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = cross_entropy_fp32(logits, targets)
        return logits, loss


REFERENCE = "reference"


def model_names() -> tuple[str, ...]:
    """The names :func:`build_model` accepts: ``reference`` first, then the HF ones."""
    return (REFERENCE, *HF_MODELS)


def check_model_name(name: object) -> str:
    """``name`` if :func:`build_model` knows it; ``ValueError`` listing the names otherwise."""
    if not isinstance(name, str) or name not in model_names():
        raise ValueError(f"model must be one of {', '.join(model_names())}, got {name!r}")
    return name


def build_model(name: str, cfg: ModelConfig) -> nn.Module:
    """Model ``name`` (:func:`model_names`) of shape ``cfg``, randomly initialised from
    torch's global RNG: :class:`CharGPT` for ``reference``, else the HF architecture
    wrapped in :class:`~lowprec.jobs.hf_models.CausalLM` (needs ``lowprec[hf]``).

    Example:
        >>> torch.manual_seed(0) and None
        >>> m = build_model("reference", ModelConfig(vocab_size=10, width=32, depth=1, heads=2))
        >>> type(m).__name__
        'CharGPT'
    """
    check_model_name(name)
    if name == REFERENCE:
        return CharGPT(cfg)
    return build_hf_model(name, cfg)
