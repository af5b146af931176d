"""FP8 attention (``Float8Config.attention``, :mod:`lowprec.float8.attention`).

Oracles:

* an FP64 reference written here from the formulas of the module docstring: each GEMM
  operand quantized by :func:`quantize_parts` (the same function and casts) matrix by
  matrix — per tensor, per (batch, head) matrix with a tensor cast, or per (batch, head)
  with an axis cast contracted over the GEMM's dim (``cd``) — dequantized exactly in FP64,
  multiplied and soft-maxed in FP64. The emulation multiplies the same payloads in FP32:
  the products are exact, the sums and the softmax round in FP32 (relative 2^-24 per
  operation, ≤ 64 terms: ~4e-6). An operand element that FP32 puts on the other side of
  an FP8 rounding boundary than FP64 would differ by a whole FP8 step (≥ 2^-4 relative):
  with these fixed inputs none does, so the tolerance is ``rtol = 2e-5`` of the largest
  magnitude (a wrong granularity or format is off by ≥ 1e-2);
* unquantized FP64 attention: each operand rounded to E4M3 (unit roundoff ``u = 2^-4``)
  or E5M2 (``2^-3``), its relative errors spread over ``[-u, u]`` (RMS ``u/√3``); a GEMM
  of two such operands has a relative RMS error ≈ ``u·√(2/3) ≈ 0.82u``, and the softmax
  and the second GEMM average over keys rather than add up. So the output's relative RMS
  error stays below ``u_E4M3 = 2^-4`` (measured 0.040-0.056 here), and each gradient,
  through GEMMs with an E5M2 operand, below ``u_E5M2 = 2^-3`` (measured 0.06-0.10).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import lowprec.float8 as f8
from lowprec.float8 import CastConfig, Float8Config
from lowprec.float8.attention import (
    ATTENTION_GEMMS,
    FP8Attention,
    attention_formats,
    attention_gemms,
    fp8_attention,
)
from lowprec.float8.attention_apply import hf_attention_name
from lowprec.float8.quant import quantize_parts
from lowprec.jobs.model import ModelConfig, build_model
from lowprec.recipes.serial import decode, encode

SCALINGS = ("tensorwise", "headwise", "rowwise")
U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3


def _qd(x: Tensor, fmt: str, scaling: str, cd: int) -> Tensor:
    """FP64 ``x (B, H, R, C)`` quantized for a GEMM contracting its dim ``cd`` of each
    (R, C) matrix (1: C, 0: R) and dequantized exactly."""
    x = x.detach().double()
    if scaling == "tensorwise":
        data, s, _ = quantize_parts(x.reshape(-1, x.shape[-1]), CastConfig(fmt), 1)
        return (data.double() * s.double()).view(x.shape)
    out = torch.empty_like(x)
    cast = CastConfig(fmt, granularity="tensor" if scaling == "headwise" else "axis")
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            data, s, _ = quantize_parts(x[b, h], cast, cd)
            out[b, h] = data.double() * s.double()
    return out


def _reference(q, k, v, g, bias, tau, scaling, keep=None, p=0.0, e4="e4m3fn", e5="e5m2"):  # type: ignore[no-untyped-def]
    """FP64 output and gradients of the quantized attention (module docstring): operands
    in ``e4``, gradients in ``e5``."""
    s = _qd(q, e4, scaling, 1) @ _qd(k, e4, scaling, 1).transpose(-1, -2) * tau
    if bias is not None:
        s = s + bias.double()
    dead = s.amax(-1, keepdim=True) == -math.inf
    prob = torch.softmax(s.masked_fill(dead, 0), -1).masked_fill(dead, 0)
    pd = prob if keep is None else prob * keep / (1 - p)
    out = _qd(pd, e4, scaling, 1) @ _qd(v, e4, scaling, 0)
    dp = _qd(g, e5, scaling, 1) @ _qd(v, e4, scaling, 1).transpose(-1, -2)
    dv = _qd(pd, e4, scaling, 0).transpose(-1, -2) @ _qd(g, e5, scaling, 0)
    if keep is not None:
        dp = dp * keep / (1 - p)
    ds = prob * (dp - (dp * prob).sum(-1, keepdim=True))
    dq = _qd(ds, e5, scaling, 1) @ _qd(k, e4, scaling, 0) * tau
    dk = _qd(ds, e5, scaling, 0).transpose(-1, -2) @ _qd(q, e4, scaling, 0) * tau
    return out, dq, dk, dv


def _inputs(seed: int = 0, b: int = 2, h: int = 4, length: int = 24, n: int = 24, d: int = 16):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, m, d, generator=gen) for m in (length, n, n))
    k = k * torch.linspace(0.2, 3.0, d)  # channels of different magnitudes, as in trained K
    g = torch.randn(b, h, length, d, generator=gen)
    return q, k, v, g


def _run(q, k, v, g, **kw):  # type: ignore[no-untyped-def]
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = fp8_attention(q, k, v, **kw)
    y.backward(g)
    return y, q.grad, k.grad, v.grad


def _close(got: Tensor, want: Tensor, rtol: float = 2e-5) -> None:
    err = float((got.detach().double() - want).abs().max())
    assert err <= rtol * float(want.abs().max()), (err, float(want.abs().max()))


def _rel_rms(got: Tensor, want: Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("scaling", SCALINGS)
def test_matches_fp64_quantized_reference(scaling: str) -> None:
    q, k, v, g = _inputs()
    tau = 0.3  # not 1/sqrt(d): the scale argument is honoured
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    bias = torch.zeros(24, 24).masked_fill(~causal, -math.inf)
    got = _run(q, k, v, g, is_causal=True, scale=tau, scaling=scaling)
    want = _reference(q, k, v, g, bias, tau, scaling)
    for a, b in zip(got, want, strict=True):
        _close(a, b)


def test_e4m3_gradients_match_reference_and_lose_less() -> None:
    """``grad_fmt="e4m3fn"`` (as fp8-deepseek's linears): the FP64 reference with E4M3
    gradients; against unquantized attention each gradient loses less than with E5M2 (one
    more mantissa bit, the range held by the dynamic scale)."""
    q, k, v, g = _inputs(9)
    got = _run(q, k, v, g, is_causal=True, scaling="rowwise", grad_fmt="e4m3fn")
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    bias = torch.zeros(24, 24).masked_fill(~causal, -math.inf)
    want = _reference(q, k, v, g, bias, 0.25, "rowwise", e5="e4m3fn")
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    e5 = _run(q, k, v, g, is_causal=True, scaling="rowwise")
    q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True).backward(g.double())
    for a, b, ref in zip(got[1:], e5[1:], (q2.grad, k2.grad, v2.grad), strict=True):
        assert ref is not None and _rel_rms(a, ref) < _rel_rms(b, ref)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_close_to_unquantized_attention(scaling: str) -> None:
    q, k, v, g = _inputs(1)
    got = _run(q, k, v, g, is_causal=True, scaling=scaling)
    q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    y.backward(g.double())
    assert _rel_rms(got[0], y) < U_E4M3
    for a, b in zip(got[1:], (q2.grad, k2.grad, v2.grad), strict=True):
        assert b is not None and _rel_rms(a, b) < U_E5M2


def test_rowwise_is_finer_than_tensorwise() -> None:
    """Keys whose channels differ in magnitude: per-row scales lose less than one scale."""
    q, k, v, g = _inputs(2)
    q2, k2, v2 = (t.double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True).backward(g.double())
    assert q2.grad is not None
    err = {s: _rel_rms(_run(q, k, v, g, is_causal=True, scaling=s)[1], q2.grad) for s in SCALINGS}
    assert err["rowwise"] < err["tensorwise"]


@pytest.mark.parametrize(("mask_kind", "scaling"), [("bool", "headwise"), ("float", "rowwise")])
def test_masks_and_fully_masked_rows(mask_kind: str, scaling: str) -> None:
    """A padding mask (batch 1 keeps 10 keys), and a query row with no allowed key: its
    output and gradients are 0, nothing is NaN (as SDPA's math backend)."""
    q, k, v, g = _inputs(3)
    allowed = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    allowed[1, :, :, 10:] = False
    allowed[0, :, 5, :] = False  # a fully masked query row
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)
    mask = allowed if mask_kind == "bool" else bias
    got = _run(q, k, v, g, attn_mask=mask, scaling=scaling)
    for a, b in zip(got, _reference(q, k, v, g, bias, 0.25, scaling), strict=True):
        assert torch.isfinite(a).all()
        _close(a, b)
    assert got[0][0, :, 5].abs().max() == 0 and got[1][0, :, 5].abs().max() == 0
    assert got[2][1, :, 10:].abs().max() == 0 and got[3][1, :, 10:].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_mask_is_refused_as_torch_does(dtype: torch.dtype) -> None:
    """An integer 0/1 mask is neither a keep mask nor a bias: ``TypeError`` naming
    ``attn_mask`` (SDPA refuses it too), never an additive bias of 0 and 1; the same mask
    as bool gives the FP64 reference's attention (``_close``'s tolerance)."""
    q, k, v, g = _inputs(8)
    keep = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    keep[1, :, :, 12:] = False
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=keep.to(dtype))
    with pytest.raises(TypeError, match="attn_mask"):
        fp8_attention(q, k, v, attn_mask=keep.to(dtype))
    bias = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
    got = _run(q, k, v, g, attn_mask=keep, scaling="rowwise")
    for a, b in zip(got, _reference(q, k, v, g, bias, 0.25, "rowwise"), strict=True):
        _close(a, b)


