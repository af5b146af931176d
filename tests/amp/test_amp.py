"""Tests for lowprec.amp: loss scalers (against torch.amp.GradScaler), master weights,
FP32 sensitive ops, the CPU FP16 matmul mode and gradient statistics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec.amp import (
    DynamicLossScaler,
    Fp16MatmulInFp32,
    MasterWeights,
    MatmulInFp32,
    NoLossScaler,
    StaticLossScaler,
    cross_entropy_fp32,
    grad_stats,
    layer_norm_fp32,
    softmax_fp32,
)


def _model(dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(8, 4).to(dtype)


def test_static_scaler_unscales_exactly() -> None:
    """Power-of-two scale: scaled backward then unscale equals the plain FP32 gradient."""
    x = torch.randn(16, 8)
    ref, m = _model(), _model()
    ref(x).square().mean().backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = StaticLossScaler(2.0**10)
    s.scale(m(x).square().mean()).backward()
    s.unscale_(opt)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)
    assert s.step(opt) is True
    s.update()
    assert s.history[-1].scale == 1024.0 and not s.history[-1].skipped


def test_skip_on_nonfinite_gradient() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    s = StaticLossScaler(4.0)
    s.scale(m(torch.randn(2, 8)).sum()).backward()
    assert m.weight.grad is not None
    m.weight.grad[0, 0] = math.inf
    assert s.step(opt) is False
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before, strict=True))
    assert s.skipped_steps == 1
    with pytest.raises(RuntimeError, match="already called"):
        s.unscale_(opt)
        s.unscale_(opt)


def test_no_loss_scaler_never_skips() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    s = NoLossScaler()
    m(torch.randn(2, 8)).sum().backward()
    assert m.weight.grad is not None
    m.weight.grad[0, 0] = math.nan
    assert s.step(opt) is True and math.isnan(float(m.weight.detach()[0, 0]))


def test_dynamic_scaler_matches_torch_gradscaler() -> None:
    """The same pattern of overflowing and clean steps gives GradScaler's scale sequence."""
    pattern = [False, True, False, False, False, True, True, False, False, False, False]
    ours = DynamicLossScaler(init_scale=2.0**8, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    m1, m2 = _model(), _model()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.0)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.0)
    for overflow in pattern:
        for m, opt, sc in ((m1, o1, ours), (m2, o2, theirs)):
            opt.zero_grad()
            sc.scale(m(torch.ones(1, 8)).sum()).backward()
            if overflow:
                assert m.weight.grad is not None
                m.weight.grad[0, 0] = math.inf
            sc.step(opt)
            sc.update()
        assert ours.loss_scale == theirs.get_scale()
    assert [r.skipped for r in ours.history] == pattern


