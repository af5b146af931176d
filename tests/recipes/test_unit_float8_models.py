"""Unit + float8 recipes (``fp8-unit-rowwise``) on HF models whose layers are not plain
``nn.Linear``s: MoE experts (3-D weights) and GPT-2's ``Conv1D`` (new-user trial A).

The experts were replaced by plain ``Float8Experts``, which dropped every unit scale of the
MoE layer: the residual stream grew to 80-300 at init and the router's gradient was 77x
fp32-unit's. GPT-2's unit-converted ``Conv1D``s were left unconverted: the "fp8" recipe
trained in BF16 (its losses were bf16-unit's, digit for digit)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lowprec
import lowprec.unit.moe
from lowprec.float8 import Float8Linear, grouped_linear
from lowprec.float8.conv1d import Float8Conv1D
from lowprec.unit.functional import linear as unit_linear
from tests import _moe

pytest.importorskip("transformers")

# FP8 (E4M3 forward, E5M2 gradients) against BF16 on the same unit model: each parameter's
# gradient norm within 25% and its direction within cosine 0.85. Measured on these models:
# norm ratios 0.93-1.12, cosines >= 0.95 (routing flips under the near-flat unit routers
# move MoE gradients most); the dropped unit scales gave ratios of 0.017 to 77.
RATIO, COSINE = 0.25, 0.85


def _gpt2() -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=_moe.VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    return T.GPT2LMHeadModel(cfg)


def _model(family: str) -> nn.Module:
    return _gpt2() if family == "gpt2" else _moe.model(family)


def _step(family: str, recipe: str) -> tuple[float, dict[str, torch.Tensor], Any]:
    torch.manual_seed(1234)  # the same unit re-initialisation for both recipes
    p = lowprec.prepare(_model(family), recipe)
    ids = _moe.ids(2, 12)
    with p.compute():
        loss = p.model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: q.grad.float() for n, q in p.model.named_parameters() if q.grad is not None}
    return float(loss.detach()), grads, p


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "olmoe", "gpt2"])
def test_fp8_unit_rowwise_keeps_unit_scaling_on_experts_and_conv1d(family: str) -> None:
    loss_bf16, ref, _ = _step(family, "bf16-unit")
    loss_fp8, got, p = _step(family, "fp8-unit-rowwise")
    assert set(got) == set(ref)
    for n, g in got.items():
        r = ref[n]
        ratio = float(g.norm() / r.norm())
        cos = float(torch.dot(g.flatten(), r.flatten()) / (g.norm() * r.norm()))
        assert abs(ratio - 1.0) < RATIO and cos > COSINE, (n, ratio, cos)
    assert loss_fp8 != loss_bf16  # the FP8 GEMMs ran
    mods = list(p.model.modules())
    if family == "gpt2":
        convs = [m for m in mods if isinstance(m, Float8Conv1D)]
        assert len(convs) == 8 and all(m.linear_fn is unit_linear for m in convs)
        assert not any(type(m).__name__ == "UnitConv1D" for m in mods)
    else:
        experts = [m for m in mods if getattr(type(m), "_unit_form", None) == "experts"]
        assert len(experts) == 2 and not any(type(m).__name__ == "Float8Experts" for m in mods)
        routers = [m for m in mods if getattr(type(m), "_unit_form", None) == "router"]
        assert len(routers) == 2  # unit's router (x Wᵀ/H) kept, in the model's dtype
        assert any(type(m) is Float8Linear and m.linear_fn is unit_linear for m in mods)


def test_unit_experts_gemm_is_the_recipes_float8_grouped_gemm() -> None:
    """Each expert's product is a float8 grouped GEMM of one group with the recipe's config:
    the same output and operand gradients, bit for bit."""
    _, _, p = _step("mixtral", "fp8-unit-rowwise")
    experts = next(m for m in p.model.modules() if getattr(type(m), "_unit_form", "") == "experts")
    mm = experts.__dict__["_unit_matmul"]
    torch.manual_seed(0)
    x = torch.randn(5, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(5, 48, dtype=torch.bfloat16)
    y = mm(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y2 = grouped_linear(x2, w2.unsqueeze(0), torch.tensor([5]), "rowwise")
    dx2, dw2 = torch.autograd.grad(y2, (x2, w2), g)
    for a, b in ((y, y2), (dx, dx2), (dw, dw2)):
        assert torch.equal(a, b)
    exact = x.detach().float() @ w.detach().float().t()
    assert not torch.equal(y.float(), exact)  # FP8: not the exact product
    assert float((y.float() - exact).norm() / exact.norm()) < 0.1


def test_inject_matmul_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="experts must be an experts module converted"):
        lowprec.unit.moe.inject_matmul(nn.Linear(2, 2), None)
    p = lowprec.prepare(_moe.model("mixtral"), "bf16-unit")
    experts = next(m for m in p.model.modules() if getattr(type(m), "_unit_form", "") == "experts")
    with pytest.raises(TypeError, match="matmul must be callable or None, got int"):
        lowprec.unit.moe.inject_matmul(experts, 3)  # type: ignore[arg-type]
    p8 = lowprec.prepare(_moe.model("mixtral"), "fp8-unit")  # unit's own FP8 casts
    e8 = next(m for m in p8.model.modules() if getattr(type(m), "_unit_form", "") == "experts")
    with pytest.raises(ValueError, match="float8=True"):
        lowprec.unit.moe.inject_matmul(e8, torch.matmul)
