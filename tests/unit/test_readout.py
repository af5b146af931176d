"""The readout of a unit-scaled model (found by a new user's trial): μP's multiplier
``output_mult/√fan_in`` applies to ``x Wᵀ``, not to the bias (a converted model scaled
its bias by it, ``U.linear_readout`` does not); a headless backbone gets no readout
instead of a hidden layer as one; a readout that a layer rule makes a ``Float8Linear``
keeps the multiplier.

Oracle: ``lowprec.unit.functional.linear_readout`` on the readout's own input, weights and
bias (FP64: exact), and the high-precision readout (FP8: within its rounding)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lowprec.core.warn import reset_warnings
from lowprec.float8 import Float8Config, Float8Linear
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.recipes import get_recipe, prepare
from lowprec.recipes.layers import LayerRule
from lowprec.unit import UnitConfig, unit_scale
from lowprec.unit import functional as U


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10))


@pytest.mark.parametrize("mult", [1.0, 2.5])
def test_the_readout_multiplier_leaves_the_bias_alone(mult: float) -> None:
    """With the weights zeroed and the bias 1 the output is 1 (it read 1/√64·mult =
    0.125·mult); with both set it is ``linear_readout(x, W, b, mult)`` to FP64 rounding."""
    u = unit_scale(_net(), config=UnitConfig(output_mult=mult)).double()
    seen: list[Tensor] = []
    u[2].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        u[2].bias.fill_(1.0)
        y = u(x)
        want = U.linear_readout(seen[-1], u[2].weight, u[2].bias, mult=mult)
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        u[2].weight.zero_()
        torch.testing.assert_close(u(x), torch.ones(8, 10, dtype=torch.float64))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(self.ln(x))


class _Backbone(nn.Module):
    """Blocks and no head, as ``AutoModel``'s backbones: the last Linear is a block's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_backbone_has_no_readout_unless_named(caplog: pytest.LogCaptureFixture) -> None:
    """``readout="auto"`` took ``layers.1.fc`` as the readout (its branch then read 1/√32
    of unit, and u-μP gave it the readout's rate); now none, with a WARNING; a named one
    is taken."""
    reset_warnings("unit:readout:")
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="lowprec.unit"):
        u = unit_scale(_Backbone())
    assert u.unit_report["readout"] is None
    assert "found no output head" in caplog.text and "'layers.1.fc'" in caplog.text
    torch.manual_seed(0)
    named = unit_scale(_Backbone(), readout="layers.1.fc")
    assert named.unit_report["readout"] == "layers.1.fc"


def test_a_float8_readout_named_by_a_layer_rule_keeps_its_multiplier() -> None:
    """fp8-unit-rowwise with a rule making the readout a tensor-wise Float8Linear: its
    output is the high-precision readout's within FP8 rounding (relative 0.1); without the
    multiplier it was √width = 8 times that."""
    cfg = ModelConfig(vocab_size=16, width=64, depth=1, heads=2, seq_len=8)
    base = get_recipe("fp8-unit-rowwise")
    tw = Float8Config.from_name("tensorwise")
    ruled = dataclasses.replace(base, name="ruled", layers=(LayerRule("head", tw),))
    ids = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(2))
    outs = []
    for r in (base, ruled):
        torch.manual_seed(0)
        p = prepare(CharGPT(cfg), r)
        with torch.no_grad(), p.compute():
            outs.append(p.model(ids)[0].float())
        head = p.model.get_submodule(p.model.unit_report["readout"])
        assert isinstance(head, Float8Linear) == (r is ruled)
    rel = float((outs[1] - outs[0]).norm() / outs[0].norm())
    assert rel < 0.1, rel