def test_dynamic_scaler_bounds_and_state() -> None:
    s = DynamicLossScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=8.0)
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    for overflow in [True, True, True, False, False, False]:
        opt.zero_grad()
        s.scale(m(torch.ones(1, 8)).sum()).backward()
        if overflow:
            assert m.weight.grad is not None
            m.weight.grad.fill_(math.nan)
        s.step(opt)
        s.update()
    assert [r.scale for r in s.history] == [4.0, 2.0, 2.0, 2.0, 4.0, 8.0]
    assert s.loss_scale == 8.0, "growth stops at max_scale"
    t = DynamicLossScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=8.0)
    t.load_state_dict(s.state_dict())
    assert t.loss_scale == 8.0 and t.history == s.history
    with pytest.raises(ValueError, match="saved by StaticLossScaler"):
        t.load_state_dict(StaticLossScaler(1.0).state_dict())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 0.0}, "scale must be finite and > 0"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"init_scale": 2.0**30}, "init_scale must lie"),
    ],
)
def test_dynamic_scaler_bad_args(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DynamicLossScaler(**kwargs)  # type: ignore[arg-type]


def test_loss_scaling_recovers_fp16_gradients_that_underflow() -> None:
    """A small loss on an FP16 layer trained through lowprec's ``MasterWeights``: without
    loss scaling (``NoLossScaler``) its FP16 gradients flush to zero; with
    ``StaticLossScaler(2^16)`` they are normal FP16 numbers, and the scaler's ``step``
    divides them by the scale in FP32, in the master copy's gradients (unscaled in FP16
    they would flush again), which the update then uses."""
    torch.manual_seed(0)
    w32 = torch.randn(64, 64) * 0.05
    x = torch.randn(32, 64)
    w64 = w32.double().requires_grad_()
    ((x.double() @ w64).square().mean() * 1e-4).backward()
    assert w64.grad is not None
    ref = w64.grad.float()
    assert float(ref.abs().max()) < 2.0**-14, "the true gradients sit below FP16's normals"

    def master_grad(scaler: NoLossScaler | StaticLossScaler) -> torch.Tensor:
        w = nn.Parameter(w32.half())
        opt = MasterWeights([w], lambda ps: torch.optim.SGD(ps, lr=1.0))
        loss = (x.half() @ w).float().square().mean() * 1e-4
        scaler.scale(loss).backward()
        assert scaler.step(opt)  # unscales (a StaticLossScaler), then updates
        g = opt.master_params[0].grad
        assert g is not None and g.dtype == torch.float32
        assert torch.equal(opt.master_params[0].detach(), w32.half().float() - g)  # SGD, lr 1
        return g

    plain = master_grad(NoLossScaler())
    scaled = master_grad(StaticLossScaler(2.0**16))
    assert float((plain == 0).float().mean()) > 0.05, "FP16 flushes some of them to zero"

    def rel_l2(g: torch.Tensor) -> float:
        return float((g - ref).norm() / ref.norm())

    # Unscaled, most values are FP16 subnormals (a few significant bits) or zero.
    assert rel_l2(plain) > 0.1
    # Scaled by 2^16 they are normal: the error is FP16 rounding (2^-11 per op, a few ops).
    assert rel_l2(scaled) < 2.0**-8
    assert float((scaled == 0).float().mean()) == 0.0


def test_master_weights_update_in_fp32() -> None:
    m = _model(torch.bfloat16)
    opt = MasterWeights(m.parameters(), lambda ps: torch.optim.SGD(ps, lr=1e-3))
    master0 = [p.detach().clone() for p in opt.master_params]
    x = torch.randn(4, 8).bfloat16()
    m(x).float().sum().backward()
    opt.step()
    for p, mp, m0 in zip(m.parameters(), opt.master_params, master0, strict=True):
        assert p.grad is not None
        expected = m0 - 1e-3 * p.grad.float()  # SGD in FP32 on the master copy
        assert torch.equal(mp.detach(), expected)
        assert torch.equal(p.detach(), expected.bfloat16()), "write-back rounds to nearest"
    # An update far below BF16's resolution accumulates in the master copy.
    w0 = m.weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        m.weight.grad = torch.full_like(m.weight, 1e-3)
        m.bias.grad = torch.zeros_like(m.bias)
        opt.step()
    assert float((opt.master_params[0].detach() - w0.float()).abs().max()) > 0


def test_master_weights_stochastic_write_back_is_unbiased() -> None:
    target = torch.full((20000,), 1.0 + 2.0**-10)  # between BF16 1.0 and 1.0078125
    p = nn.Parameter(torch.ones(20000, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    opt = MasterWeights([p], lambda ps: torch.optim.SGD(ps, lr=0.0), True, g)
    with torch.no_grad():
        opt.master_params[0].copy_(target)
    p.grad = torch.zeros_like(p)
    opt.step()
    vals = p.detach().float()
    assert set(vals.unique().tolist()) == {1.0, 1.0078125}
    # P(up) = 2^-10 / 2^-7 = 1/8; mean within 5 standard errors of the Bernoulli mean.
    share = float((vals > 1).float().mean())
    assert abs(share - 0.125) < 5 * math.sqrt(0.125 * 0.875 / 20000)
    state = opt.state_dict()
    assert "generator" in state and len(state["master"]) == 1


def test_fp32_sensitive_ops() -> None:
    x = (torch.randn(4, 16) * 30).half()  # exp(x) overflows FP16 without the max shift
    ref = torch.softmax(x.double(), -1)
    out = softmax_fp32(x)
    assert out.dtype == torch.float16
    assert torch.allclose(out.double(), ref, atol=2.0**-11, rtol=0), "one FP16 rounding"
    w, b = torch.randn(16).half(), torch.randn(16).half()
    ln = layer_norm_fp32(x, (16,), w, b)
    ref_ln = torch.nn.functional.layer_norm(x.double(), (16,), w.double(), b.double())
    assert ln.dtype == torch.float16
    assert torch.allclose(ln.double(), ref_ln, rtol=2.0**-10, atol=2.0**-14)
    logits = torch.randn(2, 3, 10).half()
    tgt = torch.randint(0, 10, (2, 3))
    ce = cross_entropy_fp32(logits, tgt)
    ref_ce = torch.nn.functional.cross_entropy(logits.double().reshape(6, 10), tgt.reshape(6))
    assert ce.dtype == torch.float32 and abs(float(ce) - float(ref_ce)) < 1e-6


def test_fp16_matmul_mode_is_fp32_accumulate_then_round() -> None:
    a = torch.randn(64, 256).half().requires_grad_()
    b = torch.randn(256, 32).half().requires_grad_()
    with Fp16MatmulInFp32():  # type: ignore[no-untyped-call]
        out = a @ b
        out.float().sum().backward()
    assert out.dtype == torch.float16
    assert torch.equal(out, (a.detach().float() @ b.detach().float()).half())
    assert a.grad is not None and a.grad.dtype == torch.float16
    ones = torch.ones(64, 32)
    assert torch.equal(a.grad, (ones @ b.detach().float().T).half())


def test_bf16_matmul_mode_matches_native_bf16_gemm() -> None:
    """BF16 products as FP32 products rounded once to BF16 equal torch's native BF16 GEMM
    (FP32 accumulation) except where the two FP32 sums, taken in different orders, round
    to neighbouring BF16 values: at most 1 BF16 ulp (2^-7 relative), on a few percent of
    the outputs. Gradients too."""
    torch.manual_seed(0)
    a = torch.randn(64, 256).bfloat16().requires_grad_()
    w = torch.randn(32, 256).bfloat16().requires_grad_()
    g = torch.randn(64, 32).bfloat16()
    native = F.linear(a, w)
    ga, gw = torch.autograd.grad(native, (a, w), g)
    with MatmulInFp32(torch.bfloat16):  # type: ignore[no-untyped-call]
        out = F.linear(a, w)
        ea, ew = torch.autograd.grad(out, (a, w), g)
    assert out.dtype == ea.dtype == ew.dtype == torch.bfloat16
    assert torch.equal(out, (a.detach().float() @ w.detach().float().T).bfloat16())
    for got, ref in ((out, native), (ea, ga), (ew, gw)):
        rel = (got.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-30)
        assert rel.max() <= 2.0**-7 and (got != ref).float().mean() < 0.1


def test_bf16_matmul_mode_stands_aside_under_autocast() -> None:
    """Under CPU autocast to BF16 the mode leaves every product to autocast (which also
    casts the backward products, out of a function mode's sight)."""
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 64), torch.randn(16, 64), torch.randn(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = F.linear(x, w, b)
        with MatmulInFp32(torch.bfloat16):  # type: ignore[no-untyped-call]
            out = F.linear(x, w, b)
    assert out.dtype == torch.bfloat16 and torch.equal(out, native)
    with pytest.raises(ValueError, match="dtype"):
        MatmulInFp32(torch.float32)


def test_grad_stats() -> None:
    p = nn.Parameter(torch.zeros(4))
    q = nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([0.0, 3.0, 0.0, math.inf])
    q.grad = torch.tensor([4.0, 0.0, 0.0, 0.0])
    s = grad_stats([p, q, nn.Parameter(torch.zeros(2))])
    assert s["grad_zero_share"] == 5 / 8
    assert s["grad_nonfinite_share"] == 1 / 8
    assert s["grad_norm"] == 5.0, "non-finite values are left out of the norm"


@pytest.mark.slow
def test_fp16_matmul_mode_traces_under_compile() -> None:
    """The mode is a torch function mode: torch.compile captures it in one graph."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).half()
    x = torch.randn(8, 16).half()
    counter = CompileCounter()
    compiled = torch.compile(m, backend=counter, fullgraph=True)
    with Fp16MatmulInFp32():
        eager = m(x)
        out = compiled(x)
    assert counter.frame_count == 1
    assert torch.equal(out, eager)
    with Fp16MatmulInFp32():
        ref = (x.float() @ m[0].weight.detach().float().T + m[0].bias.detach().float()).half()
        assert torch.equal(m[0](x), ref)


def test_master_weights_with_parameter_groups() -> None:
    # u-μP hands per-group learning rates: each FP32 master must be stepped with its own
    # group's lr. SGD on a gradient of exactly 1 moves a weight by exactly -lr.
    model = nn.Linear(4, 2).bfloat16()
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    groups = [
        {"params": [model.weight], "lr": 0.25, "lr_mult": 0.5},
        {"params": [model.bias], "lr": 0.5, "lr_mult": 1.0},
    ]
    opt = MasterWeights(groups, lambda gs: torch.optim.SGD(gs, lr=1.0))
    assert [g["lr_mult"] for g in opt.param_groups] == [0.5, 1.0]
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()
    assert torch.equal(model.weight, torch.full_like(model.weight, 0.75))
    assert torch.equal(model.bias, torch.full_like(model.bias, 0.5))
    with pytest.raises(ValueError, match="no 'params'"):
        MasterWeights([{"lr": 1.0}], lambda gs: torch.optim.SGD(gs, lr=1.0))
    with pytest.raises(TypeError, match="mix of parameter groups"):
        MasterWeights(
            [{"params": [model.bias]}, model.weight],  # type: ignore[list-item]
            lambda gs: torch.optim.SGD(gs, lr=1.0),
        )
