"""Where FP8 attention (:mod:`lowprec.float8.attention`) applies: :func:`apply_attention`,
called by :func:`lowprec.float8.apply` when ``Float8Config.attention`` is set, and
:func:`remove_attention`, called by :func:`lowprec.float8.convert_back`.

* A module with the *attention hook*: an instance attribute ``attention_fn`` set to
  ``None`` in its ``__init__``; when it is not ``None`` the module calls
  ``self.attention_fn(q, k, v, attn_mask=..., dropout_p=..., is_causal=..., scale=...,
  enable_gqa=...)`` (``F.scaled_dot_product_attention``'s arguments) instead of its own
  formula (the reference model's :class:`~lowprec.jobs.model.CausalSelfAttention`). It
  gets an :class:`~lowprec.float8.attention.FP8Attention`.
* HF transformers models whose attention implementation is ``"sdpa"`` or ``"eager"``: the
  function is registered in transformers' ``AttentionInterface`` (with SDPA's mask
  function, so masks arrive boolean, or ``None`` where SDPA would use ``is_causal``) under
  :func:`hf_attention_name` and the model is switched to it with
  ``set_attn_implementation``; the implementation it had is kept on the model and given
  back by :func:`remove_attention`. transformers is imported only when such a model is
  found.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor, nn

from lowprec.float8.attention import FP8Attention, attention_formats
from lowprec.float8.config import Float8Config

__all__ = ["HOOK", "apply_attention", "hf_attention_name", "remove_attention"]

log = logging.getLogger(__name__)

HOOK = "attention_fn"  # the attention hook's attribute
_ORIGINAL = "_lowprec_attn_original"  # an HF model's attention implementation before
_HF_PREFIX = "lowprec_fp8_"
_DEFAULT = ("e4m3fn", "e5m2")


def hf_attention_name(attn: FP8Attention) -> str:
    """The name of ``attn`` in transformers' ``AttentionInterface``:
    ``lowprec_fp8_<scaling>`` with the default formats, else followed by
    ``_<fmt>_<grad_fmt>``."""
    name = _HF_PREFIX + attn.scaling
    return name if (attn.fmt, attn.grad_fmt) == _DEFAULT else f"{name}_{attn.fmt}_{attn.grad_fmt}"


def _hf_forward(attn: FP8Attention) -> Any:
    """The ``AttentionInterface`` function of ``attn``: transformers' SDPA function's
    arguments and causal rule, output ``(B, L, H, E)``."""

    def forward(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        for unsupported in ("softcap", "s_aux", "position_bias"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(
                    f"{unsupported}: not supported by lowprec's FP8 attention "
                    f"({type(module).__name__}); convert without Float8Config.attention"
                )
        length = query.shape[2]
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(causal) and length > 1 and attention_mask is None
        if causal and key.shape[2] > length:  # a prefill that attends to its own keys only
            key, value = key[:, :, :length], value[:, :, :length]
        out = attn(query, key, value, attention_mask, dropout, causal, scaling,
                   enable_gqa=key.shape[1] != query.shape[1])  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    forward.__name__ = f"{hf_attention_name(attn)}_attention_forward"
    return forward


def _register(name: str, attn: FP8Attention) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _hf_forward(attn))
        AttentionMaskInterface.register(name, sdpa_mask)


def _hf_models(model: nn.Module) -> list[Any]:
    """The outermost HF ``PreTrainedModel``s of ``model`` (each sets its submodels')."""
    found: list[Any] = []
    inner: set[int] = set()
    for m in model.modules():
        if id(m) in inner:
            continue
        config = getattr(m, "config", None)
        if hasattr(m, "set_attn_implementation") and hasattr(config, "_attn_implementation"):
            found.append(m)
            inner.update(id(x) for x in m.modules())
    return found


def _unsupported_features(m: nn.Module) -> str:
    """What in HF model ``m``'s attention the FP8 attention forward would refuse at its
    first call (the ``softcap`` and ``s_aux`` arguments), found before anything changes:
    attention sinks (a ``sinks`` parameter, GPT-OSS) and logit soft-capping (Gemma 2)."""
    found = []
    if any(isinstance(getattr(x, "sinks", None), Tensor) for x in m.modules()):
        found.append("attention sinks (s_aux)")
    cfg: Any = getattr(m, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is not None and getattr(c, "attn_logit_softcapping", None) is not None:
            found.append("logit soft-capping (softcap)")
            break
    return " and ".join(found)


def apply_attention(model: nn.Module, config: Float8Config) -> int:
    """Run ``model``'s attention in FP8 with ``config.attention`` and
    :func:`~lowprec.float8.attention.attention_formats` ``(config)`` (module docstring):
    every module with the attention hook gets that :class:`FP8Attention`, every HF model
    using ``"sdpa"`` or ``"eager"`` attention is switched to :func:`hf_attention_name`. Returns
    the number of hooks and HF models converted; ``ValueError`` for an HF model with
    another attention implementation (checked before anything changes), a WARNING when
    there is none to convert. ``config.attention=None``: nothing to do (returns 0)."""
    if config.attention is None:
        return 0
    attn = FP8Attention(config.attention, *attention_formats(config))
    hooks = [m for m in model.modules() if HOOK in m.__dict__]
    hf = _hf_models(model)
    name = hf_attention_name(attn)
    for m in hf:
        impl = m.config._attn_implementation
        if impl not in ("sdpa", "eager") and not str(impl).startswith(_HF_PREFIX):
            raise ValueError(
                f"model: {type(m).__name__} uses attn_implementation={impl!r}; FP8 attention "
                "replaces 'sdpa' or 'eager' (load the model with one of them)"
            )
        why = _unsupported_features(m)
        if why:
            raise ValueError(
                f"model: {type(m).__name__}'s attention uses {why}, which lowprec's FP8 "
                "attention does not support; convert without Float8Config.attention"
            )
    for m in hooks:
        setattr(m, HOOK, attn)
    for m in hf:
        _register(name, attn)
        before = m.config._attn_implementation
        m.set_attn_implementation(name)
        if m.config._attn_implementation != name:
            raise ValueError(
                f"model: {type(m).__name__} does not dispatch its attention through "
                "transformers' AttentionInterface; FP8 attention cannot replace it"
            )
        m.__dict__.setdefault(_ORIGINAL, before)
    if not hooks and not hf:
        log.warning(
            "float8.apply: attention=%r but the model has no attention it can convert "
            "(a module with the attention hook, or an HF model using sdpa/eager attention)",
            config.attention,
        )
    return len(hooks) + len(hf)


def remove_attention(model: nn.Module) -> None:
    """Undo :func:`apply_attention`: hooks back to ``None``, HF models back to the
    attention implementation they had."""
    for m in model.modules():
        if isinstance(m.__dict__.get(HOOK), FP8Attention):
            setattr(m, HOOK, None)
        before = m.__dict__.pop(_ORIGINAL, None)
        hf: Any = m
        if before is not None and hasattr(hf, "set_attn_implementation"):
            hf.set_attn_implementation(before)
