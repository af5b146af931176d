"""Fuzz: lowprec.amp, lowprec.scalify, lowprec.float8 (calls only), lowprec.analysis and
lowprec.recipes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from lowprec import amp, analysis, float8, recipes, scalify
from tests.fuzz._support import (
    FLOAT_DTYPES,
    FUZZ,
    Refused,
    assert_close_normwise,
    attempt,
    f64,
    finite,
    mostly,
    names_st,
    tensors,
)

NUM = mostly(
    st.floats(0.01, 1e6),
    st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e300]), names_st()),
)


@FUZZ
@given(
    arg=st.sampled_from(
        [
            "init_scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "min_scale",
            "max_scale",
        ]
    ),
    v=NUM,
    state=st.fixed_dictionaries(
        {},
        optional={
            "scale": NUM,
            "good_steps": st.integers(-2, 5),
            "history": st.just([(1.0, True)]),
        },
    ),
)
def test_loss_scalers(arg: str, v: Any, state: dict[str, Any]) -> None:
    """Any config: a scaler whose scale stays finite and > 0 through skipped and good
    steps, or a named refusal; any loaded state: applied whole or refused whole."""
    s = attempt("DynamicLossScaler", amp.DynamicLossScaler, **{arg: v}, names=(arg, "init_scale"))
    if isinstance(s, Refused):
        return
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for bad in (True, False, False):
        s.scale(model(torch.ones(1, 2)).sum()).backward()
        if bad:
            model.weight.grad.fill_(math.nan)  # type: ignore[union-attr]
        s.step(opt)
        s.update()
        opt.zero_grad()
        assert math.isfinite(s.loss_scale) and s.loss_scale > 0
    before = s.state_dict()
    r = attempt(
        "DynamicLossScaler.load_state_dict",
        s.load_state_dict,
        {**before, **state},
        names=("state",),
    )
    if isinstance(r, Refused):
        assert s.state_dict() == before, "a refused state changed the scaler"
    assert math.isfinite(s.loss_scale) and s.min_scale <= s.loss_scale <= s.max_scale


@FUZZ
@given(
    op=st.sampled_from(["softmax_fp32", "layer_norm_fp32", "cross_entropy_fp32"]),
    x=tensors(shape=(3, 4), lo=1e-6, hi=1e6),
    dim=mostly(st.just(-1), names_st()),
)
def test_amp_ops(op: str, x: torch.Tensor, dim: Any) -> None:
    """FP32 ops equal torch's in float32 (float64 reference, normwise 1e-6)."""
    t = torch.tensor([0, 3, 1])
    call = {
        "softmax_fp32": lambda: amp.softmax_fp32(x, dim),
        "layer_norm_fp32": lambda: amp.layer_norm_fp32(x, (4,)),
        "cross_entropy_fp32": lambda: amp.cross_entropy_fp32(x, t),
    }[op]
    y = attempt(f"amp.{op}", call, names=("x", "logits", "dim"))
    if isinstance(y, Refused) or not finite(x):
        return
    ref = {
        "softmax_fp32": lambda: torch.softmax(f64(x), -1),
        "layer_norm_fp32": lambda: F.layer_norm(f64(x), (4,)),
        "cross_entropy_fp32": lambda: F.cross_entropy(f64(x), t),
    }[op]()
    if finite(ref):
        tol = {torch.float16: 2**-9, torch.bfloat16: 2**-6}.get(x.dtype, 1e-5)  # output rounding
        assert_close_normwise(y, ref, tol, op)


SCALES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), tensors(shape=(), dtypes=FLOAT_DTYPES)
)


