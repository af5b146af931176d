"""Scale-propagation rules: scaled dot-product attention, safe softmax, linear backward ops.

``F.scaled_dot_product_attention`` picks a backend before it reaches the rules. On CPU the
fused kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward: causal,
boolean or additive ``attn_mask``, grouped-query attention) has the rule below; with
``dropout_p > 0`` torch decomposes the call into matmuls, ``_safe_softmax`` and a dropout
mask, each of which has its own rule. Notation as in :mod:`lowprec.scalify.core`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lowprec.scalify.config import current_config
from lowprec.scalify.core import Pair, deq, guard, one, out, scalar_pair, work_dtype
from lowprec.scalify.domains import is_grad, rule
from lowprec.scalify.rules import fp8_round

aten = torch.ops.aten
__all__: list[str] = []

_FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _operand(x: Any, work: torch.dtype, grad: bool = False) -> Pair:
    """``(d, s)`` with a per-tensor ``s`` (:func:`~lowprec.scalify.core.scalar_pair`); with
    the FP8 data format the data are cast as a matmul's inputs (E4M3, gradients E5M2)."""
    d, s = scalar_pair(x, work)
    if current_config().fp8_matmul:
        d = fp8_round(d, grad or is_grad(x))
    return d, s


def _mask(m: Any, work: torch.dtype) -> Any:
    """The attention mask as torch takes it: a boolean mask as is, an additive one as
    plain values (it is in logit units; its own scale, if any, is applied)."""
    if m is None or not m.is_floating_point():
        return m
    return deq(m, work)


def _scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


@rule(_FLASH_CPU)
def _sdpa(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``o = softmax(τ·q kᵀ + mask) v`` (τ = ``scale``, default ``1/√E``). With per-tensor
    scales ``τ·q kᵀ = (τ' d_q) d_kᵀ`` with ``τ' = τ·s_q·s_k``, so the kernel runs on
    ``q' = τ' d_q``, ``d_k``, ``d_v`` at scale 1 (the same logits, the same
    ``logsumexp``; τ' stays a tensor, so nothing syncs or breaks a compiled graph) and
    ``o = s_v · softmax(...) d_v``: ``d = kernel(q', d_k, d_v)``, ``s = s_v`` (each output
    row is a convex combination of ``d_v``'s rows: ``|d| ≤ max |d_v|``). Causal, masks
    and grouped-query attention (fewer key/value heads) are the kernel's own."""
    q, k, v = args[:3]
    dropout_p = float(args[3]) if len(args) > 3 else float(kwargs.get("dropout_p", 0.0))
    causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("is_causal", False))
    work = work_dtype(q, k, v)
    (dq, sq), (dk, sk), (dv, sv) = (_operand(t, work) for t in (q, k, v))
    tau = (_scale(q, kwargs.get("scale")) * sq * sk).to(work)
    o, lse = func(dq * tau, dk, dv, dropout_p, causal,
                  attn_mask=_mask(kwargs.get("attn_mask"), work), scale=1.0)  # fmt: skip
    return out(func, args, o, sv), lse


@rule(_FLASH_CPU_BWD)
def _sdpa_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    r"""The kernel's backward on ``g = d_g·s_g`` and the forward's ``q' = τ' d_q``, ``d_k``,
    ``d_v`` (scale 1) gives ``∂/∂q'``, ``dk'``, ``dv'``. With ``dS = s_g s_v · dS'``:
    ``dv = s_g·dv'``, ``dq = τ s_g s_v s_k·∂/∂q'``, ``dk = (s_g s_v / s_k)·dk'`` (each then
    :func:`~lowprec.scalify.core.guard`\ ed: ``dv'`` sums up to L rows). The kernel takes
    the forward's output as it computed it, in ``d_v``'s units: ``d_o·s_o/s_v`` (a
    rescale policy may have given ``o`` a scale other than the forward's ``s_v``)."""
    g, q, k, v, o, lse, dropout_p, causal = args[:8]
    work = work_dtype(q, k, v)
    dg, sg = _operand(g, work, grad=True)
    (dq, sq), (dk, sk), (dv, sv) = (_operand(t, work) for t in (q, k, v))
    d_o, so = scalar_pair(o, work)
    do = d_o * (so / sv).to(work)
    t = _scale(q, kwargs.get("scale"))
    tau = (t * sq * sk).to(work)
    gq, gk, gv = func(dg, dq * tau, dk, dv, do, lse, dropout_p, causal,
                      attn_mask=_mask(kwargs.get("attn_mask"), work), scale=1.0)  # fmt: skip
    f = sg * sv
    return (out(func, args, *guard(gq, f * sk * t)), out(func, args, *guard(gk, f / sk)),
            out(func, args, *guard(gv, sg)))  # fmt: skip


@rule(aten._safe_softmax.default)
def _safe_softmax(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """softmax with fully masked (all ``-inf``) rows set to 0 (sdpa's decomposition):
    ``v = f(d_x·s_x)`` in float32, ``s = 1``."""
    x = args[0]
    v = func(deq(x, work_dtype(x)), args[1])
    return out(func, args, v, one(v))


# ---- backward ops linear in the gradient --------------------------------------------------


@rule(aten.slice_backward.default, aten.select_backward.default)
def _scatter_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The gradient of a slice / select: ``g`` placed in zeros. ``d = f(d_g)``, ``s = s_g``
    (a non-scalar ``s_g`` folded to its max)."""
    dg, sg = scalar_pair(args[0], work_dtype(args[0]))
    return out(func, args, func(dg, *args[1:], **kwargs), sg)


@rule(aten.tanh_backward.default, aten.sigmoid_backward.default)
def _unit_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``g·(1 − y²)`` (tanh), ``g·y(1 − y)`` (sigmoid), ``y`` the forward output (|factor| ≤
    1): ``d = f(d_g, y)``, ``s = s_g``."""
    g, y = args[0], args[1]
    work = work_dtype(g, y)
    dg, sg = scalar_pair(g, work)
    return out(func, args, func(dg, deq(y, work)), sg)