def test_mask_shape_is_checked_against_the_scores() -> None:
    """A mask that broadcasts to the scores ``(B, H, L, N) = (2, 4, 24, 24)`` is applied as
    its broadcast (the FP64 reference with the expanded mask, ``_close``'s tolerance); one
    that does not, or would grow them, raises ``ValueError`` naming ``attn_mask`` and both
    shapes (bool and float masks), not a broadcasting error from inside the GEMMs."""
    q, k, v, g = _inputs(9)
    gen = torch.Generator().manual_seed(1)
    for shape in [(24, 24), (1, 24), (2, 1, 1, 24), (4, 24, 1), (2, 4, 24, 24)]:
        keep = torch.rand(shape, generator=gen) > 0.3
        keep[..., 0] = True  # every query row keeps a key
        bias = torch.zeros(2, 4, 24, 24).masked_fill(~keep.expand(2, 4, 24, 24), -math.inf)
        got = _run(q, k, v, g, attn_mask=keep, scaling="headwise")
        for x, want in zip(got, _reference(q, k, v, g, bias, 0.25, "headwise"), strict=True):
            _close(x, want)
    for shape in [(24, 23), (24, 25), (3, 24, 24), (2, 4, 24, 24, 1), (1, 2, 4, 24, 24), (2,)]:
        for mask in (torch.ones(shape, dtype=torch.bool), torch.zeros(shape)):
            with pytest.raises(ValueError, match=r"attn_mask.*\(2, 4, 24, 24\)") as e:
                fp8_attention(q, k, v, attn_mask=mask)
            assert str(tuple(shape)) in str(e.value)


