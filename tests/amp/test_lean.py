"""Lean optimizers (lowprec.amp.lean) against torch's with an oracle."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lowprec.amp import LeanAdam, LeanAdamW, LeanSGD, join_fp32, lean_optimizer

Make = Callable[[list[Any]], torch.optim.Optimizer]


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 300), nn.GELU(), nn.Linear(300, 1)).to(dtype)


def _groups(m: nn.Module) -> list[dict[str, Any]]:
    """u-μP style groups: each with an ``lr_mult`` that the loop applies."""
    return [
        {"params": list(m[0].parameters()), "lr_mult": 1.0},
        {"params": list(m[2].parameters()), "lr_mult": 0.25, "weight_decay": 0.0},
    ]


def _train(m: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    """``steps`` steps from ``start`` with a scheduler: per group ``lr · 0.9^t · lr_mult``
    (u-μP's multiplier, as lowprec.recipes.step.set_lr applies it) and gradient clipping."""
    fns = [lambda t, k=g["lr_mult"]: 0.9**t * k for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, fns, last_epoch=start - 1)
    for i in range(start, steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + i))
        loss = m(x.to(next(m.parameters()).dtype)).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        opt.step()
        sched.step()


TORCH_AND_LEAN: list[tuple[Make, Make]] = [
    (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
        lambda ps: LeanAdamW(ps, lr=1e-2, state="fp32"),
    ),
    (
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, foreach=False),
        lambda ps: LeanAdam(ps, lr=1e-2, weight_decay=0.1, state="fp32"),
    ),
    (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
        lambda ps: lean_optimizer(torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
    ),
    (
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3),
        lambda ps: LeanSGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    ),
]


