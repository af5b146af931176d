"""Scalify on HF transformers MoE models and the rules of their ops (``rules_moe.py``).

Tiny random configs of each family (``tests/_moe.py``, no download).

Tolerances, from the formats: FP16's unit roundoff is ``u = 2⁻¹¹``; a value of an MoE
block passes a handful of roundings at ``u`` (stored input and weights, each GEMM's
output, the activation), whose relative errors add in quadrature to ~2u (measured 0.8e-3
at most for outputs and gradients): the bound is ``8u = 2⁻⁸``. FP8 rounds every matmul
operand to E4M3 (``u = 2⁻⁴``; gradients E5M2, ``2⁻³``): an expert's two GEMMs in a row,
forward and backward, give ~0.05-0.15 relative error (measured); the bound is ``2⁻²``.
The loss, a mean over tokens, averages these errors: ``2⁻⁸`` (FP16) and ``2⁻⁶`` (FP8).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("transformers")

from lowprec.core.tensor import ScaledTensor, quantize_scaled
from lowprec.scalify import apply, config, coverage, reset_coverage, scaled
from tests import _moe

FP16_TOL, FP8_TOL = 2.0**-8, 2.0**-2
LOSS_TOL = {"fp16": 2.0**-8, "fp8": 2.0**-6}


def _block(m: nn.Module) -> nn.Module:
    return next(b for b in m.modules() if hasattr(b, "experts") and hasattr(b, "experts") and
                (hasattr(b, "gate") or hasattr(b, "router")))  # fmt: skip


def _router(blk: nn.Module) -> nn.Module:
    return getattr(blk, "gate", None) or blk.router


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _first(y: Any) -> Tensor:
    return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("family", _moe.FAMILIES)
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_model_loss_matches_and_no_op_falls_back(family: str, fmt: str) -> None:
    m = _moe.model(family, output_router_logits=True)
    ids = _moe.ids()
    ref = m(ids, labels=ids)
    s = apply(m, fmt)
    reset_coverage()
    out = s(ids, labels=ids)
    out.loss.backward()
    cov = coverage()
    assert cov.fallbacks == {}
    assert cov.ruled["aten._grouped_mm.default"] == 6 * m.config.num_hidden_layers - (
        6 if family == "deepseek_v3" else 0  # its first layer is dense
    )
    assert abs(out.loss.item() - ref.loss.item()) <= LOSS_TOL[fmt] * ref.loss.item()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


@pytest.mark.parametrize("family", _moe.FAMILIES)
def test_block_outputs_and_gradients_match_in_fp16(family: str) -> None:
    """An MoE block (router, experts, shared experts): output, input gradient and every
    parameter's gradient (experts' and router's) within ``8u`` of the plain block's."""
    blk = _block(_moe.model(family))
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    xr, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = _first(blk(xr))
    g = torch.randn_like(y)
    y.backward(g)
    ref = {n: p.grad.clone() for n, p in blk.named_parameters()}
    blk.zero_grad()
    ys = _first(apply(blk, "fp16")(xs))
    ys.backward(g)
    assert _rel(ys, y) < FP16_TOL and _rel(xs.grad, xr.grad) < FP16_TOL
    for n, p in blk.named_parameters():
        if ref[n].norm() > 0:
            assert _rel(p.grad, ref[n]) < FP16_TOL, n


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_experts_with_fixed_routing_match(family: str, fmt: str) -> None:
    """The experts module alone, routing given: output, ∂x, ∂p and the expert weights'
    gradients within the format's bound; one expert receives no token (its gradient 0)."""
    ex = _block(_moe.model(family)).experts
    t, k, n_exp = 24, 2, 4
    gen = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(3, generator=gen)[:k] for _ in range(t)])  # never 3
    w = torch.rand(t, k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    x = torch.randn(t, 32, generator=gen)
    args = [(x.clone().requires_grad_(True), w.clone().requires_grad_(True)) for _ in range(2)]
    y = ex(args[0][0], idx, args[0][1])
    g = torch.randn_like(y)
    y.backward(g)
    ref = {n: p.grad.clone() for n, p in ex.named_parameters()}
    ex.zero_grad()
    reset_coverage()
    ys = apply(ex, fmt)(args[1][0], idx, args[1][1])
    ys.backward(g)
    assert coverage().fallbacks == {}
    tol = FP16_TOL if fmt == "fp16" else FP8_TOL
    assert _rel(ys, y) < tol and _rel(args[1][0].grad, args[0][0].grad) < tol
    assert _rel(args[1][1].grad, args[0][1].grad) < tol
    for n, p in ex.named_parameters():
        assert _rel(p.grad, ref[n]) < tol, n
        assert float(p.grad[n_exp - 1].abs().max()) == 0.0  # the expert with no token


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_routing_is_the_plain_routers_but_at_ties_within_rounding(family: str, fmt: str) -> None:
    """Each scalify'd router picks the experts the plain router picks from the same hidden
    states, except where the plain logits of the k-th and (k+1)-th expert are closer than
    twice the first-order rounding bound of a logit, ``(2u_op + u_out)·Σ_i |x_i w_ei|``
    (``u_op``: the GEMM operands' unit roundoff, 2⁻¹¹ in FP16, E4M3's 2⁻⁴ in FP8;
    ``u_out = 2⁻¹¹``, the stored logits)."""
    m = _moe.model(family, layers=2)
    seen: list[tuple[nn.Module, Tensor, Tensor]] = []
    hooks = [
        b.register_forward_hook(lambda mod, a, o: seen.append((mod, a[0], o[2])))
        for b in m.modules()
        if type(b).__name__.endswith("TopKRouter")
    ]
    apply(m, fmt)(_moe.ids(4, 16))
    for hk in hooks:
        hk.remove()
    assert seen
    u_op = 2.0**-11 if fmt == "fp16" else 2.0**-4
    flips = 0
    for r, x, idx in seen:
        xv = x.dequantize() if isinstance(x, ScaledTensor) else x
        xv = xv.reshape(-1, r.weight.shape[1]).detach()
        with torch.no_grad():
            logits, _, ref_idx = r(xv)
            bound = (2 * u_op + 2.0**-11) * (xv.abs() @ r.weight.abs().t())
        same = (idx.sort(-1).values == ref_idx.sort(-1).values).all(-1)
        top = logits.topk(r.top_k + 1, dim=-1)
        gap = top.values[:, r.top_k - 1] - top.values[:, r.top_k]
        near = gap < 2 * bound.gather(1, top.indices[:, r.top_k - 1 : r.top_k]).squeeze(1)
        assert bool((same | near).all()), (gap[~same], bound.max())
        flips += int((~same).sum())
    if fmt == "fp16":
        assert flips <= 2  # rare: FP16 moves a logit by ~1e-3 relative


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_a_few_steps_reduce_the_loss(family: str, fmt: str) -> None:
    m = _moe.model(family)
    s = apply(m, fmt)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ids = _moe.ids(4, 16)
    losses = []
    for _ in range(6):
        loss = s(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_every_experts_implementation_runs_by_rules(impl: str) -> None:
    m = _moe.model("qwen3_moe")
    m.config._experts_implementation = impl
    ids = _moe.ids()
    ref = m(ids, labels=ids)
    reset_coverage()
    out = apply(m, "fp16")(ids, labels=ids)
    out.loss.backward()
    assert coverage().fallbacks == {}
    assert abs(out.loss.item() - ref.loss.item()) <= LOSS_TOL["fp16"] * ref.loss.item()


# ---- the rules, on tensors of tiny scale (FP16 alone would flush them to 0) ---------------

TINY = 2.0**-30


def _st(x: Tensor, scale: float = TINY) -> ScaledTensor:
    return scaled(x.half(), scale)


def test_order_ops_keep_the_data_and_the_scale() -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    sx = _st(x)
    for op in (lambda t: t.topk(3, dim=-1), lambda t: t.max(dim=-1), lambda t: t.min(dim=0),
               lambda t: t.sort(dim=-1, stable=True)):  # fmt: skip
        v, i = op(sx)
        rv, ri = op(x.half().float())
        assert isinstance(v, ScaledTensor) and float(v.scale) == TINY
        assert torch.equal(v.dequantize(), rv * TINY) and torch.equal(i, ri)
    g = sx.gather(1, torch.tensor([[1, 0]] * 5))
    assert float(g.scale) == TINY and torch.equal(
        g.dequantize(), x.half().float()[:, [1, 0]] * TINY
    )


def _grouped_ref(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(a[start:end] @ b[e])
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_grouped_mm_rule_forward_backward_and_an_empty_group(fmt: str) -> None:
    """``_grouped_mm`` forward and both gradients against a per-group float32 loop, on
    operands of magnitude 1e-6 and 1e3 (their product is FP16's 4e-3 only through the
    scales): within the format's bound (norm-relative); group 1 receives no row (its
    weight gradient is exactly 0); all three GEMMs by the rule."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(10, 16, generator=gen) * 1e-6
    b = torch.randn(3, 16, 8, generator=gen) * 1e3
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)  # group 1 empty
    f = apply(lambda a, b: torch._grouped_mm(a, b, offs=offs), fmt)
    aa, bb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    reset_coverage()
    y = f(aa, bb)
    g = torch.randn(10, 8, generator=gen)
    y.backward(g)
    assert coverage().ruled["aten._grouped_mm.default"] == 3 and coverage().fallbacks == {}
    ra, rb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    ref = _grouped_ref(ra, rb, offs)
    ref.backward(g)
    tol = FP16_TOL if fmt == "fp16" else FP8_TOL
    assert _rel(y, ref) < tol and _rel(aa.grad, ra.grad) < tol and _rel(bb.grad, rb.grad) < tol
    assert float(bb.grad[1].abs().max()) == 0.0


def test_writes_into_a_tensor_keep_tiny_values() -> None:
    """index_put (accumulating), scatter, scatter_add, index_add (out of place, into a
    scaled tensor in place, into a plain tensor in place): the values of the plain op at
    2⁻³⁰, where FP16 data at scale 1 would be 0."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(6, 4, generator=gen)
    su, v = _st(u), u.half().float() * TINY
    zeros = torch.zeros(3, 4)
    idx = torch.tensor([0, 2, 2, 1, 0, 2])

    def check(got: Any, want: Tensor) -> None:
        val = got.dequantize() if isinstance(got, ScaledTensor) else got
        torch.testing.assert_close(val, want, rtol=2.0**-10, atol=0)
        assert float(want.abs().max()) > 0

    check(torch.index_put(zeros, (idx,), su, accumulate=True),
          torch.index_put(zeros, (idx,), v, accumulate=True))  # fmt: skip
    i2 = torch.tensor([[0, 1, 2, 0]] * 2)
    check(torch.scatter(torch.zeros(3, 4), 0, i2, su[:2]), torch.scatter(zeros, 0, i2, v[:2]))
    check(torch.scatter_add(zeros, 0, i2, su[:2]), torch.scatter_add(zeros, 0, i2, v[:2]))
    check(
        torch.index_add(zeros, 0, idx, su, alpha=2.0), torch.index_add(zeros, 0, idx, v, alpha=2.0)
    )
    dst = _st(torch.ones(3, 4), TINY)
    dst.index_add_(0, idx, su)
    check(dst, torch.ones(3, 4) * TINY + torch.index_add(zeros, 0, idx, v))
    plain = torch.zeros(3, 4)
    out = plain.index_add_(0, idx, su)  # HF's eager experts: zeros_like(x).index_add_(...)
    assert out is plain and not isinstance(plain, ScaledTensor)
    check(plain, torch.index_add(zeros, 0, idx, v))


def test_index_put_with_a_sliced_dimension() -> None:
    """``t[:, idx] = u`` (Falcon's cache writes) passes ``None`` for the sliced dimension in
    ``index_put``'s indices (which only the aten op takes): the rule writes it into a scaled
    tensor, and a scalify'd
    module with it gives the plain module's loss and weight gradient within FP16 rounding."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(2, 2, 4, generator=gen)
    v = u.half().float() * TINY
    idx = torch.tensor([0, 2])
    want = torch.zeros(2, 3, 4)
    want[:, idx] = v
    dst = _st(torch.zeros(2, 3, 4), TINY)
    dst[:, idx] = _st(u)
    torch.testing.assert_close(dst.dequantize(), want, rtol=2.0**-10, atol=0)

    class Write(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, generator=gen))

        def forward(self, x: Tensor) -> Tensor:
            t = torch.zeros(2, 4, 8)
            t[:, idx] = x[:, :2] * self.w[:2]
            return (t * t).sum()

    m, x = Write(), torch.randn(2, 4, 8, generator=gen)
    ref = m(x)
    ref.backward()
    g = m.w.grad.clone()  # type: ignore[union-attr]
    m.w.grad = None
    out = apply(m, "fp16")(x)
    val = out.dequantize() if isinstance(out, ScaledTensor) else out
    torch.testing.assert_close(val.float(), ref.detach(), rtol=2.0**-8, atol=0)
    val.backward()
    torch.testing.assert_close(m.w.grad, g, rtol=2.0**-8, atol=2.0**-8 * float(g.abs().max()))


def test_clamp_and_factories() -> None:
    x = torch.linspace(-3, 3, 13)
    sx = _st(x, 2.0**-20)
    xv = x.half().float() * 2.0**-20
    lim = 2.0**-20
    for got, want in ((sx.clamp(min=None, max=lim), xv.clamp(max=lim)),
                      (sx.clamp(-lim, lim), xv.clamp(-lim, lim)),
                      (torch.clamp_min(sx, -lim), xv.clamp(min=-lim)),
                      (sx.clamp(min=torch.full_like(x, -lim)), xv.clamp(min=-lim))):  # fmt: skip
        assert isinstance(got, ScaledTensor)
        torch.testing.assert_close(got.dequantize(), want, rtol=2.0**-10, atol=0)
    z = sx.new_zeros(2, 3)
    assert not isinstance(z, ScaledTensor) and z.dtype == torch.float32 and z.shape == (2, 3)
    assert sx.new_ones(2).sum() == 2 and sx.new_empty(4).shape == (4,)


def test_fp8_grouped_mm_multiplies_e4m3_operands() -> None:
    """In FP8 the grouped GEMM's operands are ScaledTensors rounded to E4M3 (power-of-two
    per-tensor scales): the output is the per-group product of the rounded values."""
    with config(data_format="fp8"):
        a = _st(torch.randn(8, 16, generator=torch.Generator().manual_seed(3)), 2.0**-12)
        b = _st(torch.randn(2, 16, 4, generator=torch.Generator().manual_seed(4)), 2.0**10)
        offs = torch.tensor([5, 8], dtype=torch.int32)
        y = torch._grouped_mm(a, b, offs=offs)
    assert isinstance(y, ScaledTensor)
    qa = quantize_scaled(a.dequantize(), "e4m3fn", power_of_two=True).dequantize()
    qb = quantize_scaled(b.dequantize(), "e4m3fn", power_of_two=True).dequantize()
    torch.testing.assert_close(y.dequantize(), _grouped_ref(qa, qb, offs), rtol=2.0**-10, atol=0)
    exact = _grouped_ref(a.dequantize(), b.dequantize(), offs)
    assert _rel(y.dequantize(), exact) > 2.0**-8  # FP8 rounding happened


def test_grouped_mm_with_a_scaled_bias_is_refused_by_name() -> None:
    a, b = _st(torch.ones(4, 8)), _st(torch.ones(2, 8, 4))
    with pytest.raises(NotImplementedError, match="_grouped_mm with a scaled bias"):
        torch._grouped_mm(
            a, b, offs=torch.tensor([2, 4], dtype=torch.int32), bias=_st(torch.ones(2, 4))
        )
