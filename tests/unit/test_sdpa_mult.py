"""``UnitConfig``'s ``softmax_mult`` and ``float8`` reach attention computed by
``F.scaled_dot_product_attention`` (HF's default ``"sdpa"``), as they reach attention written
out (HF's ``"eager"``). A new user's report: ``softmax_mult=10`` gave an SDPA Llama the
same output as ``softmax_mult=1``, and ``float8=True`` left its two attention matmuls
unrounded; with the multiplier, the written-out form's output was not unit (``probs_matmul``
assumed logits of variance 1).

Oracles: the written-out attention, each of whose ops is tested on its own (the eager
Llama; a hand-written masked attention), and a direct rms measurement of
``probs_matmul`` against its rule. Tolerances: SDPA and the written-out form differ only
in float32 summation order (1e-5 relative, ~100 ulps); with ``float8`` both compute the
same ops, so they must be equal bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lowprec.unit import UnitConfig
from lowprec.unit import apply as unit_apply
from lowprec.unit import functional as U

transformers = pytest.importorskip("transformers")

V = 128


def _llama(impl: str, kv_heads: int) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, attn_implementation=impl,
    )  # fmt: skip
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(cfg)


def _run(impl: str, kv_heads: int, cfg: UnitConfig) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(loss, logits, every parameter's gradient) of the unit-scaled Llama."""
    m = unit_apply(_llama(impl, kv_heads), cfg)
    ids = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(0))
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None for g in grads)
    return out.loss.detach(), out.logits.detach(), grads  # type: ignore[return-value]


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm())


@pytest.mark.parametrize("kv_heads", [4, 2])  # multi-head and grouped-query
@pytest.mark.parametrize("mult", [0.5, 2.0])
def test_softmax_mult_reaches_sdpa_as_written_out_attention(kv_heads: int, mult: float) -> None:
    """The two forms compute one model, and with one key/value head per query head one
    backward: both scale ``∂q, ∂k, ∂v`` by the output's scale (the written-out softmax
    and matmuls tie each gradient's scale to their output's; the SDPA rule gives its
    three inputs the output's scale: measured 3e-7-7e-7 apart, 1e-5 allowed). With
    grouped-query heads the SDPA rule's key/value gradients get ``1/√G``, and so do the
    written-out form's, summed over the model's repeated heads (HF's ``repeat_kv``); before,
    they did not: the key/value projections' gradients were √G too large and the layer
    input's gradient turned away from the exact one (cosine 0.94 at G = 4)."""
    cfg = UnitConfig(softmax_mult=mult)
    loss, logits, grads = _run("sdpa", kv_heads, cfg)
    loss_e, logits_e, grads_e = _run("eager", kv_heads, cfg)
    assert _rel(logits, logits_e) < 1e-5 and abs(float(loss - loss_e)) < 1e-5
    assert all(_rel(g, ge) < 1e-5 for g, ge in zip(grads, grads_e, strict=True))
    _, logits_1, grads_1 = _run("sdpa", kv_heads, UnitConfig())
    assert _rel(logits, logits_1) > 1e-2  # the multiplier changes the model...
    assert all(_rel(g, g1) > 1e-3 for g, g1 in zip(grads[:2], grads_1[:2], strict=True))


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("mult", [1.0, 2.0])
def test_float8_rounds_sdpa_as_written_out_attention(kv_heads: int, mult: float) -> None:
    cfg = UnitConfig(float8=True, softmax_mult=mult)
    loss, logits, grads = _run("sdpa", kv_heads, cfg)
    loss_e, logits_e, grads_e = _run("eager", kv_heads, cfg)
    assert torch.equal(loss, loss_e) and torch.equal(logits, logits_e)
    assert all(torch.equal(g, ge) for g, ge in zip(grads, grads_e, strict=True))
    _, logits_hp, grads_hp = _run("sdpa", kv_heads, UnitConfig(softmax_mult=mult))
    assert _rel(logits, logits_hp) > 1e-3  # FP8 rounding in attention and linears
    # ... and not the gradients' scale: every gradient's norm within 10% of the unrounded
    # model's (measured 0.97-1.05; the key/value projections' were √G too large before
    # the written-out grouped-query attention scaled its repeated heads' gradients)
    for g, g_hp in zip(grads, grads_hp, strict=True):
        assert 0.9 < float(g.norm() / g_hp.norm()) < 1.1


class _Attention(nn.Module):
    """One head of attention with a padding mask, by SDPA or written out."""

    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.qkv, self.out, self.sdpa = nn.Linear(32, 96), nn.Linear(32, 32), sdpa

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        mask = keep[:, None, :]  # (B, 1, S): the keys each query may see
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            w = (q @ k.transpose(-2, -1)) / math.sqrt(32)
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            y = torch.softmax(w, -1) @ v
        return self.out(y)


