"""scalify where a new user's trial on HF models found wrong numbers or silent bypasses:
SDPA's backward under the rescale policies, plain operands of ``cat`` (HF's KV cache) and
``maximum``, ``generate``, gradient checkpointing, and a wrapped bound ``forward``.

Oracles: FP64 autograd of the same function, the FP32 model's greedy generation.
Tolerances: FP16 data (u = 2^-11); one op and its backward round a few times, so 2e-3
(measured 3.4e-4 to 5.4e-4); a model's logits 10u as in test_hf.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.core.warn import reset_warnings
from lowprec.scalify import ScalifyConfig, coverage, reset_coverage, scalify

transformers = pytest.importorskip("transformers")
from tests.scalify._hf import IDS, llama  # noqa: E402

POLICIES = ["static", "dynamic", "dynamic-l2", ScalifyConfig(rescale="l1"),
            ScalifyConfig(rescale="l2")]  # fmt: skip


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy", POLICIES, ids=["static", "dynamic", "dynamic-l2", "l1", "l2"])
def test_sdpa_gradients_under_every_rescale_policy(causal: bool, policy: object) -> None:
    """``∂q, ∂k, ∂v`` of SDPA against FP64. The backward kernel takes the forward's output,
    which a rescale policy had given its own scale: ``∂q, ∂k`` were off by 0.5-10×
    (relative error 0.51 under "dynamic", 3.6-10 under l1/l2) while ``∂v`` was right."""
    g = torch.Generator().manual_seed(0)
    q0, k0, v0, w = (torch.randn(2, 4, 16, 16, generator=g) for _ in range(4))

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return (F.scaled_dot_product_attention(q, k, v, is_causal=causal) * w.to(q.dtype)).sum()

    ref = [t.double().requires_grad_() for t in (q0, k0, v0)]
    f(*ref).backward()
    got = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    fmt = "fp16" if isinstance(policy, str) else None
    scalify(f, fmt, policy=policy)(*got).backward()  # type: ignore[arg-type]
    for name, a, b in zip("qkv", got, ref, strict=True):
        assert a.grad is not None and b.grad is not None
        assert _rel(a.grad, b.grad) < 2e-3, (name, _rel(a.grad, b.grad))


def test_plain_operands_of_cat_and_maximum_count_at_their_own_scale() -> None:
    """``cat([empty plain, x])`` (a fresh KV cache) at ``s_x = 2^-30`` gave all zeros (the
    result took scale 1); ``maximum(x, 0.5)`` gave inf (``s_x`` kept for 0.5)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 2.0**-30
    cases = [
        lambda a: torch.cat([torch.tensor([]).view(0, 8), a]),
        lambda a: torch.cat([torch.zeros(1, 8), a]),
        lambda a: torch.stack([torch.zeros(4, 8), a]),
        lambda a: torch.maximum(a, torch.full((4, 8), 0.5)),
        lambda a: torch.minimum(a * 2.0**40, torch.full((4, 8), 0.5)),
    ]
    for fn in cases:
        got = scalify(fn, "fp16")(x)
        want = fn(x.double())
        assert _rel(got, want) < 2e-3, _rel(got, want)


def _llama() -> torch.nn.Module:
    return llama("sdpa").eval()  # test_hf's tiny Llama (vocab 64, hidden 32, 2 layers)


def test_small_activations_through_the_kv_cache() -> None:
    """Llama's inputs at 2^-30 with the default ``use_cache=True`` (its DynamicCache cats
    onto empty plain tensors): logits within 10u of FP64's, as without the cache. They
    read NaN before (k and v flushed to zero)."""
    base = _llama()
    emb = base.get_input_embeddings()(IDS).detach() * 2.0**-30
    with torch.no_grad():
        ref = copy.deepcopy(base).double()(inputs_embeds=emb.double(), use_cache=False).logits
        for cache in (True, False):
            got = scalify(copy.deepcopy(base), "fp16")(inputs_embeds=emb, use_cache=cache).logits
            assert _rel(got, ref) < 10 * 2.0**-11, (cache, _rel(got, ref))


def test_generate_runs_in_scaled_arithmetic() -> None:
    """``scalify(model).generate`` gives FP32's greedy tokens (FP16 data) with the rules
    running (it raised AttributeError); a model without ``generate`` says so."""
    base = _llama()
    with torch.no_grad():
        ref = copy.deepcopy(base).generate(IDS, max_new_tokens=5, do_sample=False)
        reset_coverage()
        out = scalify(copy.deepcopy(base), "fp16").generate(IDS, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)
    assert sum(coverage().ruled.values()) > 0
    with pytest.raises(AttributeError, match="has no generate"):
        scalify(torch.nn.Linear(2, 2)).generate()


def test_gradient_checkpointing_is_refused() -> None:
    """HF's recompute in backward runs after scalify handed the parameters back, outside
    scaled arithmetic: refused with the way out named."""
    m = _llama().train()
    m.gradient_checkpointing_enable()
    with pytest.raises(TypeError, match="gradient_checkpointing_disable"):
        scalify(m, "fp16")(IDS)


def test_a_wrapped_bound_forward_without_float_inputs_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``model.forward = scalify(model.forward)`` with token ids: nothing is scaled (the
    parameters are the module's own), which used to pass in silence."""
    reset_warnings("scalify:no-float-inputs")  # (warned once per process)
    m = _llama()
    f = scalify(m.forward, "fp16")
    with caplog.at_level(logging.WARNING, logger="lowprec.scalify.transform"):
        with torch.no_grad():
            f(IDS)
    assert "nothing runs in scaled arithmetic" in caplog.text