@FUZZ
@given(
    x=tensors(),
    scale=st.one_of(st.none(), SCALES),
    s2=SCALES,
    how=mostly(st.sampled_from(["max", "l1", "l2"]), names_st()),
    pow2=mostly(st.sampled_from([None, "none", "up", "down"]), names_st()),
)
def test_scalify_ops(x: torch.Tensor, scale: Any, s2: Any, how: Any, pow2: Any) -> None:
    """as_scaled / rebalance / dynamic_rescale / unscale keep the value: dequantized
    result ≈ x (FP16 storage: normwise 2^-10), never a NaN x did not hold."""
    t = attempt("scalify.as_scaled", scalify.as_scaled, x, scale, names=("x", "scale"))
    if isinstance(t, Refused):
        return

    def check(y: torch.Tensor, what: str) -> None:
        assert y.shape == x.shape
        if finite(x) and x.numel():
            assert finite(y), f"{what}: non-finite value of a finite x"
            assert_close_normwise(f64(y), f64(x), 2**-9, what)

    check(scalify.unscale(t), "as_scaled")
    r = attempt("scalify.rebalance", scalify.rebalance, t, s2, names=("s",))
    if not isinstance(r, Refused) and bool(torch.isfinite(torch.as_tensor(s2)).all()):
        if finite(x) and x.numel():  # the new scale may flush or overflow FP16: documented
            pass
    d = attempt(
        "scalify.dynamic_rescale",
        scalify.dynamic_rescale,
        t,
        how,
        pow2=pow2,
        names=("how", "pow2", "statistic"),
    )
    if not isinstance(d, Refused):
        check(scalify.unscale(d), "dynamic_rescale")


FNS = {
    "affine": lambda a: a * 3.0 + 1.0,
    "matmul": lambda a: a @ a.transpose(-1, -2) if a.dim() >= 2 else a * a,
    "sum": lambda a: a.sum(),
    "softmax": lambda a: torch.softmax(a, -1) if a.dim() else a,
    "gelu": F.gelu,
}


@FUZZ
@given(
    fn=st.sampled_from(sorted(FNS)),
    x=tensors(lo=1e-20, hi=1e20),
    fmt=mostly(st.sampled_from(["fp16", "bf16", "fp32"]), names_st()),
    policy=mostly(st.sampled_from(["static", "dynamic", "dynamic-l2"]), names_st()),
)
def test_scalify_functions(fn: str, x: torch.Tensor, fmt: Any, policy: Any) -> None:
    """scalify(f)(x) ≈ f(x) (float64 reference, normwise 2^-6 for fp16/bf16 data)."""
    g = attempt(
        "scalify.scalify",
        scalify.scalify,
        FNS[fn],
        fmt,
        policy,
        names=("data_format", "policy", "name"),
    )
    if isinstance(g, Refused):
        return
    y = attempt(f"scalify({fn})", g, x, names=("x", "args", "operand", "scale", "entry scale"))
    if isinstance(y, Refused) or not finite(x) or not x.is_floating_point():
        return
    ref = FNS[fn](f64(x))
    if finite(ref) and float(ref.abs().max() if ref.numel() else 0) < 1e30:
        assert_close_normwise(f64(y), ref, 2**-5, f"scalify({fn})")


@FUZZ
@given(
    recipe=mostly(st.sampled_from(float8.recipe_names()), names_st()),
    x=tensors(shape=(3, 32), lo=1e-3, hi=1e3),
    n=st.integers(1, 2),
)
def test_float8_linear(recipe: Any, x: torch.Tensor, n: int) -> None:
    """Float8Linear(x) ≈ F.linear(x) within FP8's rounding (elementwise bound:
    2^-2 · |x|·|W|ᵀ plus a scaled underflow term), or a named refusal."""
    torch.manual_seed(0)
    m = attempt(
        "float8.Float8Linear",
        float8.Float8Linear,
        32,
        32 * n,
        recipe=recipe,
        names=("recipe", "name", "out_features"),
    )
    if isinstance(m, Refused):
        return
    y = attempt("Float8Linear.forward", m, x, names=("x", "input", "dtype", "calibrat"))
    if isinstance(y, Refused) or not finite(x):
        return
    w, b = f64(m.weight), f64(m.bias)
    ref = f64(x) @ w.T + b
    bound = (
        0.25 * (f64(x).abs() @ w.abs().T)
        + 1e-2 * float(f64(x).abs().max()) * float(w.abs().max()) * 32
    )
    assert bool(((f64(y) - ref).abs() <= bound + 1e-6).all()), "Float8Linear error too large"


