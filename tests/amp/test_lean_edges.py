"""Lean optimizers at their edges (a new user's trial): per-group decoupled weight decay,
non-finite elements in 8-bit states, state-dict formats, add_param_group, torch's keyword
arguments, and the global RNG. Oracles: torch's optimizers in FP32 (``foreach=False``)
and hand maths."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import lowprec
from lowprec.amp import LeanAdam, LeanAdamW, LeanSGD, StateCodec, join_fp32, lean_optimizer

Make = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def _grads(ps: list[nn.Parameter], t: int) -> None:
    g = torch.Generator().manual_seed(100 + t)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


# -- 1. decoupled_weight_decay per group ---------------------------------------------------
DECOUPLED: list[tuple[Make, Make]] = [
    (  # Adam whose second group decays as AdamW
        lambda gs: torch.optim.Adam(gs, lr=0.1, weight_decay=0.5, foreach=False),
        lambda gs: LeanAdam(gs, lr=0.1, weight_decay=0.5),
    ),
    (  # the mirror: AdamW whose second group decays as Adam (L2)
        lambda gs: torch.optim.AdamW(gs, lr=0.1, weight_decay=0.5, foreach=False),
        lambda gs: LeanAdamW(gs, lr=0.1, weight_decay=0.5),
    ),
]


@pytest.mark.parametrize("convert", [False, True], ids=["direct", "lean_optimizer"])
@pytest.mark.parametrize(("torch_opt", "lean_opt"), DECOUPLED, ids=["Adam", "AdamW"])
def test_decoupled_weight_decay_is_a_group_option_as_in_torch(
    torch_opt: Make, lean_opt: Make, convert: bool
) -> None:
    """torch's Adam/AdamW read ``decoupled_weight_decay`` per group; so do the lean ones,
    constructed directly or converted (it used to be ignored: both groups decayed as the
    class's default). FP32 states on FP32 parameters: bit for bit."""
    torch.manual_seed(0)
    ref = [nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    got = [nn.Parameter(p.detach().clone()) for p in ref]
    flip = not isinstance(torch_opt([{"params": [nn.Parameter(torch.ones(1))]}]), torch.optim.AdamW)

    def groups(ps: list[nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": [ps[0]]}, {"params": [ps[1]], "decoupled_weight_decay": flip}]

    a = torch_opt(groups(ref))
    b = lean_optimizer(torch_opt(groups(got))) if convert else lean_opt(groups(got))
    for t in range(5):
        _grads(ref, t)
        _grads(got, t)
        a.step()
        b.step()
    for p, q in zip(ref, got, strict=True):
        assert torch.equal(p, q)


# -- 2. non-finite elements in 8-bit states ------------------------------------------------
def _finite_scale(base: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Each element's block scale (one block of 256 per row) from the elements ``ok``
    only: amax / 448 over the finite neighbours (the oracle, recomputed here)."""
    amax = torch.where(ok, base.abs(), 0.0).amax(1, keepdim=True)
    return (amax / 448).expand_as(base)


def _check_moments(
    opt: LeanAdamW, w: nn.Parameter, prev: dict[str, torch.Tensor], g: torch.Tensor,
    ok: torch.Tensor,
) -> None:  # fmt: skip
    """The stored moments of the elements ``ok`` against the FP32 update of the previous
    decoded ones, within state_codec's documented bound for stochastic rounding (twice
    E4M3's half ulp 2^-4 relative, plus twice half its smallest subnormal step 2^-10 of
    the block scale; for v through √v: (√v + bound)² - v), the scale taken over the
    finite neighbours only: a bad element in the block must not change it. 2^-20: the
    FP32 rounding of x / s and codes · s."""
    st = opt.state[w]
    m_ref = prev["exp_avg"].lerp(g, 0.1)
    v_ref = prev["exp_avg_sq"].mul(0.999).addcmul(g, g, value=0.001)
    for name, ref, sq in (("exp_avg", m_ref, False), ("exp_avg_sq", v_ref, True)):
        got = opt._get(st, name, w.shape)
        base = ref.sqrt() if sq else ref
        bound = 2 * 2**-4 * base.abs() + 2 * 2**-10 * _finite_scale(base, ok)
        if sq:
            bound = (base.abs() + bound) ** 2 - base.abs() ** 2
        err = (got - ref).abs()
        assert torch.all(err[ok] <= bound[ok] * (1 + 2**-20)), name


def _bad_run(bad: float, steps: int) -> tuple[nn.Parameter, nn.Parameter, LeanAdamW]:
    """torch AdamW (FP32) and LeanAdamW(state="8bit") from the same (2, 256) weights (one
    block per row), the gradient ``0.001·(N(0, 1) + 0.3)`` with ``bad`` at [0, 0] in the
    first step; each step's moments checked (:func:`_check_moments`)."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(2, 256))
    b = nn.Parameter(a.detach().clone())
    ta = torch.optim.AdamW([a], lr=1e-2, foreach=False)
    lb = LeanAdamW([b], lr=1e-2, state="8bit", generator=torch.Generator().manual_seed(0))
    ok = torch.ones(2, 256, dtype=torch.bool)
    ok[0, 0] = False
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        g = (torch.randn(2, 256, generator=gen) + 0.3) * 1e-3
        if t == 0:
            g[0, 0] = bad
        st = lb.state[b]
        prev = {k: lb._get(st, k, b.shape).clone() for k in lb.moments} if st else None
        a.grad, b.grad = g.clone(), g.clone()
        ta.step()
        lb.step()
        _check_moments(lb, b, prev or {k: torch.zeros(2, 256) for k in lb.moments}, g, ok)
    return a, b, lb


def _moved(run: Callable[[], tuple[nn.Parameter, nn.Parameter]]) -> tuple[float, float]:
    """Mean |w_T - w_0| of the finite neighbours ([0, 1:]) under torch and lean."""
    torch.manual_seed(0)
    w0 = torch.randn(2, 256)[0, 1:]
    a, b = run()
    return float((a.detach()[0, 1:] - w0).abs().mean()), float(
        (b.detach()[0, 1:] - w0).abs().mean()
    )


def test_8bit_huge_gradient_stays_in_its_element() -> None:
    """One finite gradient of 1e30: (1-β₂)g² overflows, torch keeps v = ∞ there, so that
    weight's update is m/∞ = 0 for good (only the weight decay moves it) and every weight
    stays finite. It used to make the block scale ∞ and all 256 weights NaN. Now: that
    weight equals torch's bit for bit (the same multiply by 1 - lr·λ, and + 0), its v
    decodes as +∞, and its neighbours' moments keep the documented bound with the
    block's scale over them alone (checked each step)."""
    a, b, lb = _bad_run(1e30, 40)
    assert torch.isfinite(b).all()
    assert torch.equal(a[0, 0], b[0, 0])
    assert lb._get(lb.state[b], "exp_avg_sq", b.shape)[0, 0].item() == math.inf
    ta, tb = _moved(lambda: _bad_run(1e30, 40)[:2])
    # 5%: stochastic 8-bit states follow FP32's mean update within it (test_lean.py's
    # test_8bit_states_follow_fp32_adamw_by_default; measured here: 1%)
    assert abs(tb / ta - 1) < 0.05


def test_8bit_nan_gradient_stays_in_its_element() -> None:
    """One NaN gradient element: torch's weight there is NaN, its neighbours untouched.
    The block's scale used to fall to 1 (amax NaN), so the neighbours' moments rounded on
    an absolute grid and they moved 0.16× torch's over 50 steps. Now the NaN stays in
    its element and the neighbours keep the documented bound each step."""
    a, b, _ = _bad_run(math.nan, 50)
    assert math.isnan(a[0, 0].item()) and math.isnan(b[0, 0].item())
    assert int(torch.isnan(b).sum()) == 1
    ta, tb = _moved(lambda: _bad_run(math.nan, 50)[:2])
    assert abs(tb / ta - 1) < 0.05  # 5%: as above (measured: 1%)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
@pytest.mark.parametrize("sqrt", [False, True])
def test_codec_codes_non_finite_elements_one_by_one(fmt: str, sqrt: bool, rounding: str) -> None:
    """A block with NaN and ∞ among finite values: the finite ones decode exactly as in
    the same block with those elements set to 0 (the scale is amax/q_max of the finite
    ones, hand-computed; the same draws), NaN decodes as NaN, +∞ as +∞ for √v codecs (and
    as NaN for first moments, which have no spare code). A block whose largest value is
    below 448·2^-149 used to get the scale 0 (0/0: its zeros decoded as NaN)."""
    c = StateCodec(fmt, block_size=8, sqrt=sqrt, rounding=rounding)  # type: ignore[arg-type]
    x = torch.tensor([[0.5, math.nan, 0.25, math.inf, 1e-3, 0.0, 2.0, 0.1]])
    if not sqrt:
        x[0, 4] = -math.inf
    clean = torch.where(x.isfinite(), x, 0.0)
    codes, scales = c.encode(x, torch.Generator().manual_seed(0))
    ref_codes, ref_scales = c.encode(clean, torch.Generator().manual_seed(0))
    qmax = {"e4m3": 448.0, "int8": 127.0}[fmt]
    amax = math.sqrt(2.0) if sqrt else 2.0
    assert scales is not None and scales.tolist() == [[pytest.approx(amax / qmax, rel=2**-23)]]
    got, want = c.decode(codes, scales, x.shape), c.decode(ref_codes, ref_scales, x.shape)
    fin = x.isfinite()
    assert torch.equal(got[fin], want[fin])
    assert math.isnan(got[0, 1].item())
    if sqrt:
        assert got[0, 3].item() == math.inf
    else:
        assert math.isnan(got[0, 3].item()) and math.isnan(got[0, 4].item())
    tiny = torch.tensor([[1e-44, 0.0, -1e-45, 0.0]])  # amax / 448 underflows FP32
    t = StateCodec(fmt, block_size=4, rounding=rounding)  # type: ignore[arg-type]
    tc, ts = t.encode(tiny, torch.Generator().manual_seed(0))
    back = t.decode(tc, ts, tiny.shape)
    # the bound |x̂ - x| ≤ 2·(2^-4·|x| + 2^-10·s) with s ≥ 2^-149 (one subnormal step)
    assert torch.all((back - tiny).abs() <= 2 * 1e-44 + 2.0**-149)


# -- 3. load_state_dict refuses another storage format -------------------------------------
def _adamw_run(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], steps: int) -> tuple[
    list[nn.Parameter], torch.optim.Optimizer
]:  # fmt: skip
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(8, 300)), nn.Parameter(torch.randn(8))]
    opt = make(ps)
    for t in range(steps):
        _grads(ps, t)
        opt.step()
    return ps, opt


KW: dict[str, Any] = {"lr": 1e-2, "betas": (0.8, 0.9), "weight_decay": 0.1}


@pytest.mark.parametrize(
    ("src", "dst"), [("8bit", "bf16"), ("8bit", "fp32"), ("bf16", "fp32"), ("fp32", "8bit")]
)
def test_load_refuses_another_state_format_and_changes_nothing(src: str, dst: str) -> None:
    """8-bit codes loaded into BF16 states were read as integers (moments 10^5 times too
    large). Now ValueError naming the state and both formats, before anything changes:
    the target goes on as its twin that was never offered the dict. torch AdamW's state
    dict still loads into state="fp32" and goes on as torch, bit for bit."""
    _, o_src = _adamw_run(lambda ps: LeanAdamW(ps, state=src, **KW), 3)
    twin_ps, twin = _adamw_run(lambda ps: LeanAdamW(ps, state=dst, **KW), 2)
    ps, opt = _adamw_run(lambda ps: LeanAdamW(ps, state=dst, **KW), 2)
    with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter 0 was saved as") as e:
        opt.load_state_dict(copy.deepcopy(o_src.state_dict()))
    assert ({"8bit": "e4m3", "bf16": "bf16", "fp32": "fp32"}[dst]) in str(e.value)
    for o, qs in ((opt, ps), (twin, twin_ps)):
        _grads(qs, 2)
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, twin_ps, strict=True))

    def torch_adamw(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, foreach=False, **KW)

    ref, _ = _adamw_run(torch_adamw, 6)
    half, t_opt = _adamw_run(torch_adamw, 3)
    lean = LeanAdamW(half, state="fp32", **KW)
    lean.load_state_dict(copy.deepcopy(t_opt.state_dict()))
    for t in range(3, 6):
        _grads(half, t)
        lean.step()
    assert all(torch.equal(p, q) for p, q in zip(ref, half, strict=True))


