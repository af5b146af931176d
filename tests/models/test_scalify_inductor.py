"""scalify of HF models under ``torch.compile`` with the default backend (inductor, C++
kernels on CPU): outputs, KV cache, loss and gradients against the FP32 model.

Two decoder layers (so that each layer's KV cache is checked against its own layer of the
FP32 run), dropout off (the compiled graph draws its own random masks). Inductor's
code generation for a scalified graph takes minutes, so the CI case is the cheaper one:
GPT-2 with eager attention (matmul, additive mask, softmax, ``Conv1D``, learned positions;
8 min on a 2-core machine loaded 4-7x over), marked ``slow``. Llama with SDPA (the fused
CPU kernel and its scalify rule, grouped-query attention) passes the same checks in 16 min
there; it is not run in CI: ``python -c "from tests.models.test_scalify_inductor import
check; check('llama')"``.

Bounds (norm-wise relative error, FP16 unit roundoff u = 2^-11): the logits and the loss
carry a chain of FP16 roundings of O(1) values through the layers (≈ 20 in series per
layer, 40 for two, √40·u ≈ 3.1e-3): ``FP16_BOUND = 10u ≈ 4.9e-3``, as for eager scalify
(tests/scalify/test_hf.py); gradients the same (observed eager: 3-4u).

GPT-2 needs ``model.loss_type = "ForCausalLM"``: otherwise HF's ``loss_function`` calls
``logger.warning_once`` inside ``forward`` (``GPT2LMHeadModel`` is not a known loss type),
a graph break that ``fullgraph=True`` refuses, with or without scalify.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowprec.scalify import scalify

transformers = pytest.importorskip("transformers")

FP16_BOUND = 10 * 2.0**-11
IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=0,
        eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.loss_type = "ForCausalLM"  # see the module doc
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(arch: str) -> None:
    """``arch`` ("llama" or "gpt2") compiled with inductor against FP32 (see the module doc)."""
    torch._dynamo.reset()
    model = {"llama": _llama, "gpt2": _gpt2}[arch]()
    fp32 = copy.deepcopy(model)
    ref = fp32(IDS, labels=IDS, use_cache=True)
    ref.loss.backward()
    compiled = torch.compile(scalify(model, "fp16"), fullgraph=True)  # backend: inductor
    out = compiled(IDS, labels=IDS, use_cache=True)
    assert type(out).__name__.startswith("CausalLMOutputWith")  # HF's ModelOutput, rebuilt
    assert type(out.logits) is torch.Tensor and type(out.loss) is torch.Tensor
    layers, ref_layers = out.past_key_values.layers, ref.past_key_values.layers
    assert len(layers) == len(ref_layers) == 2
    for layer, ref_layer in zip(layers, ref_layers, strict=True):  # each against its own
        assert type(layer.keys) is torch.Tensor and type(layer.values) is torch.Tensor
        for got, want in ((layer.keys, ref_layer.keys), (layer.values, ref_layer.values)):
            torch.testing.assert_close(got, want, rtol=FP16_BOUND, atol=FP16_BOUND)
    assert _rel(out.logits.detach(), ref.logits.detach()) < FP16_BOUND
    assert float(out.loss) == pytest.approx(float(ref.loss), rel=FP16_BOUND)
    out.loss.backward()
    for (n, p), q in zip(model.named_parameters(), fp32.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, n
        assert bool(torch.isfinite(p.grad).all()), n
        assert _rel(p.grad, q.grad) < FP16_BOUND, n


@pytest.mark.slow
def test_inductor_gpt2_matches_fp32() -> None:
    check("gpt2")