def test_float8_linear_0dim() -> None:
    """Issue 14 defect 7 (fixed in lowprec.float8 by its owner)."""
    m = float8.Float8Linear(4, 4)
    with pytest.raises(ValueError, match=r"x|input"):
        m(torch.tensor(1.0))


def test_tensor_stats_float64_beyond_float32() -> None:
    """Squares beyond float64's max: the moments are still the exact ones (the RMS of
    [1e155, -3e155, 0, 1e300] is 1e300 * sqrt(1/4), to float64 rounding)."""
    x = torch.tensor([1e155, -3e155, 0.0, 1e300], dtype=torch.float64)
    s = analysis.tensor_stats(x, ["fp16"])
    assert s["rms"] == pytest.approx(0.5e300, rel=1e-12)
    assert s["mean_abs"] == pytest.approx((4e155 + 1e300) / 4, rel=1e-12)
    assert s["amax"] == 1e300 and s["above_max"]["fp16"] == 0.75 and s["zero"] == 0.25


@FUZZ
@given(
    x=tensors(hi=1e38),
    below=st.lists(st.floats(0, 1e10), max_size=2),
    formats=mostly(st.just(["fp16", "e4m3fn"]), st.lists(names_st(), max_size=2)),
)
def test_analysis(x: torch.Tensor, below: list[float], formats: Any) -> None:
    """count_values agrees with a float64 count; tensor_stats/grad_stats give finite
    fractions in [0, 1] or name their argument."""
    c = attempt(
        "analysis.count_values", analysis.count_values, x, below=below, names=("x", "below")
    )
    if not isinstance(c, Refused):
        x64 = f64(x) if x.is_floating_point() else x.double()
        assert int(c.numel) == x.numel() if hasattr(c, "numel") else True
        nz = int((x64 == 0).sum())
        if hasattr(c, "zeros"):
            assert int(c.zeros) == nz
    s = attempt(
        "analysis.tensor_stats",
        analysis.tensor_stats,
        x,
        formats,
        names=("x", "formats", "fmt", "name"),
    )
    if not isinstance(s, Refused):
        for k, v in s.items():
            if isinstance(v, float) and ("frac" in k or "pct" in k):
                assert 0.0 <= v <= 100.0, (k, v)
    p = torch.nn.Parameter(torch.zeros(x.shape, dtype=x.dtype)) if x.is_floating_point() else None
    if p is not None:
        p.grad = x.clone()
        attempt("analysis.grad_stats", analysis.grad_stats, [p], names=("params",))


@FUZZ
@given(
    name=mostly(st.sampled_from(recipes.recipe_names()), names_st()),
    key=st.sampled_from(
        [
            "loss_scale",
            "param_dtype",
            "growth_interval",
            "master_weights",
            "calibration_batches",
            "bogus",
        ]
    ),
    v=st.one_of(NUM, names_st(), st.booleans()),
)
def test_recipes(name: Any, key: str, v: Any) -> None:
    """get_recipe by any name; to_dict/from_dict round-trips; a changed entry gives a
    recipe or a named refusal; prepare() builds a model step or refuses by name."""
    r = attempt("recipes.get_recipe", recipes.get_recipe, name, names=("name", "recipe"))
    if isinstance(r, Refused):
        return
    d = r.to_dict()
    assert recipes.Recipe.from_dict(d) == r
    pol = dict(d.get("policy", {}))
    pol[key] = v
    r2 = attempt(
        "recipes.Recipe.from_dict",
        recipes.Recipe.from_dict,
        {**d, "policy": pol},
        names=(key, "policy", "state", "recipe", "unknown"),
    )
    if isinstance(r2, Refused):
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    attempt("recipes.prepare", recipes.prepare, model, r2, names=("recipe", "model", key))
