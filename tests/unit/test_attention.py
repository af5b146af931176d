"""lowprec.unit's attention (grouped-query, dropout, boolean mask), embedding ``padding_idx``
and cross-entropy ``ignore_index``, against torch references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.unit import functional as U


def _randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _grads(y: Tensor, *xs: Tensor, seed: int = 9) -> list[Tensor]:
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    return list(torch.autograd.grad(y, xs, g))


def test_gqa_equals_repeated_kv() -> None:
    """``enable_gqa`` is the repeat-kv formulation: same output and ``∂q``; ``∂k, ∂v`` are
    the repeated formulation's (summed over the group of G = 4 query heads) times 1/√G."""
    q = _randn(2, 8, 64, 16, seed=0)
    k, v = _randn(2, 2, 64, 16, seed=1), _randn(2, 2, 64, 16, seed=2)
    y = U.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k_rep, v_rep = (t.repeat_interleave(4, dim=1) for t in (k, v))
    ref = U.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)  # same maths, fp32 rounding
    gq, gk, gv = _grads(y, q, k, v)
    rq, rk, rv = _grads(ref, q, k, v)
    torch.testing.assert_close(gq, rq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gk, rk / 2.0, rtol=1e-5, atol=1e-6)  # 1/√4
    torch.testing.assert_close(gv, rv / 2.0, rtol=1e-5, atol=1e-6)


def test_gqa_unit_scale() -> None:
    """At init, on unit-normal inputs, output and ∂v std ≈ 1 (±15%: the min(1, e^σ²/m) law
    over 256 keys), ∂q, ∂k within 0.7..1.3 (their centring term); a plain sum over the
    group would give ∂v std 2."""
    q = _randn(4, 8, 256, 32, seed=3)
    k, v = _randn(4, 2, 256, 32, seed=4), _randn(4, 2, 256, 32, seed=5)
    y = U.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    gq, gk, gv = _grads(y, q, k, v)
    assert 0.85 <= y.std().item() <= 1.15 and 0.85 <= gv.std().item() <= 1.15
    assert all(0.7 <= g.std().item() <= 1.3 for g in (gq, gk)), (gq.std(), gk.std())


def test_attention_dropout_keeps_unit_scale() -> None:
    """With dropout p = 0.2 the output and ∂v stay unit (±10%, 2^18 samples, law ±5%); the
    unscaled dropout would give std 1/√(1-p) = 1.12 times the p = 0 one."""
    q, k, v = (_randn(4, 4, 256, 64, seed=s) for s in (6, 7, 8))
    torch.manual_seed(0)
    y = U.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
    (gv,) = _grads(y, v)
    y0 = U.scaled_dot_product_attention(q, k, v)
    assert 0.9 <= y.std().item() <= 1.1 and 0.9 <= gv.std().item() <= 1.1
    assert abs(y.std().item() / y0.std().item() - 1.0) < 0.06


def test_bool_mask_equals_causal() -> None:
    """A lower-triangular boolean mask is ``is_causal``: same allowed keys per row, so the
    same scales and output (fp32 rounding)."""
    q, k, v = (_randn(2, 2, 32, 8, seed=s) for s in (10, 11, 12))
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    a = U.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    b = U.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_grads(a, q)[0], _grads(b, q)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attn_mask: a float"):
        U.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(32, 32))
    with pytest.raises(ValueError, match="enable_gqa"):
        U.scaled_dot_product_attention(q, k[:, :1].repeat(1, 3, 1, 1), v, enable_gqa=True)


def test_embedding_padding_idx() -> None:
    """``padding_idx``: forward is ``F.embedding``'s; the padding row's gradient stays zero
    (exactly, as in torch); the other rows get the unit scale √(V/B)."""
    w = _randn(16, 8, seed=13)
    idx = torch.tensor([[0, 3, 0, 5], [3, 3, 0, 1]])
    y = U.embedding(idx, w, padding_idx=0)
    torch.testing.assert_close(y, F.embedding(idx, w, padding_idx=0))
    (g,) = _grads(y, w)
    (ref,) = _grads(F.embedding(idx, w, padding_idx=0), w)
    assert torch.equal(g[0], torch.zeros(8))
    torch.testing.assert_close(g, ref * math.sqrt(16 / 8))
    with pytest.raises(ValueError, match="padding_idx"):
        U.embedding(idx, w, padding_idx=16)


def test_cross_entropy_ignore_index() -> None:
    """Ignored targets count for nothing: the forward is ``F.cross_entropy``'s mean over the
    counted targets, and the counted rows' gradient equals the unit cross-entropy of those
    rows alone (the ``1/N`` of the mean is forward-only, so ignored rows change nothing)."""
    logits = _randn(12, 10, seed=14)
    t = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(0))
    t[[1, 4, 7]] = -100
    loss = U.cross_entropy(logits, t)
    torch.testing.assert_close(loss, F.cross_entropy(logits, t))
    (g,) = torch.autograd.grad(loss, logits)
    keep = t != -100
    sub = logits.detach()[keep].requires_grad_()
    (g_sub,) = torch.autograd.grad(U.cross_entropy(sub, t[keep]), sub)
    torch.testing.assert_close(g[keep], g_sub)
    assert torch.equal(g[~keep], torch.zeros(3, 10))