def test_float8_sdpa_with_a_boolean_mask_is_the_written_out_attention() -> None:
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[1, 11:] = False  # padding of the second sequence
    outs = []
    for sdpa in (True, False):
        m = unit_apply(_Attention(sdpa), UnitConfig(float8=True, softmax_mult=1.5, strict=True))
        xi = x.clone().requires_grad_(True)
        y = m(xi, keep)
        y.square().sum().backward()
        outs.append([y.detach(), xi.grad, *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("mult", [0.5, 1.0, 1.5])
def test_probs_matmul_is_unit_at_the_softmax_mult(mult: float) -> None:
    """For unit-normal logits over ``n = 4096`` keys (``e^{m²} ≪ n``, where the rule's
    ``Σp² ≈ e^{m²}/n`` holds) and unit ``v``, ``probs_matmul`` of the unit softmax's output
    has unit rms; ignoring ``mult`` gave ``e^{(m²-1)/2}``: 0.69 at 0.5, 1.87 at 1.5. The rms
    of 64·64 outputs has a sampling error under 2%; ±8% covers the rule's approximation."""
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(64, 4096, generator=g), torch.randn(4096, 64, generator=g)
    p = U.softmax(x, -1, mult=mult)
    y = U.probs_matmul(p, v, mult=mult)
    assert float(y.square().mean().sqrt()) == pytest.approx(1.0, rel=0.08)
    with pytest.raises(ValueError, match="mult must be finite and > 0"):
        U.probs_matmul(p, v, mult=0.0)


class _PreScaled(nn.Module):
    """Causal attention whose query is pre-scaled (OPT's, Whisper's ``q_proj(x)·d^-1/2``,
    then attention at scale 1) or scaled by the attention (the usual form), by SDPA or
    written out; the multiplication and the head split's views between them."""

    def __init__(self, sdpa: bool, pre: bool, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.out, self.sdpa, self.pre, self.heads = nn.Linear(32, 32), sdpa, pre, heads

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        d = 32 // self.heads
        q = self.q(x) * d**-0.5 if self.pre else self.q(x)
        q, k, v = (t.view(b, s, self.heads, d).transpose(1, 2) for t in (q, self.k(x), self.v(x)))
        scale = 1.0 if self.pre else None
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            w = q @ k.transpose(-2, -1)
            w = w * (1.0 if self.pre else d**-0.5)
            mask = torch.ones(s, s, dtype=torch.bool).tril()
            w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
            y = torch.softmax(w, -1) @ v
        return self.out(y.transpose(1, 2).reshape(b, s, 32))


def _err(a: Tensor, b: Tensor) -> float:
    """Relative error, absolute for a gradient that is zero in exact arithmetic (a key
    projection's bias: softmax ignores a shift of a row's logits; ~1e-6 of rounding)."""
    return float((a - b).double().norm() / max(float(b.double().norm()), 1.0))


def _prescaled_run(sdpa: bool, pre: bool, float8: bool) -> list[Tensor]:
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    m = unit_apply(_PreScaled(sdpa, pre), UnitConfig(float8=float8, strict=True))
    y = m(x)
    y.square().sum().backward()
    assert x.grad is not None
    return [y.detach(), x.grad, *(p.grad for p in m.parameters())]  # type: ignore[misc]


@pytest.mark.parametrize("sdpa", [True, False])
def test_a_pre_scaled_query_is_the_usual_attention(sdpa: bool) -> None:
    """OPT's form computes the same model as the usual one, so its unit version must too.
    Before: the SDPA rule took the pre-scaled query for a unit one (logits of variance d
    where they have 1: attention output std 0.70 in OPT), and the written-out form divided
    by √d twice (logits q·k/d), three different models (new-user trial A). Tolerance:
    the forms differ in float32 summation order and the fold's division (1e-5)."""
    ref = _prescaled_run(sdpa=True, pre=False, float8=False)
    got = _prescaled_run(sdpa=sdpa, pre=True, float8=False)
    assert all(_err(a, b) < 1e-5 for a, b in zip(got, ref, strict=True))
    # float8: SDPA and its write-out round the same operands (bit for bit, as above)
    f8 = _prescaled_run(sdpa=sdpa, pre=True, float8=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(f8, _prescaled_run(sdpa=True, pre=True, float8=True), strict=True)
    )
    for a, b in zip(f8, ref, strict=True):  # FP8 rounding, not another scale (k's bias: 0)
        assert float(b.norm()) < 1e-4 or 0.9 < float(a.norm() / b.norm()) < 1.1


def test_opt_trains_the_same_unit_model_by_sdpa_eager_and_float8() -> None:
    """HF's OPT (pre-scaled query, attention at scaling 1.0): the SDPA rule, the eager form
    and unit's float8 write-out (FP8 rounding removed) give one loss and one set of
    gradients; the attention output is unit (0.70 before, in the trial's 2-layer OPT)."""
    import lowprec.unit.products as products

    def run(impl: str, cfg: UnitConfig) -> tuple[Tensor, list[Tensor], list[float]]:
        c = transformers.OPTConfig(
            vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=64, dropout=0.0,
            attention_dropout=0.0, attn_implementation=impl,
        )  # fmt: skip
        torch.manual_seed(1)
        m = unit_apply(transformers.OPTForCausalLM(c), cfg)
        stds: list[float] = []
        for n, mod in m.named_modules():
            if n.endswith("self_attn.out_proj"):
                mod.register_forward_pre_hook(lambda _m, a: stds.append(float(a[0].std())))
        ids = torch.randint(0, V, (4, 32), generator=torch.Generator().manual_seed(0))
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), [p.grad for p in m.parameters()], stds  # type: ignore[misc]

    loss, grads, stds = run("sdpa", UnitConfig())
    assert all(0.85 < s < 1.3 for s in stds), stds
    loss_e, grads_e, _ = run("eager", UnitConfig())
    assert abs(float(loss - loss_e)) < 1e-5
    assert all(_err(a, b) < 1e-4 for a, b in zip(grads_e, grads, strict=True))
    mp = pytest.MonkeyPatch()
    with mp.context() as p:  # unit's FP8 casts made exact: the write-out's maths alone
        p.setattr(products, "quantize_ste", lambda x, *a, **k: x)
        p.setattr(products, "quantize_grad", lambda x, *a, **k: x)
        loss_8, grads_8, _ = run("sdpa", UnitConfig(float8=True))
    assert abs(float(loss - loss_8)) < 1e-5
    assert all(_err(a, b) < 1e-4 for a, b in zip(grads_8, grads, strict=True))