# -- 4. add_param_group checks as the constructor -----------------------------------------
def test_add_param_group_checks_parameters_as_the_constructor() -> None:
    """add_param_group used to accept an FP16 parameter under master="remainder" (no
    remainder: no exact master) and an int64 tensor. Now the constructor's errors, the
    group left out; a BF16 group added later gets its remainder, whose FP32 master
    follows torch's AdamW bit for bit (BF16-representable gradients)."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 4).bfloat16())
    opt = LeanAdamW([p], lr=1e-2, master="remainder")
    with pytest.raises(ValueError, match="master='remainder' needs bfloat16 parameters"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4).half())]})
    with pytest.raises(TypeError, match="params: expected floating-point parameters"):
        opt.add_param_group({"params": [torch.zeros(3, dtype=torch.int64)]})
    assert len(opt.param_groups) == 1
    q = nn.Parameter(torch.randn(4, 4).bfloat16())
    ref = nn.Parameter(q.detach().float())
    opt.add_param_group({"params": [q], "lr": 0.1})
    t_opt = torch.optim.AdamW([ref], lr=0.1, foreach=False)
    for t in range(4):
        _grads([q], t)
        ref.grad = q.grad.float()  # type: ignore[union-attr]
        opt.step()
        t_opt.step()
    assert torch.equal(join_fp32(q.detach(), opt.state[q]["remainder"]), ref)


# -- 5. arguments --------------------------------------------------------------------------
def test_torch_keyword_arguments_and_inconsistent_lean_arguments() -> None:
    """torch's ``amsgrad=False`` / ``maximize=False`` / ``differentiable=False`` and
    positional betas are accepted (the result equals torch's, bit for bit); True is a
    ValueError, as lean_optimizer's. betas of other than two numbers, ``codecs`` with
    ``state``/``block_size``/``state_rounding``, ``block_size=0`` and stochastic rounding
    of FP32 states (which does nothing) are ValueErrors naming the argument."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(3, 5))
    b, c = nn.Parameter(a.detach().clone()), nn.Parameter(a.detach().clone())
    ta = torch.optim.Adam([a], 1e-2, (0.8, 0.99), foreach=False, amsgrad=False, maximize=False)
    lb = LeanAdam([b], 1e-2, (0.8, 0.99), amsgrad=False, maximize=False, differentiable=False)
    lc = LeanSGD([c], lr=1e-2, momentum=0.9, maximize=False, differentiable=False)
    tc = nn.Parameter(a.detach().clone())
    t_sgd = torch.optim.SGD([tc], lr=1e-2, momentum=0.9, foreach=False)
    for t in range(3):
        for q in (a, b, c, tc):
            _grads([q], t)  # the same gradient for each
        for o in (ta, lb, lc, t_sgd):
            o.step()
    assert torch.equal(a, b) and torch.equal(c, tc)
    p = [nn.Parameter(torch.zeros(2, 2))]
    for key in ("amsgrad", "maximize", "differentiable"):
        with pytest.raises(ValueError, match=f"{key}=True is not supported by LeanAdamW"):
            LeanAdamW(p, **{key: True})
    for betas in [(0.9,), (0.9, 0.999, 0.5), 0.9, ("0.9", 0.999)]:
        with pytest.raises(ValueError, match="betas must be two floats"):
            LeanAdamW(p, betas=betas)
    with pytest.raises(ValueError, match="codecs replaces state, block_size and state_rou"):
        LeanAdamW(p, state="8bit", codecs=(StateCodec(), StateCodec()))
    with pytest.raises(ValueError, match="codecs replaces"):
        LeanAdamW(p, block_size=64, codecs=(StateCodec(), StateCodec()))
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        LeanAdamW(p, block_size=0)
    with pytest.raises(ValueError, match="state_rounding='stochastic' does nothing"):
        LeanAdamW(p, state_rounding="stochastic")
    for state in ("fp32", "bf16"):  # no blocks: the argument was accepted and ignored
        with pytest.raises(ValueError, match=f"block_size=64 only applies.*got state={state!r}"):
            LeanAdamW(p, state=state, block_size=64)


# -- 6. the global RNG -----------------------------------------------------------------------
def _global_draw(make: Callable[[], object]) -> float:
    """The first global draw after ``manual_seed(0)`` and ``make()``."""
    torch.manual_seed(0)
    make()
    return float(torch.rand(()))


def _zeros() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(2, 2))]