def test_gqa_equals_repeated_heads() -> None:
    """Grouped-query attention: the same output as repeating each key/value head for its
    query heads, and the key/value gradients summed over the group (FP32 sums)."""
    q, k, v, g = _inputs(4)
    kv, vv = k[:, :2], v[:, :2]
    got = _run(q, kv, vv, g, is_causal=True, enable_gqa=True, scaling="rowwise")
    rep = _run(q, kv.repeat_interleave(2, 1), vv.repeat_interleave(2, 1), g, is_causal=True,
               scaling="rowwise")  # fmt: skip
    assert torch.equal(got[0], rep[0]) and torch.equal(got[1], rep[1])
    for a, b in zip(got[2:], rep[2:], strict=True):
        torch.testing.assert_close(a, b.view(2, 2, 2, 24, 16).sum(2), rtol=1e-6, atol=1e-6)


def test_dropout_against_reference_with_the_same_draws() -> None:
    q, k, v, g = _inputs(5)
    torch.manual_seed(7)
    got = _run(q, k, v, g, is_causal=True, dropout_p=0.25, scaling="tensorwise")
    torch.manual_seed(7)
    keep = torch.empty(2, 4, 24, 24).bernoulli_(0.75).bool().double()
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    bias = torch.zeros(24, 24).masked_fill(~causal, -math.inf)
    want = _reference(q, k, v, g, bias, 0.25, "tensorwise", keep, 0.25)
    for a, b in zip(got, want, strict=True):
        _close(a, b)


def test_bf16_inputs_and_autocast() -> None:
    q, k, v, _ = _inputs(6)
    y32 = fp8_attention(q, k, v, is_causal=True)
    y16 = fp8_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert y16.dtype == torch.bfloat16
    assert _rel_rms(y16, y32) < U_E4M3
    with torch.autocast("cpu", torch.bfloat16):
        ya = fp8_attention(q, k, v, is_causal=True)
    assert torch.equal(ya, y32)  # computed in FP32 whatever the autocast


@pytest.mark.parametrize("scaling", SCALINGS)
def test_attention_gemms_pairs(scaling: str) -> None:
    """Each GEMM's FP32 product is the product of FP32 attention's operands; its FP8
    product quantizes them as fp8_attention does: the forward GEMMs of the FP64 reference
    (same P: no mask, so S and P come from q, k alone) within the FP32 accumulation
    tolerance, and every GEMM within one unit roundoff of its FP32 product."""
    q, k, v, g = _inputs(8)
    pairs = attention_gemms(q, k, v, g, scaling=scaling)
    assert set(pairs) == set(ATTENTION_GEMMS)
    torch.testing.assert_close(pairs["qk"][1], q @ k.transpose(-1, -2))
    want = _qd(q, "e4m3fn", scaling, 1) @ _qd(k, "e4m3fn", scaling, 1).transpose(-1, -2)
    _close(pairs["qk"][0], want)
    for name, (fp8, ref) in pairs.items():
        assert _rel_rms(fp8, ref) < (U_E4M3 if name in ("qk", "pv") else U_E5M2), name


