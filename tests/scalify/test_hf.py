"""scalify on HF transformers models (tiny configs, random init): Llama (grouped-query
attention) and GPT-2 (dropout 0.1, Conv1D), eager and SDPA attention, FP16 and FP8.

Gradient bound (every parameter, norm-wise relative to the FP32 model's gradient):

* ``fp16``: every op rounds its output data to FP16 once (unit roundoff u = 2^-11). A
  gradient is the end of a chain of n ≈ 100 such roundings (forward and backward of two
  layers); independent rounding errors add in quadrature, ≈ √n·u = 10u, so we allow
  ``FP16_BOUND = 10u ≈ 4.9e-3`` (observed: 3-4u).
* ``fp8``: each backward GEMM rounds its gradient operand to E5M2 (u = 2^-3: relative error
  ≤ u, standard deviation u/√3 per element) and its other operand to E4M3 (u = 2^-4). A
  weight gradient carries its own GEMM's rounding and those of the ≈ 8 GEMMs above it:
  ≈ √8·u/√3 ≈ 0.2, so we allow ``FP8_BOUND = 2u = 0.25`` (observed ≤ 0.17). A wrong
  scale (a factor of 2) or a lost term gives errors of order 1.

Dropout draws the same masks in both runs (same seed before each forward).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec.scalify import coverage, reset_coverage, scalify

transformers = pytest.importorskip("transformers")
from tests.scalify._hf import IDS, gpt2, llama  # noqa: E402

U_FP16, U_E5M2 = 2.0**-11, 2.0**-3
FP16_BOUND, FP8_BOUND = 10 * U_FP16, 2 * U_E5M2
BOUND = {"fp16": FP16_BOUND, "fp8": FP8_BOUND}
FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


MODELS = {"llama": llama, "gpt2": gpt2}


def grads(run: nn.Module, model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss of ``run`` (``model``, or ``model`` scalified) and ``model``'s gradients."""
    torch.manual_seed(2)  # the same dropout masks in every run
    out = run(IDS, labels=IDS)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return float(out.loss.detach()), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gradients_equal_fp32_up_to_rounding(arch: str, attn: str, fmt: str) -> None:
    model = MODELS[arch](attn)
    fp32 = copy.deepcopy(model)
    ref_loss, ref = grads(fp32, fp32)
    reset_coverage()
    loss, got = grads(scalify(model, fmt), model)
    assert coverage().fallbacks == {}  # every op had a rule
    if arch == "llama" and attn == "sdpa":
        assert coverage().ruled.get(FLASH, 0) == 2  # the SDPA rule, once per layer
    assert set(got) == set(ref) and len(ref) == len(list(model.parameters()))
    assert loss == pytest.approx(ref_loss, rel=BOUND[fmt])
    errs = {n: rel(got[n], ref[n]) for n in ref}
    assert all(torch.isfinite(g).all() for g in got.values())
    assert max(errs.values()) < BOUND[fmt], errs