@pytest.mark.parametrize(("torch_opt", "lean_opt"), TORCH_AND_LEAN)
def test_fp32_states_equal_torch_bit_for_bit(torch_opt: Make, lean_opt: Make) -> None:
    """Identity storage on FP32 parameters: the same operations in the same order as
    torch's single-tensor implementation, with groups, lr_mult, a scheduler, clipping."""
    a, b = _model(), _model()
    _train(a, torch_opt(_groups(a)), 6)
    _train(b, lean_opt(_groups(b)), 6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_remainder_master_equals_fp32_adamw_bit_for_bit() -> None:
    """BF16 parameters + remainders fed the same (BF16-representable) gradients as FP32
    parameters under torch's AdamW: join(p, r) is torch's FP32 weight, bit for bit."""
    a, b = _model(), _model(torch.bfloat16)
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            p.copy_(q)  # the same (BF16-representable) start
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    tb = LeanAdamW(b.parameters(), lr=1e-2, master="remainder")
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            q.grad = torch.randn(q.shape, generator=g).bfloat16()
            p.grad = q.grad.float()
        ta.step()
        tb.step()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(join_fp32(q.detach(), tb.state[q]["remainder"]), p)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_8bit_moments_per_step_error_is_the_formats_resolution(rounding: str) -> None:
    """Each step's new moments, decoded, against the FP32 update of the previous decoded
    moments (the oracle): E4M3's half ulp 2^-4 relative, or half its smallest subnormal
    step 2^-10 of the block scale (twice both for stochastic rounding: one neighbour or
    the other); for v, stored as sqrt(v): (1 + ε)² - 1 relative."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 32), nn.GELU(), nn.Linear(32, 1))
    opt = LeanAdamW(m.parameters(), lr=1e-2, state="8bit", state_rounding=rounding)  # type: ignore[arg-type]
    k = 1 if rounding == "nearest" else 2
    w = m[0].weight  # 32 blocks of 256
    for i in range(4):
        x = torch.randn(8, 256, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        st = opt.state[w]
        prev = {k: opt._get(st, k, w.shape).clone() for k in opt.moments} if st else None
        g = w.grad.clone()
        opt.step()
        if prev is None:
            prev = {k: torch.zeros_like(w) for k in opt.moments}
        m_ref = prev["exp_avg"].lerp(g, 0.1)
        v_ref = prev["exp_avg_sq"] * 0.999 + 0.001 * g * g
        eps = k * 2**-4 + 2**-20
        for name, ref, sq in (("exp_avg", m_ref, False), ("exp_avg_sq", v_ref, True)):
            got = opt._get(st, name, w.shape)
            base = ref.sqrt() if sq else ref
            s = (base.abs().view(-1).view(-1, 256).amax(1, keepdim=True) / 448).expand(-1, 256)
            s = s.reshape(w.shape)
            bound = eps * base.abs() + k * 2**-10 * s
            if sq:
                bound = (base.abs() + bound) ** 2 - base.abs() ** 2
            assert torch.all((got - ref).abs() <= bound * (1 + 2**-20)), (i, name)


def _update_sizes(state: str, **lean: Any) -> float:
    """Mean |update|/lr over the last 100 of 500 AdamW steps on noisy gradients with a
    drift (``g = 0.01·(N(0, 1) + 0.3)``, 256 elements: one E4M3 block)."""
    gen = torch.Generator().manual_seed(1)
    p = nn.Parameter(torch.zeros(1, 256))
    opt = LeanAdamW([p], lr=1e-3, weight_decay=0.0, state=state, **lean)
    sizes = []
    for _ in range(500):
        before = p.detach().clone()
        p.grad = (torch.randn(1, 256, generator=gen) + 0.3) * 0.01
        opt.step()
        sizes.append(float((p.detach() - before).abs().mean()) / 1e-3)
    return sum(sizes[-100:]) / 100


def test_8bit_states_follow_fp32_adamw_by_default() -> None:
    """8-bit moments rounded to nearest stall (v moves 0.1% of itself a step, under half an
    E4M3 step): their updates came out 0.74x FP32-state AdamW's here (2x with a large
    gradient elsewhere in the block). The default, stochastic state rounding, is the EMA
    in expectation: within 5% of FP32's (measured 2.3%; the 100 steps' mean of 256
    elements). BF16 states keep nearest (measured within 1%)."""
    ref = _update_sizes("fp32")
    assert abs(_update_sizes("8bit") / ref - 1) < 0.05
    assert _update_sizes("8bit", state_rounding="nearest") / ref < 0.85  # the stall
    assert abs(_update_sizes("bf16") / ref - 1) < 0.02
    with pytest.raises(ValueError, match="state_rounding must be"):
        LeanAdamW([nn.Parameter(torch.zeros(2, 2))], state_rounding="up")  # type: ignore[arg-type]


@pytest.mark.parametrize("ratio", [1e-6, 1e-7])
def test_8bit_small_second_moments_beside_a_large_one_never_blow_up_the_update(
    ratio: float,
) -> None:
    """One E4M3 block per row: one element with gradient ~1, the others ~ratio of it (their
    √v below the block's first code). Stored as 0, their √v made m/(√v + eps) explode:
    single AdamW steps of 372x (ratio 1e-6) and 464x (1e-7) the learning rate, 2.3x and
    5x FP32-state AdamW's mean update. Stored as the first code, no step exceeds FP32's
    largest (1.8x lr here, from the noise) and the mean update is at most FP32's: such
    elements learn slower than with FP32 states, never faster."""
    torch.manual_seed(0)
    lr = 1e-3
    p8, p32 = nn.Parameter(torch.zeros(2, 256)), nn.Parameter(torch.zeros(2, 256))
    o8 = LeanAdamW([p8], lr=lr, state="8bit", generator=torch.Generator().manual_seed(0))
    o32 = torch.optim.AdamW([p32], lr=lr, foreach=False)
    g0 = torch.full((2, 256), ratio)
    g0[:, 0] = 1.0
    worst, moved8, moved32 = 0.0, 0.0, 0.0
    for _ in range(300):
        g = g0 * (1 + 0.3 * torch.randn(2, 256))
        b8, b32 = p8.detach().clone(), p32.detach().clone()
        p8.grad, p32.grad = g.clone(), g.clone()
        o8.step()
        o32.step()
        d8 = (p8.detach() - b8)[:, 1:].abs() / lr
        worst = max(worst, float(d8.max()))
        moved8 += float(d8.mean())
        moved32 += float((p32.detach() - b32)[:, 1:].abs().mean()) / lr
    assert worst < 2.0
    assert moved8 < 1.05 * moved32


def test_state_dict_round_trip_resumes_bit_for_bit() -> None:
    """8-bit states, BF16 parameters with stochastic rounding: stopping, saving through
    torch.save, loading into a fresh model and optimizer, and going on equals going on."""
    import io

    def make(m: nn.Module) -> torch.optim.Optimizer:
        gen = torch.Generator().manual_seed(7)
        return LeanAdamW(_groups(m), lr=1e-2, state="8bit", stochastic_rounding=True,
                         generator=gen, state_rounding="stochastic")  # fmt: skip

    a = _model(torch.bfloat16)
    _train(a, make(a), 6)
    b = _model(torch.bfloat16)
    ob = make(b)
    _train(b, ob, 3)
    buf = io.BytesIO()
    torch.save({"model": b.state_dict(), "opt": ob.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    c = _model(torch.bfloat16)
    c.load_state_dict(saved["model"])
    oc = make(c)
    oc.load_state_dict(saved["opt"])
    st = oc.state[c[0].weight]
    assert st["exp_avg"].dtype == torch.uint8 and st["exp_avg_scale"].dtype == torch.float32
    sd1, sd2 = oc.state_dict(), ob.state_dict()
    assert torch.equal(sd1["generator"], sd2["generator"])
    _train(c, oc, 6, start=3)
    for p, q in zip(a.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q)


def test_stochastic_rounding_moves_bf16_weights_by_sub_ulp_updates() -> None:
    """An update of 1/8 of a BF16 ulp: round to nearest keeps every weight; stochastic
    rounding moves 1/8 of them by one ulp, so the mean moves by the update (4 σ)."""
    n, lr = 20000, 2.0**-10  # ulp at 1.0 is 2^-7: the update is 1/8 ulp
    res = {}
    for sr in (False, True):
        p = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
        opt = LeanSGD(
            [p], lr=lr, stochastic_rounding=sr, generator=torch.Generator().manual_seed(0)
        )
        p.grad = torch.ones(n, dtype=torch.bfloat16)
        opt.step()
        res[sr] = p.float().mean().item()
    assert res[False] == 1.0
    sigma = 2**-7 * (1 / 8 * 7 / 8) ** 0.5 / n**0.5
    assert abs(res[True] - (1 - lr)) < 4 * sigma


def test_bad_arguments_name_themselves() -> None:
    p = nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="master must be 'none' or 'remainder'"):
        LeanAdamW([p], master="fp32")
    with pytest.raises(ValueError, match="master='remainder' needs bfloat16 parameters"):
        LeanAdamW([p], master="remainder")
    with pytest.raises(ValueError, match="precision must be 'fp32', 'bf16' or '8bit'"):
        LeanAdamW([p], state="4bit")
    with pytest.raises(ValueError, match="lean optimizer states exist for"):
        lean_optimizer(torch.optim.RMSprop([p]))
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        lean_optimizer(torch.optim.AdamW([p], amsgrad=True))
    with pytest.raises(ValueError, match=r"weight_decay must be >= 0, got -0\.1"):
        LeanSGD([p], weight_decay=-0.1)
    with pytest.raises(ValueError, match=r"dampening must be in \[0, 1\], got -1"):
        LeanSGD([p], momentum=0.9, dampening=-1)
    opt = LeanAdamW([p])
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0]["params"] = [0, 1]
    with pytest.raises(ValueError, match="parameter groups do not match"):
        opt.load_state_dict(bad)


def test_sr_bf16_is_quantize_bit_for_bit() -> None:
    """The stochastic rounding a shard uses (its rows of the whole tensor's draws) is
    quantize(..., "stochastic") given the same draws: normal and subnormal values, zeros,
    Inf, NaN, values that round to Inf."""
    from lowprec.amp.lean import sr_bf16
    from lowprec.core.rounding import quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * 10 ** (torch.rand(20000, generator=g) * 80 - 40)
    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.39e38, 1e-45, -1e-40]
    x = torch.cat([x, torch.tensor(special)])
    want = quantize(x, "bf16", "stochastic", generator=torch.Generator().manual_seed(3))
    bits = torch.randint(0, 2**23, x.shape, generator=torch.Generator().manual_seed(3),
                         dtype=torch.int32)  # fmt: skip
    got = sr_bf16(x, bits)
    assert torch.equal(got.view(torch.int16), want.bfloat16().view(torch.int16))


def test_8bit_states_of_1d_tensors_stay_fp32() -> None:
    """1-D tensors (biases) keep FP32 moments under state="8bit" (their blocks would cross
    FSDP2's shard boundaries); 2-D ones are 8-bit with (rows, blocks per row) scales."""
    m = _model(torch.bfloat16)
    opt = LeanAdamW(_groups(m), lr=1e-2, state="8bit")
    _train(m, opt, 1)
    w, b = opt.state[m[0].weight], opt.state[m[0].bias]
    assert w["exp_avg"].dtype == torch.uint8 and w["exp_avg"].shape == (300, 16)
    assert w["exp_avg_scale"].shape == (300, 1)
    assert b["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in b