@pytest.mark.parametrize(
    ("make", "plain"),
    [
        (
            lambda: lowprec.prepare(nn.Linear(4, 4), "bf16-remainder"),
            lambda: lowprec.prepare(nn.Linear(4, 4), "bf16"),
        ),
        (lambda: LeanAdamW(_zeros(), state="bf16"), lambda: torch.optim.AdamW(_zeros())),
        (
            lambda: LeanSGD(_zeros(), momentum=0.9, state="8bit", state_rounding="nearest"),
            lambda: torch.optim.SGD(_zeros(), momentum=0.9),
        ),
    ],
    ids=["prepare-bf16-remainder", "bf16-states", "8bit-nearest"],
)
def test_an_optimizer_without_randomness_leaves_the_global_rng(
    make: Callable[[], object], plain: Callable[[], object]
) -> None:
    """A lean optimizer that never draws (no stochastic rounding of parameters or states)
    used to seed its generator from torch's global one, so data and dropout after
    prepare("bf16-remainder") differed from prepare("bf16")'s. The next global draw now
    equals the one after the randomness-free torch twin (the same model init draws)."""
    assert _global_draw(make) == _global_draw(plain)


def test_stochastic_configurations_still_seed_from_the_global_rng() -> None:
    """The change above leaves the optimizers that draw alone: their seed is still one
    randint(0, 2^62) of the global generator (their results unchanged), and an optimizer
    that never draws takes none: in one sequence, the draws after each construction
    equal the hand-replayed global stream."""
    torch.manual_seed(0)
    seeds = [int(torch.randint(0, 2**62, (), dtype=torch.int64)) for _ in range(3)]
    after = float(torch.rand(()))
    torch.manual_seed(0)
    drawing = [
        LeanAdamW(_zeros(), state="8bit"),
        LeanAdamW(_zeros(), state="fp32"),  # never draws: no seed taken
        LeanAdamW([nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], stochastic_rounding=True),
        LeanSGD(_zeros(), state="bf16", state_rounding="stochastic"),
    ]
    assert float(torch.rand(())) == after
    for opt, seed in zip([drawing[0], *drawing[2:]], seeds, strict=True):
        want = torch.Generator().manual_seed(seed).get_state()
        assert torch.equal(opt.generator.get_state(), want)