def test_llama_trains_several_steps() -> None:
    """The issue's failure: non-finite gradients, then "entry scale must be finite" at the
    next step. Three SGD steps: finite, falling losses (lr 0.5 on one batch)."""
    model = llama("eager")
    s = scalify(model, "fp16")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = s(IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[1] < losses[0]


def test_left_padding_fully_masked_rows() -> None:
    """Left padding: HF's additive mask holds float32's minimum (-3.4e38), and the padded
    query rows are fully masked. FP32 gives them a finite uniform softmax; in FP16 data the
    mask must saturate, not become -inf (NaN rows). Gradients within the FP16 bound."""
    model = llama("eager")
    mask = torch.ones_like(IDS)
    mask[0, :3] = 0
    labels = IDS.masked_fill(mask == 0, -100)
    fp32 = copy.deepcopy(model)
    fp32(IDS, attention_mask=mask, labels=labels).loss.backward()
    out = scalify(model, "fp16")(IDS, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.logits).all()
    for (n, p), q in zip(model.named_parameters(), fp32.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert rel(p.grad, q.grad) < FP16_BOUND, n


def test_kv_cache_and_model_output_are_plain() -> None:
    """ModelOutput fields and the DynamicCache's keys/values leave as plain tensors; a
    cache passed back in is used (the next token's logits equal FP32's up to rounding)."""
    model = llama("sdpa").eval()
    s = scalify(model, "fp16")
    with torch.no_grad():
        out = s(IDS, use_cache=True)
        cache = out.past_key_values
        assert type(out).__name__ == "CausalLMOutputWithPast" and type(out.logits) is torch.Tensor
        assert all(
            type(t) is torch.Tensor for layer in cache.layers for t in (layer.keys, layer.values)
        )
        nxt = s(IDS[:, :1], past_key_values=cache, use_cache=True)
        ref_cache = model(IDS, use_cache=True).past_key_values
        ref = model(IDS[:, :1], past_key_values=ref_cache, use_cache=True)
    assert cache.get_seq_length() == IDS.shape[1] + 1  # updated in place, as HF does
    assert all(type(layer.keys) is torch.Tensor for layer in cache.layers)
    # logits: a few FP16 roundings of O(1) values
    assert rel(nxt.logits, ref.logits) < FP16_BOUND


def test_state_dict_keys_are_the_wrapped_models() -> None:
    model = gpt2("eager")
    s = scalify(model, "fp16")
    assert list(s.state_dict()) == list(model.state_dict())
    other = gpt2("eager")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    s.load_state_dict(other.state_dict())  # the original model's keys load
    assert torch.equal(model.lm_head.weight, other.lm_head.weight)
    old = {"module." + k: v + 1.0 for k, v in other.state_dict().items()}  # older checkpoints
    s.load_state_dict(old)
    assert torch.equal(model.transformer.wte.weight, other.transformer.wte.weight + 1.0)
    model.load_state_dict(s.state_dict())  # and back into the bare model
    with pytest.raises(RuntimeError, match="Unexpected key"):
        s.load_state_dict({**other.state_dict(), "extra.weight": torch.zeros(1)})


# ---- the SDPA rule on its own ------------------------------------------------------------

CASES = {
    "gqa": {"enable_gqa": True},
    "gqa-causal": {"enable_gqa": True, "is_causal": True},
    "bool-mask": {"enable_gqa": True, "attn_mask": "bool"},
    "float-mask": {"attn_mask": "float"},
}


def _qkv(hk: int, big: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = [(2, 4, 8, 16), (2, hk, 8, 16), (2, hk, 8, 16)]
    return [(torch.randn(s, generator=g) * big).requires_grad_() for s in shapes]


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_rule(case: str) -> None:
    """Output and the three input gradients against FP64, with q and k at 2^±20 (plain
    FP16 would overflow the logits, and flush k's gradient): two FP16 roundings of the
    data and one of the output, ≤ 3u each element; we allow 4u norm-wise."""
    kw = dict(CASES[case])
    hk = 2 if kw.get("enable_gqa") else 4
    g = torch.Generator().manual_seed(4)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(8, 8, generator=g) > 0.3
        kw["attn_mask"][:, 0] = True  # no fully masked row
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(8, 8, generator=g)
    big = [2.0**20, 2.0**-20, 1.0]
    qkv = _qkv(hk, 1.0)
    with torch.no_grad():
        for t, b in zip(qkv, big, strict=True):
            t.mul_(b)
    ref_in = [t.detach().double().requires_grad_() for t in qkv]
    ref_kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in kw.items()}  # fmt: skip
    ref = F.scaled_dot_product_attention(*ref_in, **ref_kw)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64) * 2.0**-30  # tiny gradient
    (ref * w).sum().backward()
    reset_coverage()
    f = scalify(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), "fp16")
    out = f(*qkv)
    (out * w.float()).sum().backward()
    assert coverage().fallbacks == {} and coverage().ruled.get(FLASH) == 1
    assert rel(out, ref) < 4 * U_FP16
    for t, r in zip(qkv, ref_in, strict=True):
        assert t.grad is not None and r.grad is not None
        assert rel(t.grad, r.grad) < 4 * U_FP16


def test_sdpa_dropout_uses_the_rules_of_its_decomposition() -> None:
    """dropout_p > 0: torch decomposes the call (matmuls, ``_safe_softmax``, the mask);
    each op has a rule. Same seed, same mask: FP32's output up to FP16 rounding (the
    chain of ~6 roundings: 6u)."""
    q, k, v = _qkv(2, 1.0)
    kw: dict[str, Any] = {"enable_gqa": True, "dropout_p": 0.3, "is_causal": True}
    torch.manual_seed(5)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    reset_coverage()
    torch.manual_seed(5)
    out = scalify(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), "fp16")(q, k, v)
    assert coverage().fallbacks == {} and "aten._safe_softmax.default" in coverage().ruled
    assert rel(out, ref) < 6 * U_FP16


@pytest.mark.slow
def test_torch_compile_with_kv_cache_outputs() -> None:
    """Compiled (AOT autograd, the layer that raised "Expected a ScaledTensor tangent but
    got a plain Tensor"; backend ``aot_eager`` to keep the test short): the cache and the
    loss come out plain, the gradients equal FP32's within the FP16 bound."""
    torch._dynamo.reset()
    model = llama("sdpa")
    fp32 = copy.deepcopy(model)
    _, ref = grads(fp32, fp32)
    compiled = torch.compile(scalify(model, "fp16"), backend="aot_eager", fullgraph=True)
    out = compiled(IDS, labels=IDS, use_cache=True)
    assert all(type(layer.keys) is torch.Tensor for layer in out.past_key_values.layers)
    out.loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and rel(p.grad, ref[n]) < FP16_BOUND, n
