"""Tests of lowprec.scalify: rules (value and output scale), scalify, ops, errors.

Tolerances: a rule computes in float32 from FP16 data and rounds its output data to FP16
once, so an output is within FP16's relative rounding (2^-11 ≈ 4.9e-4) of the fp64 value
of the same inputs: we allow 1e-3 (norm-wise, twice that bound). Whole models chain ~100
ops, each adding one such rounding: 5e-3.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from lowprec.core.tensor import ScaledTensor
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.scalify import (
    ScalifyConfig,
    apply,
    config,
    coverage,
    dynamic_rescale,
    rebalance,
    reset_coverage,
    scaled,
    scalify,
    unscale,
)
from lowprec.scalify.config import set_config

FP16_TOL = 1e-3  # 2x FP16's unit roundoff 2^-11 (one rounding of the output data)


@pytest.fixture(autouse=True)
def _fp16_config() -> None:
    set_config(ScalifyConfig())


def st(shape: tuple[int, ...], scale: float | torch.Tensor, seed: int = 0) -> ScaledTensor:
    g = torch.Generator().manual_seed(seed)
    return scaled(torch.randn(shape, generator=g).half(), scale)


def val(x: torch.Tensor) -> torch.Tensor:
    """fp64 value ``d·s`` of a ScaledTensor (or a plain tensor)."""
    if isinstance(x, ScaledTensor):
        return x.dequantize(torch.float64)
    return x.double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((val(a) - val(b)).norm() / val(b).norm().clamp_min(1e-300)).detach())


A, B = st((8, 16), 2.0, 1), st((8, 16), 4.0, 2)
K16 = math.sqrt(16)
# (name, op, inputs, expected output scale)
CASES: list[tuple[str, Callable[..., torch.Tensor], tuple[ScaledTensor, ...], float]] = [
    ("add", torch.add, (A, B), 4.0),
    ("sub", torch.sub, (A, B), 4.0),
    ("mul", torch.mul, (A, B), 8.0),
    ("div", lambda a, b: a / (b.abs() + b.abs().amax()), (A, B), 0.5),
    ("mul_scalar", lambda a: a * 3.0, (A,), 6.0),
    ("div_scalar", lambda a: a / 4.0, (A,), 0.5),
    ("neg", torch.neg, (A,), 2.0),
    ("abs", torch.abs, (A,), 2.0),
    ("relu", torch.relu, (A,), 2.0),
    ("gelu", F.gelu, (A,), 2.0),
    ("silu", F.silu, (A,), 2.0),
    ("maximum", torch.maximum, (A, B), 4.0),
    ("minimum", torch.minimum, (A, B), 4.0),
    # exp's values reach ~e^7 here: the range guard moves 2^⌊log2 max⌋ into the scale
    ("exp", torch.exp, (A,), 2.0 ** math.floor(math.log2(float(val(A).exp().max())))),
    ("log", lambda a: torch.log(a.abs()), (A,), 1.0),
    ("softmax", lambda a: torch.softmax(a, -1), (A,), 1.0),
    ("log_softmax", lambda a: torch.log_softmax(a, -1), (A,), 1.0),
    ("sum", lambda a: a.sum(-1), (A,), 2.0 * 4.0),
    ("mean", lambda a: a.mean(0), (A,), 2.0),
    ("amax", lambda a: a.amax(-1), (A,), 2.0),
    ("mm", lambda a, b: a @ b.T, (A, B), 2.0 * 4.0 * K16),
    ("bmm", lambda a, b: a.view(2, 4, 16) @ b.view(2, 4, 16).transpose(1, 2), (A, B), 8 * K16),
    ("addmm", lambda a, b: torch.addmm(b[0, :8], a, b.t()[:, :8]), (A, B), 8 * K16),
    ("layer_norm", lambda a, b: F.layer_norm(a, (16,), b[0], b[1]), (A, B), 4.0),
    ("rms_norm", lambda a: F.rms_norm(a, (16,)), (A,), 2.0 / 2.0),
    ("view", lambda a: a.view(4, 32), (A,), 2.0),
    ("reshape_t", lambda a: a.t().reshape(-1), (A,), 2.0),
    ("permute", lambda a: a.view(2, 4, 16).permute(2, 0, 1), (A,), 2.0),
    ("cat", lambda a, b: torch.cat([a, b], 0), (A, B), 4.0),
    ("split", lambda a: a.split(4, dim=1)[2], (A,), 2.0),
    ("slice_select", lambda a: a[1:5, 3], (A,), 2.0),
    ("index", lambda a: a[torch.tensor([0, 3, 3])], (A,), 2.0),
    ("embedding", lambda a: F.embedding(torch.tensor([[1, 7], [0, 1]]), a), (A,), 2.0),
    ("where", lambda a, b: torch.where(a > 0, a, b), (A, B), 4.0),
    ("masked_fill", lambda a: a.masked_fill(a < 0, -5.0), (A,), 2.0),
    ("expand", lambda a: a[:, None].expand(8, 3, 16), (A,), 2.0),
]


@pytest.mark.parametrize("name,op,inputs,scale", CASES, ids=[c[0] for c in CASES])
def test_rule_value_and_scale(
    name: str, op: Callable[..., torch.Tensor], inputs: tuple[ScaledTensor, ...], scale: float
) -> None:
    reset_coverage()
    out = op(*inputs)
    ref = op(*(val(x) for x in inputs))
    assert isinstance(out, ScaledTensor) and out.domain == "scalify"
    assert coverage().fallbacks == {}, f"{name} fell back"
    assert rel(out, ref) < FP16_TOL
    assert out.scale.numel() == 1 and float(out.scale) == pytest.approx(scale, rel=1e-6)


def test_unit_add_rule_and_pow2_modes() -> None:
    with config(add_rule="unit"):
        assert float((A + B).scale) == pytest.approx(math.sqrt(2.0**2 + 4.0**2))
    for mode, s, d in (("none", 6.0, 1.0), ("up", 8.0, 0.75), ("down", 4.0, 1.5)):
        with config(pow2=mode):  # type: ignore[arg-type]
            y = A * 3.0
        assert float(y.scale) == s
        assert torch.equal(y.qdata, (A.qdata.float() * d).half())  # exact: d is k/2^n


def test_numbers_bring_their_own_scale() -> None:
    tiny = st((4, 4), 2.0**-40)
    y = tiny + 1e-5  # max(2^-40, 1e-5): both terms survive FP16 (scale 1 would flush x)
    assert float(y.scale) == pytest.approx(1e-5)
    assert rel(y, val(tiny) + 1e-5) < FP16_TOL
    w = torch.where(tiny.abs() > 0, tiny, 0.0)
    assert float(w.scale) == 2.0**-40 and rel(w, val(tiny)) < FP16_TOL
    assert (tiny + 0.0) is tiny


def test_where_with_a_number_keeps_the_data() -> None:
    """``where`` of a scaled ``x`` and a number: HF's attention masks fill with
    ``finfo(float32).min`` (T5's position-bias mask); taking the number's magnitude as the
    scale flushed every kept value to 0 (logits 26% off FP32). A sentinel saturates and the
    kept values stay within FP16 rounding; a moderate fill that the format cannot hold next
    to ``x`` raises the scale just enough, so both are right (either operand order). The
    sentinel's scale is at least 1, so it saturates to -65504 as in a plain FP16 model and
    still masks (kept at ``x``'s scale it was -65504·s_x: no mask at small scales)."""
    x = st((8, 16), 0.05)
    m = torch.rand(8, 16, generator=torch.Generator().manual_seed(3)) > 0.3
    lo = torch.finfo(torch.float32).min
    for y, keep in ((torch.where(m, x, lo), m), (torch.where(~m, lo, x), m)):
        assert isinstance(y, ScaledTensor) and float(y.scale) == pytest.approx(1.0)
        assert rel(val(y)[keep], val(x)[keep]) < FP16_TOL
        assert bool((val(y)[~keep] <= -65504 * 0.999).all())  # saturated, not lost
    tiny = st((8, 16), 2.0**-30)
    z = torch.where(m, tiny, 1.0)  # 1 / 2^-30 is beyond FP16: the scale rises to 1/65504
    assert float(z.scale) == pytest.approx(1.0 / 65504.0)
    assert rel(val(z), torch.where(m, val(tiny), 1.0)) < FP16_TOL


@pytest.mark.parametrize("fill", [-1e4, torch.finfo(torch.float32).min])
@pytest.mark.parametrize("scale", [2.0**-2, 2.0**-8, 2.0**-12])
def test_a_masked_fill_mask_masks_at_every_scale(fill: float, scale: float) -> None:
    """``softmax(qk.masked_fill(causal, fill))`` of small logits: no weight on masked keys
    (FP32: exactly 0). A fill the format could not hold next to the logits' scale was
    clipped to ±max·s_x (-1e4 at 2^-12 left 16% of a row's weight on future keys); it now
    raises the scale as ``where`` does, a sentinel to at least 1. The unmasked weights
    equal FP32's within FP16 rounding; a moderate fill keeps its value (2.5 at 2^-20)."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(6, 8, generator=g) * scale, torch.randn(6, 8, generator=g) * scale
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)

    def probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q @ k.t()).masked_fill(causal, fill).softmax(-1)

    want, got = probs(q, k), scalify(probs, "fp16")(q, k)
    assert float(got.float()[causal].abs().max()) == 0.0
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-3)
    x = torch.randn(3, 4, generator=g) * 2.0**-20
    m = torch.rand(3, 4, generator=g) > 0.5
    y = scalify(lambda t: t.masked_fill(m, 2.5), "fp16")(x).float()
    assert bool((y[m] == 2.5).all()) and rel(y[~m], x[~m]) < FP16_TOL


def test_special_scales_short_circuit() -> None:
    z = A * 0.0
    assert float(z.scale) == 0.0 and not z.qdata.any()
    assert (B + z) is B  # adding a known zero returns the other operand
    assert float((z * B).scale) == 0.0
    one = scaled(torch.ones(3).half(), 1.0)
    assert val(one.exp()).tolist() == pytest.approx([math.e] * 3, rel=FP16_TOL)


def test_backward_rules_values_and_scales() -> None:
    x = val(st((6, 10), 0.25, 3)).float().requires_grad_()
    g_plain = torch.randn(6, 10, generator=torch.Generator().manual_seed(4))
    g = scaled(g_plain.half(), 2.0**-20)
    for name, fn, expect_scale in (
        ("softmax", lambda t: torch.softmax(t, -1), 2.0**-20),
        ("log_softmax", lambda t: torch.log_softmax(t, -1), 2.0**-20),
        ("gelu", F.gelu, 2.0**-20),
        ("layer_norm", lambda t: F.layer_norm(t, (10,)), 2.0**-20),
    ):
        y = fn(x)
        (ref,) = torch.autograd.grad(y, x, g.dequantize(torch.float32))
        xs = scaled(x.detach().half(), 1.0).requires_grad_()
        (got,) = torch.autograd.grad(fn(xs), xs, g)
        assert isinstance(got, ScaledTensor), name
        assert float(got.scale) == pytest.approx(expect_scale), name
        assert rel(got, ref) < 2 * FP16_TOL, name  # x rounded to FP16 too: two roundings


def test_dropout_values_and_coverage() -> None:
    x = st((64, 64), 0.5).requires_grad_()
    reset_coverage()
    y = F.dropout(x, p=0.25, training=True)
    kept = val(y) != 0
    # kept values are x/(1-p), within FP16 rounding (1/0.75 is not a power of two)
    assert rel(val(y)[kept], val(x)[kept] / 0.75) < FP16_TOL
    assert 0.6 < float(kept.double().mean()) < 0.9  # keep rate 0.75, 4096 draws: ±0.03 (5σ)
    (g,) = torch.autograd.grad(y, x, scaled(torch.ones(64, 64).half(), 2.0))
    want = torch.full((int(kept.sum()),), 2.0 / 0.75, dtype=torch.float64)
    assert torch.equal(val(g) != 0, kept) and rel(val(g)[kept], want) < FP16_TOL
    assert coverage().fallbacks == {}


def test_nll_backward_moves_the_mean_into_the_scale() -> None:
    logits = scaled(torch.randn(64, 5).half(), 1.0).requires_grad_()
    target = torch.randint(0, 5, (64,))
    loss = F.nll_loss(logits, target)
    (g,) = torch.autograd.grad(loss, logits, scaled(torch.ones(()), 1.0))
    assert float(g.scale) == pytest.approx(1 / 64)  # the 1/N of the mean
    assert set(g.qdata.unique().tolist()) == {-1.0, 0.0}


# ---- scalify ----------------------------------------------------------------------------------


def small_gpt() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(ModelConfig(vocab_size=20, width=32, depth=2, heads=2, seq_len=16))


def test_scalify_chargpt_matches_plain_autograd() -> None:
    m = small_gpt()
    idx = torch.randint(0, 20, (4, 16), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, 20, (4, 16), generator=torch.Generator().manual_seed(2))
    _, loss_ref = m(idx, tgt)
    assert loss_ref is not None
    loss_ref.backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    reset_coverage()
    s = scalify(m, data_format="fp16")
    logits, loss = s(idx, tgt)
    assert type(logits) is torch.Tensor and type(loss) is torch.Tensor
    assert loss.dtype == torch.float32
    assert float(loss.detach()) == pytest.approx(
        float(loss_ref.detach()), rel=1e-3
    )  # the true loss
    loss.backward()
    assert coverage().fallbacks == {}
    for n, p in m.named_parameters():
        assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32, n
        err = float((p.grad - ref[n]).norm() / ref[n].norm())
        assert err < 5 * FP16_TOL, (n, err)  # ~100 FP16 roundings chained
    assert list(s.state_dict()) == list(m.state_dict())  # the wrapped model's keys


def test_bf16_data_format() -> None:
    m = small_gpt()
    idx = torch.randint(0, 20, (4, 16), generator=torch.Generator().manual_seed(1))
    _, ref = m(idx, idx)
    s = scalify(m, data_format="bf16")
    _, loss = s(idx, idx)
    assert ref is not None
    # BF16's unit roundoff is 2^-8 (3.9e-3): the loss agrees within ~2 roundings
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-2)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())


@pytest.mark.parametrize("exp", [-40, 40])
def test_extreme_input_scales_stay_finite_and_correct(exp: int) -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for lin in (mlp[0], mlp[2]):
        torch.nn.init.zeros_(lin.bias)  # biases would dominate tiny inputs: keep it scale-free
    x = torch.randn(8, 16) * 2.0**exp
    ref = mlp.double()(x.double())
    mlp.float()
    plain16 = x.half()
    assert plain16.isinf().all() if exp > 0 else (plain16 == 0).all()  # FP16 fails here
    x.requires_grad_()
    y = scalify(mlp, "fp16")(x)
    assert torch.isfinite(y).all() and rel(y, ref) < 5 * FP16_TOL
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_coverage_names_fallbacks(caplog: pytest.LogCaptureFixture) -> None:
    reset_coverage()
    x = st((4, 4), 0.5)
    with caplog.at_level(logging.WARNING, logger="lowprec.scalify"):
        y = torch.cumsum(x, 0)
        torch.cumsum(x, 1)
    assert coverage().fallbacks == {"aten.cumsum.default": 2}
    assert float(y.scale) == 1.0 and rel(y, torch.cumsum(val(x), 0)) < FP16_TOL
    warned = [r for r in caplog.records if "aten.cumsum.default" in r.getMessage()]
    assert len(warned) <= 1 and "aten.cumsum.default" in str(coverage())


def test_per_row_and_per_block_scales() -> None:
    g = torch.Generator().manual_seed(5)
    sa = torch.exp2(torch.randint(-30, 30, (8, 1), generator=g).float())  # per row
    sb = torch.exp2(torch.randint(-30, 30, (1, 6), generator=g).float())  # per column
    a = scaled(torch.randn(8, 16, generator=g).half(), sa)
    b = scaled(torch.randn(16, 6, generator=g).half(), sb)
    y = a @ b
    assert torch.equal(y.scale, sa * sb * 4.0)  # s_a ⊗ s_b · √K: no data pass needed
    assert rel(y, val(a) @ val(b)) < FP16_TOL
    blk = torch.exp2(torch.randint(-20, 20, (2, 4), generator=g).float())  # 4x4 blocks
    c = scaled(torch.randn(8, 16, generator=g).half(), blk)
    cases = [("add", lambda t: t + a), ("mul", lambda t: t * a), ("gelu", F.gelu),
             ("t", lambda t: t.t()), ("mm_blockK", lambda t: t @ b), ("sum", lambda t: t.sum(0)),
             ("softmax", lambda t: t.softmax(-1)), ("slice", lambda t: t[2:6, 4:]),
             ("view", lambda t: t.view(2, 64))]  # fmt: skip
    for name, fn in cases:
        reset_coverage()
        out = fn(c)
        ref = fn(val(c)) if name not in ("add", "mul", "mm_blockK") else (
            {"add": lambda: val(c) + val(a), "mul": lambda: val(c) * val(a),
             "mm_blockK": lambda: val(c) @ val(b)}[name]())  # fmt: skip
        assert coverage().fallbacks == {}, name
        assert rel(out, ref) < FP16_TOL, name
    assert tuple(c.t().scale.shape) == (4, 2)  # a block scale transposes with the data


def test_rebalance_and_dynamic_rescale() -> None:
    x = scaled(torch.tensor([3.0, -6.0, 0.5]).half(), 2.0**-30).requires_grad_()
    r = rebalance(x, 2.0**-28)
    assert float(r.scale) == 2.0**-28 and torch.equal(val(r), val(x))  # exact: powers of two
    for how, want in (("max", 6.0), ("l1", 9.5 / 3), ("l2", math.sqrt(45.25 / 3))):
        y = dynamic_rescale(x, how)  # type: ignore[arg-type]
        assert float(y.scale) == pytest.approx(2.0**-30 * want, rel=1e-6)
        assert rel(y, val(x)) < FP16_TOL
    y = dynamic_rescale(x, "max", pow2="up")
    assert float(y.scale) == 2.0**-27 and float(y.qdata.abs().max()) <= 1.0
    (g,) = torch.autograd.grad(unscale(y).sum(), x)
    assert val(g).tolist() == [1.0, 1.0, 1.0]


def test_dynamic_policy_matches_static() -> None:
    m = small_gpt()
    idx = torch.randint(0, 20, (2, 16))
    _, a = scalify(m, "fp16", policy="static")(idx, idx)
    _, b = scalify(m, "fp16", policy="dynamic")(idx, idx)
    assert float(a.detach()) == pytest.approx(
        float(b.detach()), rel=2e-3
    )  # different roundings, same maths


def test_apply_fp8_and_bad_format() -> None:
    m = small_gpt()
    idx = torch.randint(0, 20, (4, 16), generator=torch.Generator().manual_seed(3))
    _, ref = m(idx, idx)
    _, loss = apply(m, "fp8")(idx, idx)
    assert ref is not None
    # FP8 E4M3 has 3 mantissa bits (unit roundoff 2^-4): the loss moves by a few percent at most
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=0.05)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    with pytest.raises(ValueError, match="unknown scalify preset 'fp4'"):
        apply(m, "fp4")


def test_fp8_matmul_rounds_operands_to_fp8_grids() -> None:
    from lowprec.core.scales import compute_scale
    from lowprec.scalify.rules import _fp8

    d = torch.randn(64, 32)
    for grad, dt in ((False, torch.float8_e4m3fn), (True, torch.float8_e5m2)):
        q, s = _fp8(d, torch.ones(()), grad)
        r = compute_scale(d.abs().amax(), "e5m2" if grad else "e4m3fn", power_of_two=True)
        assert torch.equal(q / r, (q / r).to(dt).float()) and float(s) == 1.0  # on the grid
        assert torch.equal(q, (d / r).to(dt).float() * r)  # torch's own rounding, exactly
        eps = 2.0**-3 if grad else 2.0**-4  # unit roundoff of E5M2 / E4M3
        assert float(((q - d).abs() / d.abs().clamp_min(1e-2)).max()) <= eps * 1.01


# ---- bad input ----------------------------------------------------------------------------


def test_incompatible_device_or_dtype_raises() -> None:
    x = st((4, 4), 1.0)
    with pytest.raises(ValueError, match="different devices"):
        x + torch.ones(4, 4, device="meta")
    y = scaled(torch.ones(4, 4, dtype=torch.float16), 1.0).to(torch.float64)
    with pytest.raises(ValueError, match="logical dtypes"):
        x * y


def test_nan_scale_caught_where_created() -> None:
    with pytest.raises(ValueError, match="scale must be finite"):
        scaled(torch.ones(2).half(), float("nan"))
    with pytest.raises(ValueError, match=r"^s must be finite"):
        rebalance(st((2,), 1.0), float("nan"))
    big = st((4, 4), 2.0**100)
    with pytest.raises(ValueError, match=r"aten\.mul\.Tensor created a non-finite"):
        big * big  # 2^200 overflows float32: caught at this op, not later
    with pytest.raises(ValueError, match="statistic of x's data is nan"):
        dynamic_rescale(scaled(torch.tensor([1.0, float("nan")]).half(), 1.0))
    with pytest.raises(ValueError, match="entry scale"):
        scalify(torch.nn.Linear(2, 2))(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="unknown scalify policy"):
        scalify(torch.nn.Linear(2, 2), policy="loose")


def test_float8_tensors_keep_their_rules() -> None:
    from lowprec.core.tensor import quantize_scaled

    q = quantize_scaled(torch.randn(4, 4), "e4m3fn")  # no domain: scalify rules do not apply
    with pytest.raises(NotImplementedError, match=r"aten\.add\.Tensor"):
        q + q


@pytest.mark.slow
def test_torch_compile_scalified_module() -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)
    s = scalify(mlp, "fp16")
    y_eager = s(x)
    y_eager.sum().backward()
    g_eager = [p.grad.clone() for p in mlp.parameters() if p.grad is not None]
    mlp.zero_grad()
    import torch._inductor.config as inductor_config

    # Inductor keeps fused FP16 round trips in FP32 unless told to emulate the casts.
    with inductor_config.patch(emulate_precision_casts=True):
        y = torch.compile(s)(x)
        y.sum().backward()  # the backward graph compiles here
    # Same rules traced, same roundings: equal up to float32 reassociation (1e-6).
    assert torch.allclose(y, y_eager, rtol=1e-5, atol=1e-6)
    for p, g in zip(mlp.parameters(), g_eager, strict=True):
        assert p.grad is not None and torch.allclose(p.grad, g, rtol=1e-5, atol=1e-6)


def test_config_validation_and_presets() -> None:
    with pytest.raises(
        ValueError, match=r"unknown scalify preset 'fp7'; valid: fp16, bf16, fp8, fp16-dynamic, "
    ):
        ScalifyConfig.from_name("fp7")
    with pytest.raises(ValueError, match="pow2 must be one of"):
        ScalifyConfig(pow2="nearest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data_format must be one of"):
        ScalifyConfig(data_format="fp4")
    assert ScalifyConfig.from_name("fp8").storage_dtype == torch.float16  # FP8 only in GEMMs
    with config(rescale="max", pow2="up"):
        y = F.gelu(st((16, 16), 2.0**-30)) * 1000.0
    # the automatic rescale puts each output's max |data| in (1/2, 1]: power of two up
    assert 0.5 < float(y.qdata.abs().max()) <= 1.0
    assert rel(y, F.gelu(val(st((16, 16), 2.0**-30))) * 1000.0) < FP16_TOL


def test_apply_entry_point_and_presets_round_trip() -> None:
    from dataclasses import asdict

    from lowprec.scalify.config import PRESETS

    m = small_gpt()
    idx = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(4))
    _, a = apply(m, "fp8")(idx, idx)
    _, b = scalify(m, "fp8")(idx, idx)
    assert torch.equal(a, b)  # the same config, the same rules: bit for bit
    assert apply(m, ScalifyConfig(pow2="up")).config.pow2 == "up"
    for name in PRESETS:
        cfg = ScalifyConfig.from_name(name)
        assert ScalifyConfig(**asdict(cfg)) == cfg, name
    assert ScalifyConfig.from_name("fp16-dynamic", rescale="l1").rescale == "l1"
    with pytest.raises(ValueError, match="unknown scalify preset 'fp4'; valid: fp16, "):
        apply(m, "fp4")
    with pytest.raises(TypeError, match="config must be a ScalifyConfig or a preset name"):
        apply(m, 16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be an nn\.Module or a callable"):
        apply(3, "fp16")  # type: ignore[call-overload]
    # A function of tensors: the same entry point (scalify's alias gives the same bits).
    f = apply(lambda a, b: (a @ b).sum(), "fp16")
    a1, b1 = torch.randn(3, 4) * 2.0**30, torch.randn(4, 2)
    assert torch.equal(f(a1, b1), scalify(lambda a, b: (a @ b).sum(), "fp16")(a1, b1))
    assert float(f(a1, b1)) == pytest.approx(float((a1 @ b1).sum()), rel=1e-2)
    # A passed config is never silently overridden by another keyword.
    cfg = ScalifyConfig(data_format="bf16")
    assert scalify(m, policy=cfg).config is cfg and scalify(m, "bf16", cfg).config is cfg
    with pytest.raises(ValueError, match="data_format='fp16' conflicts with the config's"):
        scalify(m, "fp16", cfg)
    with pytest.raises(ValueError, match="unknown scalify policy 'loose'; valid: static, dyn"):
        scalify(m, policy="loose")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_class_weights_given_as_an_argument(reduction: str) -> None:
    """``F.cross_entropy(logits, t, weight=w)`` with ``w`` an argument of the scalified
    function (so a ScaledTensor) crashed (``'Tensor' object has no attribute 'scale'``);
    the weights are read as their values. Loss and the logits' gradient equal FP32 within
    FP16 rounding (a few roundings of the 8 log-probabilities: 4e-3)."""
    g = torch.Generator().manual_seed(6)
    t = torch.tensor([1, 2, 3, 0, 7, 7])
    w = torch.rand(8, generator=g) + 0.5

    def loss(logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, t, weight=w, reduction=reduction)

    x = torch.randn(6, 8, generator=g)
    xr, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want, got = loss(xr, w), scalify(loss, "fp16")(xs, w)
    torch.testing.assert_close(got.float(), want, rtol=4e-3, atol=0)
    want.backward()
    got.backward()
    assert xs.grad is not None and xr.grad is not None
    torch.testing.assert_close(xs.grad, xr.grad, rtol=4e-3, atol=4e-3 * float(xr.grad.abs().max()))


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**-8, 1.0, 2.0**6])
def test_a_plain_operand_of_add_counts_at_its_own_scale(scale: float) -> None:
    """A plain tensor added to a ScaledTensor (a ``zeros_like`` accumulator, small plain
    values, a 0/-inf mask) counted at scale 1: at ``s_x = 2^-20`` the sum's data were FP16
    subnormals (0.77% off, 4 bits left). It now has its own scale (at most 1), so each sum
    equals FP32's within one FP16 rounding at every scale; a mask's -inf stays -inf and a
    -1e4 mask still sets the scale to 1 (the data of -1e4 fit FP16 there)."""
    x = st((8, 16), scale, 3)
    xv = val(x)
    small = torch.randn(8, 16, generator=torch.Generator().manual_seed(4)) * scale / 4
    m = xv > 0
    mask = torch.where(m, 0.0, float("-inf"))
    cases: list[tuple[torch.Tensor, torch.Tensor]] = [
        (torch.zeros_like(x) + x, xv),
        (x + torch.zeros(8, 16), xv),
        (x - small, xv - small.double()),
        (torch.where(m, x, torch.zeros(8, 16)), torch.where(m, xv, 0.0)),
    ]
    for got, want in cases:
        assert isinstance(got, ScaledTensor)
        assert rel(got, want) < FP16_TOL, (scale, rel(got, want))
    masked = x + mask
    assert bool(torch.isneginf(val(masked)[~m]).all())
    assert rel(val(masked)[m], xv[m]) < FP16_TOL
    big = x + torch.where(m, 0.0, -1e4)
    assert float(big.scale) == max(1.0, scale)
    assert bool((val(big)[~m] < -9e3).all())


@pytest.mark.parametrize("op", ["add_", "sub_", "mul_", "div_"])
def test_a_plain_tensor_updated_in_place_with_a_scaled_operand(op: str) -> None:
    """``out = torch.zeros_like(x); out += y``, ``y`` a ScaledTensor: ``out`` stays a plain
    tensor and takes the values (it kept its old ones, silently: the result was written
    to an attribute of the plain tensor). Values within one FP16 rounding of FP32, and the
    gradient reaches ``y``'s source through the in-place op (d out/d y: 1, -1, b, 1/b)."""
    # src in [0.5, 1.5): a divisor away from 0 (the division's gradient is not what is tested)
    src = (torch.rand(8, 16, generator=torch.Generator().manual_seed(6)) + 0.5).requires_grad_()
    b = torch.rand(8, 16, generator=torch.Generator().manual_seed(7)) + 0.5

    def f(t: torch.Tensor) -> torch.Tensor:
        out = b.clone()
        getattr(out, op)(t * 2.0**-10)
        return out

    got = scalify(f, "fp16")(src)
    want_src = src.detach().clone().requires_grad_()
    want = f(want_src)
    assert not isinstance(got, ScaledTensor)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    got.sum().backward()
    want.sum().backward()
    assert src.grad is not None and want_src.grad is not None
    torch.testing.assert_close(src.grad, want_src.grad, rtol=2e-3, atol=0)