def test_bad_options_name_the_argument() -> None:
    with pytest.raises(ValueError, match="attention"):
        Float8Config(attention="blockwise")
    with pytest.raises(ValueError, match="attention"):
        Float8Config.from_name("tensorwise", attention="TENSOR")
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="scaling"):
        fp8_attention(q, k, v, scaling="mx")
    with pytest.raises(ValueError, match="scaling"):
        FP8Attention("blockwise")
    with pytest.raises(ValueError, match="grad_fmt"):
        fp8_attention(q, k, v, grad_fmt="e2m1")
    with pytest.raises(ValueError, match="fmt"):
        FP8Attention("rowwise", fmt="bf16")
    with pytest.raises(ValueError, match="dropout_p"):
        fp8_attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="is_causal"):
        fp8_attention(q, k, v, attn_mask=torch.ones(24, 24, dtype=torch.bool), is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        fp8_attention(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="requires grad"):
        fp8_attention(q, k, v, attn_mask=torch.zeros(24, 24, requires_grad=True))


def test_config_round_trip() -> None:
    for scaling in (None, *SCALINGS):
        c = Float8Config.from_name("tensorwise", attention=scaling)
        assert Float8Config.from_dict(c.to_dict()) == c
        assert decode(Float8Config, encode(c)) == c
    assert "attention=rowwise" in Float8Config(attention="rowwise").describe()


def test_formats_follow_the_linears() -> None:
    """FP8 attention takes the config's input and gradient formats where they are FP8,
    else E4M3 and E5M2 (an FP4 recipe keeps attention in FP8)."""
    assert attention_formats(Float8Config.from_name("tensorwise")) == ("e4m3fn", "e5m2")
    assert attention_formats(Float8Config.from_name("fp8-deepseek")) == ("e4m3fn", "e4m3fn")
    assert attention_formats(Float8Config.from_name("nvfp4")) == ("e4m3fn", "e5m2")
    assert hf_attention_name(FP8Attention("rowwise")) == "lowprec_fp8_rowwise"
    name = hf_attention_name(FP8Attention("headwise", grad_fmt="e4m3fn"))
    assert name == "lowprec_fp8_headwise_e4m3fn_e4m3fn"


# ---- models -------------------------------------------------------------------------------

CFG = ModelConfig(vocab_size=32, width=32, depth=2, heads=4, seq_len=16)


def _train(model: torch.nn.Module, steps: int = 8) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _convert_and_compare(name: str, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "reference":
        plain = build_model(name, CFG)
    else:
        from lowprec.jobs.hf_models import build_hf_model

        plain = build_hf_model(name, CFG, **overrides)
    plain.eval()
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    ref, _ = plain(idx)
    lin = f8.apply(copy.deepcopy(plain), "tensorwise")
    att = f8.apply(copy.deepcopy(plain), Float8Config.from_name("tensorwise", attention="rowwise"))
    y_lin, _ = lin(idx)
    y_att, _ = att(idx)
    # linears already in FP8: FP8 attention adds an error of the same order (E4M3), small
    assert _rel_rms(y_att, ref) < 2 * U_E4M3
    assert 0 < _rel_rms(y_att, y_lin) < U_E4M3
    return att


def test_reference_model_hook() -> None:
    att = _convert_and_compare("reference")
    hooks = [m.attention_fn for m in att.modules() if "attention_fn" in m.__dict__]
    assert len(hooks) == CFG.depth and all(h == FP8Attention("rowwise") for h in hooks)
    att.train()
    losses = _train(att)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    f8.convert_back(att)
    assert all(m.attention_fn is None for m in att.modules() if "attention_fn" in m.__dict__)


def test_unit_scaling_refused_in_recipes_and_ops_not_rewritten() -> None:
    """A recipe with unit scaling and FP8 attention is refused (FP8 attention has no unit
    rule). Called directly inside a unit-scaled model (whose torch function mode rewrites
    matmuls and softmax into unit ops), FP8 attention computes what it computes outside."""
    from lowprec.recipes.compose import check
    from lowprec.recipes.policy import Policy
    from lowprec.unit import UnitConfig
    from lowprec.unit import apply as unit_apply

    with pytest.raises(ValueError, match="attention"):
        check(Policy(), (UnitConfig(), Float8Config(attention="tensorwise")))
    torch.manual_seed(0)
    model = unit_apply(build_model("reference", CFG))
    att = next(m for m in model.modules() if "attention_fn" in m.__dict__)
    seen: list[tuple[Any, ...]] = []

    def fn(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
        y = fp8_attention(q, k, v, **kw)
        seen.append((q.detach(), k.detach(), v.detach(), y.detach(), kw))
        return y

    att.attention_fn = fn
    model(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len)))
    q, k, v, y, kw = seen[0]
    assert torch.equal(y, fp8_attention(q, k, v, **kw))


def test_no_attention_found_warns(caplog: pytest.LogCaptureFixture) -> None:
    m = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with caplog.at_level(logging.WARNING, "lowprec.float8.attention_apply"):
        f8.apply(m, Float8Config(attention="tensorwise"))
    assert "no attention it can convert" in caplog.text


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("name", "impl"), [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("gpt2", "eager")]
)
def test_hf_models_convert_train_and_convert_back(name: str, impl: str) -> None:
    """Llama (grouped-query attention, rotary) and GPT-2 (attention dropout 0.1, Conv1D)."""
    att = _convert_and_compare(name, attn_implementation=impl)
    hf = att.model  # type: ignore[union-attr]
    assert hf.config._attn_implementation == hf_attention_name(FP8Attention("rowwise"))
    att.train()
    losses = _train(att)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    f8.convert_back(att)
    assert hf.config._attn_implementation == impl


