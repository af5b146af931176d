"""Unit-scaled attention and dropout (re-exported by :mod:`lowprec.unit.functional`).

``scaled_dot_product_attention`` supports what HF transformers' attention calls pass:
causal or not, a boolean ``attn_mask``, attention dropout and grouped-query attention
(``enable_gqa``). A float (additive) mask is refused by name: its values are not a
pattern of allowed keys, so the softmax's spread cannot be derived from it.

Example:
    >>> import torch
    >>> q = torch.randn(2, 4, 64, 16); kv = torch.randn(2, 2, 64, 16)
    >>> y = scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    >>> y.shape
    torch.Size([2, 4, 64, 16])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.unit import moments
from lowprec.unit.core import (
    check_flag,
    check_float,
    check_number,
    check_same_dtype,
    scale_bwd,
    scale_fwd,
)
from lowprec.unit.core import unit_op as _unit_op

__all__ = ["dropout", "scaled_dot_product_attention"]


@_unit_op
def dropout(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Inverted dropout multiplies kept values by ``1/(1-p)``: ``Var y = Var x/(1-p)`` and
    likewise ``∂x``; both passes are scaled by ``√(1-p)`` (one scale: a plain multiply).
    ``inplace=True`` is refused (``ValueError``): the scale makes a new tensor anyway."""
    if check_flag("inplace", inplace):
        raise ValueError("inplace=True is not supported by the unit-scaled dropout")
    check_float("x", x)
    if not 0.0 <= check_number("p", p) < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p!r}")
    if not check_flag("training", training) or p == 0.0:
        return x
    return F.dropout(x, p, training=True) * math.sqrt(1.0 - p)


def check_mask(attn_mask: Tensor | None, is_causal: bool) -> None:
    """The masks the unit attention takes: a boolean ``attn_mask`` or ``is_causal``, not
    both; a float (additive) mask is refused (``ValueError``: its values are not a set of
    allowed keys, so the attention's variance has no rule)."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise ValueError(
            f"attn_mask: a float (additive) mask of dtype {attn_mask.dtype} is not supported "
            "(its values are not a set of allowed keys); pass a boolean mask or is_causal=True"
        )
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask, is_causal: give one of them, not both (as torch)")


def check_qkv(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> int:
    """``ValueError``/``TypeError`` unless ``q, k, v`` are floating tensors of one dtype with
    ``(..., L, E)`` dims, and with ``enable_gqa`` ``(..., H, L, E)`` with ``q``'s heads a
    multiple of ``k``'s; the number ``G`` of query heads per key/value head (1 without)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name}: need (..., L, E) with >= 2 dims, got {tuple(t.shape)}")
    check_same_dtype(q=q, k=k, v=v)
    if not enable_gqa:
        return 1
    if q.dim() < 3 or k.dim() < 3 or k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
        raise ValueError(
            f"q, k: enable_gqa needs (..., H, L, E) with q's heads a multiple of k's, "
            f"got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    return q.shape[-3] // k.shape[-3]


@_unit_op
def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> Tensor:  # fmt: skip
    """``softmax(q kᵀ·scale [+ mask]) v`` (torch's arguments) with fixed unit scales.

    For unit ``q, k, v`` the logits have std ``σ = scale·√d``. A row of ``m`` allowed keys
    (``m = n`` keys; ``m = i+1`` with ``is_causal``; the count of ``True`` entries of a
    boolean ``attn_mask``, read once per call) gives ``Var y_i = Σ_j p_ij²``; its
    expectation ``P2(m)`` over Gaussian logits is sampled
    (:func:`lowprec.unit.moments.softmax_row_table`; ``P2 ≈ e^{σ²}/m`` only while
    ``e^{σ²} ≪ m``) and averaged over the rows:

    * dropout ``p`` keeps ``p_ij/(1-p)`` with probability ``1-p``: ``P2 → P2/(1-p)``;
    * the output and ``∂q, ∂k, ∂v`` are scaled by one ``s = 1/√P2``: ``q, k, v`` come from
      one activation in a model, so their edges are not cut edges and share the output's
      scale (the cut-edge rule); the backward is the exact gradient of the scaled
      forward. ``∂v`` is then unit; ``∂q, ∂k`` have rms ``√(D2/P2)`` with
      ``D2 = σ²·E[Σ_j p_ij²(u_j - Σ_k p_ik u_k)²]`` (``u`` unit): about ``σ`` for
      small ``σ``, within a factor of about 2.3 of 1 from ``σ = 0.5`` to 4
      (docs/unit-scaling.md);
    * ``enable_gqa`` (``H_q = G·H_kv`` query heads share a key/value head): ``∂k, ∂v`` sum
      ``G`` heads' contributions and get a further ``1/√G``, which the key/value
      projections' ``G`` times smaller fan-out undoes where their input gradients meet the
      query projection's (a unit linear scales its input gradient by ``1/√fan_out``). The
      forward equals the repeated-key/value formulation (``k, v`` repeated ``G`` times
      along the head dim).

    A float ``attn_mask`` is refused (``ValueError``): its additive values are not a set
    of allowed keys.
    """
    check_mask(attn_mask, is_causal)
    p_drop = check_number("dropout_p", dropout_p)
    if not 0.0 <= p_drop < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    group = check_qkv(q, k, v, enable_gqa)
    if scale is not None:
        scale = check_number("scale", scale)
    d, n, rows = max(1, q.shape[-1]), max(1, k.shape[-2]), max(1, q.shape[-2])
    sigma = (d**-0.5 if scale is None else abs(scale)) * d**0.5
    if attn_mask is not None:
        counts, p2s, _ = moments.softmax_row_table(n, sigma)
        keys = attn_mask.sum(-1, dtype=torch.float32)  # exact to 2**24 keys a row
        p2 = float(moments.row_values(keys, counts, p2s).mean())
    else:
        p2, _ = moments.attention_rows(rows, n, sigma, is_causal)
    s = (p2 / (1.0 - p_drop)) ** -0.5
    q = scale_bwd(q, s)
    k, v = scale_bwd(k, s * group**-0.5), scale_bwd(v, s * group**-0.5)
    kw = {"enable_gqa": True} if enable_gqa else {}
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=p_drop, is_causal=is_causal, scale=scale, **kw
    )
    return scale_fwd(y, s)
