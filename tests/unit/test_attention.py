"""lowprec.unit's attention (grouped-query, dropout, boolean mask), embedding ``padding_idx``
and cross-entropy ``ignore_index``, against torch references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.unit import functional as U
from lowprec.unit.moments import attention_rows, row_values, softmax_row_table


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


@pytest.mark.parametrize("sigma", [0.0, 0.5, 1.0, 2.0, 4.0])
def test_row_moments_match_an_independent_sample(sigma: float) -> None:
    """``softmax_row_table``'s ``P2(m) = E[Σp²]`` and ``D2(m) = σ²·E[Σp²(u − Σpu)²]``,
    read at grid and between-grid key counts through ``row_values``, against a sample of
    our own (another seed, 4096 rows, float64): within 4% for P2 and 8% for D2 (the two
    samples' errors, ~1/√rows of a row statistic whose spread is up to its mean for P2
    and about twice that for D2 at large σ), three times that at 3000 keys, where the
    table samples 349 rows (2^20 logits). σ = 0: uniform rows, P2 = 1/m (the log-log
    interpolation is exact for this power law) and D2 = 0."""
    counts, p2s, d2s = softmax_row_table(3000, sigma)
    g = torch.Generator().manual_seed(123)
    for m in (1, 3, 16, 40, 300, 3000):
        x = torch.randn(4096, m, generator=g, dtype=torch.float64) * sigma
        u = torch.randn(4096, m, generator=g, dtype=torch.float64)
        p = torch.softmax(x, -1)
        p2 = float(p.square().sum(-1).mean())
        d2 = sigma**2 * float(
            (p.square() * (u - (p * u).sum(-1, keepdim=True)).square()).sum(-1).mean()
        )
        keys = torch.tensor([float(m)], dtype=torch.float64)
        got_p2 = float(row_values(keys, counts, p2s))
        got_d2 = float(row_values(keys, counts, d2s))
        if sigma == 0.0:
            assert got_p2 == pytest.approx(1 / m, rel=1e-9) and got_d2 < 1e-25
            continue
        k = 3 if m == 3000 else 1
        assert got_p2 == pytest.approx(p2, rel=0.04 * k), (m, got_p2, p2)
        if m > 1:
            assert got_d2 == pytest.approx(d2, rel=0.08 * k), (m, sigma, got_d2, d2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mult", [0.5, 1.0, 2.0, 4.0])
def test_sdpa_is_unit_at_every_softmax_mult(causal: bool, mult: float) -> None:
    """Unit ``q, k, v`` (2×4 heads of d = 64, 256 keys) and a unit incoming gradient: the
    rms of the output and ``∂v`` within ±10% of 1 at each multiplier, and of ``∂q, ∂k``
    within ±10% of ``√(D2/P2)`` (the rule's one scale, ``1/√P2``, on the three inputs'
    gradients; 0.42-2.08 here, measured 0.43-2.04). The closed form ``min(1, e^{σ²}/m)``
    the sampled ``P2`` replaced gave an output rms of 0.44-0.88 at mult 2 and 4."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=g).requires_grad_() for _ in range(3))
    y = U.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=mult / 8.0)
    y.backward(torch.randn(y.shape, generator=g))
    p2, d2 = attention_rows(256, 256, mult, causal)
    ratio = math.sqrt(d2 / p2)
    for name, t, want in (("y", y, 1.0), ("dq", q.grad, ratio), ("dk", k.grad, ratio),
                          ("dv", v.grad, 1.0)):  # fmt: skip
        assert t is not None
        rms = float(t.detach().double().square().mean().sqrt())
        assert 0.9 <= rms / want <= 1.1, (name, mult, causal, rms, want)


@pytest.mark.parametrize(
    ("causal", "mask", "gqa", "dropout"),
    [(False, False, False, 0.0), (True, False, False, 0.0), (False, True, False, 0.0),
     (True, False, True, 0.0), (False, False, False, 0.25)],
    ids=["full", "causal", "bool-mask", "gqa", "dropout"],
)  # fmt: skip
def test_sdpa_backward_is_the_gradient_of_its_forward(
    causal: bool, mask: bool, gqa: bool, dropout: float
) -> None:
    """``q, k, v`` of a model come from one activation ``x``: their edges are not cut edges,
    so their gradients carry the output's scale and ``∂x`` is the exact gradient of the
    unit forward ``s·SDPA(q, k, v)`` (FP64, to rounding). With grouped-query heads the key
    and value paths' share of ``∂x`` gets a further ``1/√G``. Separate scales on
    ``∂q, ∂k`` (``1/√D2``) gave a ``∂x`` at cosine 0.976 to the true one at 16 causal
    keys (4 heads of 16, mult 1)."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, L, d = 4, (2 if gqa else 4), 16, 8
    x = torch.randn(2, L, 32, generator=g, dtype=torch.float64, requires_grad=True)
    wq = torch.randn(32, heads * d, generator=g, dtype=torch.float64) / 32**0.5
    wk, wv = (torch.randn(32, kv_heads * d, generator=g, dtype=torch.float64) / 32**0.5
              for _ in range(2))  # fmt: skip
    keep = torch.rand(2, 1, L, L, generator=g) > 0.3
    keep[..., 0] = True
    gy = torch.randn(2, heads, L, d, generator=g, dtype=torch.float64)

    def heads_of(t: Tensor, h: int) -> Tensor:
        return t.view(2, L, h, d).transpose(1, 2)

    def run(unit: bool, kv_grad: bool = True) -> tuple[Tensor, Tensor]:
        """The unit rule, or plain SDPA (key/value heads repeated) by autograd; with
        ``kv_grad=False`` only the query path reaches ``x``."""
        q = heads_of(x @ wq, heads)
        xkv = x if kv_grad else x.detach()
        k, v = heads_of(xkv @ wk, kv_heads), heads_of(xkv @ wv, kv_heads)
        kw = {"attn_mask": keep if mask else None, "is_causal": causal, "dropout_p": dropout}
        torch.manual_seed(5)  # one dropout pattern for every run
        if unit:
            y = U.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)
        else:
            rep = heads // kv_heads
            k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
            y = F.scaled_dot_product_attention(q, k, v, **kw)
        (gx,) = torch.autograd.grad(y, x, gy)
        return y.detach(), gx

    y, gx = run(True)
    y_ref, gx_ref = run(False)
    s = float(y.norm() / y_ref.norm())
    torch.testing.assert_close(y, y_ref * s, rtol=1e-10, atol=1e-12)  # s·SDPA
    if gqa:  # the query path at s, the key/value paths at s/√G (G = 2)
        _, gx_q = run(False, kv_grad=False)
        gx_ref = gx_q + (gx_ref - gx_q) / 2**0.5
    torch.testing.assert_close(gx, gx_ref * s, rtol=1e-10, atol=1e-12)