def test_hf_padding_mask() -> None:
    """Left padding: the padded model's outputs at the real tokens match the unpadded
    model's (the padding keys get no weight; padding queries no NaN)."""
    from lowprec.jobs.hf_models import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("llama", CFG).model.eval()
    f8.apply(model, Float8Config(attention="tensorwise", emulate=True))
    ids = torch.randint(1, CFG.vocab_size, (1, 10))
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        a = model(ids).logits
        b = model(padded, attention_mask=mask, position_ids=pos).logits
    assert torch.isfinite(b).all()
    # the padding changes the tensor-wise amax (the padded rows' values), so not exact
    assert _rel_rms(b[:, 6:], a) < U_E4M3


def test_hf_other_implementation_refused() -> None:
    from lowprec.jobs.hf_models import build_hf_model

    m = build_hf_model("llama", CFG, attn_implementation="eager")
    m.model.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(ValueError, match="flex_attention"):
        f8.apply(m, Float8Config(attention="tensorwise"))
    assert not any(isinstance(x, f8.Float8Linear) for x in m.modules())  # nothing changed


def test_attention_sinks_are_refused_before_anything_changes() -> None:
    """GPT-OSS's attention sinks (``s_aux``): ``apply`` succeeded, converting the experts
    and switching the attention implementation, and the first forward raised (a new
    user's trial). Now ``apply`` refuses, naming the feature, and the model is unchanged."""
    from tests import _moe

    m = _moe.model("gpt_oss", layers=1)
    before = {n: type(x) for n, x in m.named_modules()}
    impl = m.config._attn_implementation
    with pytest.raises(ValueError, match=r"attention sinks \(s_aux\)"):
        f8.apply(m, Float8Config.from_name("tensorwise", attention="tensorwise"))
    assert {n: type(x) for n, x in m.named_modules()} == before
    assert m.config._attn_implementation == impl
    f8.apply(m, "tensorwise")  # without FP8 attention it converts
    assert any(isinstance(x, f8.Float8Experts) for x in m.modules())


@pytest.mark.parametrize(
    ("kw", "exc", "name"),
    [
        ({"scale": "0.3"}, TypeError, "scale"),
        ({"scale": math.nan}, ValueError, "scale"),
        ({"scale": math.inf}, ValueError, "scale"),
        ({"is_causal": "yes"}, TypeError, "is_causal"),
        ({"is_causal": 1}, TypeError, "is_causal"),
        ({"enable_gqa": "no"}, TypeError, "enable_gqa"),
    ],
)
def test_fp8_attention_refuses_misread_arguments(
    kw: dict[str, Any], exc: type[Exception], name: str
) -> None:
    """Accepted before: ``scale="0.3"`` (a string taken by ``float``), ``scale=nan`` (a
    NaN output), a truthy string as ``is_causal`` (a new user's trial)."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(exc, match=name):
        fp8_attention(q, q, q, **kw)
    assert torch.isfinite(fp8_attention(q, q, q, scale=0.3, is_causal=True)).all()