def test_a_readout_input_pre_scaled_by_one_over_root_fan_in_is_the_plain_readout() -> None:
    """HF's T5 multiplies the decoder output by ``d^-1/2`` before a tied output layer
    (not before an untied one). Unit scaling kept it: every gradient of the tied model was
    ``1/√d`` of the untied one's (0.13-0.29 into the blocks at d = 64, trial A). The unit
    linear applies ``1/√fan_in`` itself, so the tied model is now the untied one with the
    same weights: its loss, logits and gradients equal (float32 rounding of ``x·c/c``)."""
    transformers = pytest.importorskip("transformers")
    runs = []
    for tied in (True, False):
        cfg = transformers.T5Config(
            vocab_size=64, d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=None,
            tie_word_embeddings=tied,
        )  # fmt: skip
        torch.manual_seed(0)
        m = transformers.T5ForConditionalGeneration(cfg)
        if not tied:
            with torch.no_grad():
                m.lm_head.weight.copy_(m.shared.weight)
        torch.manual_seed(1)
        u = unit_scale(m, reinit=True)
        if not tied:
            with torch.no_grad():
                u.lm_head.weight.copy_(u.shared.weight)  # the tied model's weights
        g = torch.Generator().manual_seed(2)
        ids, labels = (
            torch.randint(1, 64, (2, 12), generator=g),
            torch.randint(1, 64, (2, 12), generator=g),
        )
        out = u(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {
            n: p.grad for n, p in u.named_parameters() if "shared" not in n and "lm_head" not in n
        }
        runs.append((out.loss.detach(), out.logits.detach(), grads))
    (loss_t, logits_t, g_t), (loss_u, logits_u, g_u) = runs
    assert float(abs(loss_t - loss_u)) < 1e-5
    assert float((logits_t - logits_u).norm() / logits_u.norm()) < 1e-5
    assert set(g_t) == set(g_u)
    for n, gt in g_t.items():
        ref = g_u[n]
        assert float((gt - ref).norm()) <= 1e-4 * max(float(ref.norm()), 1.0), n


def _readout_input_grad(model: nn.Module, head: nn.Module, run: Any) -> tuple[Tensor, Tensor]:
    """``(∂x, ∂y)``: the gradients of the readout's input and of its output, after
    ``run()`` back-propagates a loss of ``model``."""
    seen: dict[str, Tensor] = {}

    def pre(m: nn.Module, a: tuple[Tensor, ...]) -> None:
        a[0].retain_grad()
        seen["x"] = a[0]

    def post(m: nn.Module, a: tuple[Tensor, ...], out: Tensor) -> None:
        out.retain_grad()
        seen["y"] = out

    hs = [head.register_forward_pre_hook(pre), head.register_forward_hook(post)]
    run()
    for h in hs:
        h.remove()
    gx, gy = seen["x"].grad, seen["y"].grad
    assert gx is not None and gy is not None
    return gx.float(), gy.float()


@pytest.mark.parametrize(
    ("recipe", "tol"),
    [("fp32-unit", 1e-5), ("float8-preset", 1e-5), ("fp8-unit-ruled", 0.1)],
)
def test_the_readout_input_gradient_is_unconstrained(recipe: str, tol: float) -> None:
    """u-μP's readout: ``∂x = (∂y W)/√fan_out`` (unit-scaling's ``linear_readout``,
    ``constraint=None``), so the gradient reaching the model has unit scale whatever the
    vocabulary. Tied to the forward's ``1/√fan_in`` it was ``√(V/W)`` that (here
    √(256/32) = 2.8). Each path a readout takes: the unit mode's ``F.linear``
    (``fp32-unit``), the float8 preset's high-precision readout, and a readout that a layer
    rule makes a tensor-wise ``Float8Linear`` (its GEMM in FP8: within E5M2/E4M3 rounding
    of the product, relative 0.1). ``∂y`` is the gradient of the readout's output (after
    its forward-only multiplier)."""
    cfg = ModelConfig(vocab_size=256, width=32, depth=1, heads=2, seq_len=8)
    ids = torch.randint(0, 256, (4, 8), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    if recipe == "float8-preset":
        model: nn.Module = unit_scale(CharGPT(cfg), config=UnitConfig(float8=True))
    else:
        r = get_recipe("fp8-unit-rowwise" if recipe == "fp8-unit-ruled" else recipe)
        if recipe == "fp8-unit-ruled":
            tw = Float8Config.from_name("tensorwise")
            r = dataclasses.replace(r, name="ruled", layers=(LayerRule("head", tw),))
        model = prepare(CharGPT(cfg), r).model
    head = model.get_submodule(model.unit_report["readout"])
    assert isinstance(head, Float8Linear) == (recipe == "fp8-unit-ruled")
    gx, gy = _readout_input_grad(model, head, lambda: model(ids, ids)[1].backward())
    want = gy @ head.weight.detach().float() / math.sqrt(256)
    rel = float((gx - want).norm() / want.norm())
    assert rel < tol, rel


def test_hidden_gradients_do_not_grow_with_the_vocabulary() -> None:
    """A unit Llama (HF, width 64) at vocabularies 64 and 4096: every hidden weight's
    gradient RMS at init within 25% between the two (it grew as √(V/W): 8 times at 4096;
    the spread between vocabularies is the loss gradient's sampling, measured 0.9-1.1)."""
    pytest.importorskip("transformers")
    from lowprec.jobs.hf_models import build_hf_model

    rms: list[dict[str, float]] = []
    for vocab in (64, 4096):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=vocab, width=64, depth=2, heads=2, seq_len=16)
        p = prepare(build_hf_model("llama", cfg), "fp32-unit")
        g = torch.Generator().manual_seed(1)
        x, y = (
            torch.randint(0, vocab, (8, 16), generator=g),
            torch.randint(0, vocab, (8, 16), generator=g),
        )
        p.model(x, y)[1].backward()
        rms.append({
            n: float(q.grad.pow(2).mean().sqrt()) for n, q in p.model.named_parameters()
            if q.grad is not None and ".layers." in n and q.dim() == 2
        })  # fmt: skip
    assert set(rms[0]) == set(rms[1]) and len(rms[0]) == 14
    for n, a in rms[0].items():
        assert 0.8 < rms[1][n] / a < 1.25, (n, rms[1][n] / a)
