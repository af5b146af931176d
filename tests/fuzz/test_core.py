"""Fuzz: the top-level names (formats, rounding, bits, granularity, scales, ScaledTensor,
scalers)."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lowprec
from lowprec.core import scales
from tests.fuzz._support import (
    FLOAT_DTYPES,
    FUZZ,
    Refused,
    assert_close_normwise,
    attempt,
    f64,
    mostly,
    names_st,
    tensors,
)

ML = {
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e4m3": ml_dtypes.float8_e4m3,
    "e3m4": ml_dtypes.float8_e3m4,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
}
FORMATS = [*ML, "fp32", "tf32", "e8m0", "e4m3b11fnuz"]
GRANULARITIES = [
    "tensor",
    "row",
    "column",
    "axis:0",
    "axis:-1",
    "block:1x4",
    "block:2x2",
    "mx",
    "mx:4",
    "nv:4",
    None,
]


@FUZZ
@given(
    x=tensors(),
    fmt=mostly(st.sampled_from(FORMATS), names_st()),
    saturate=st.booleans(),
    rounding=st.sampled_from(["nearest", "nearest", "stochastic", "bad"]),
)
def test_quantize(x: torch.Tensor, fmt: Any, saturate: bool, rounding: str) -> None:
    """quantize is ml_dtypes' rounding (float32 inputs within range); NaN stays NaN and
    overflow follows the documented table; bad formats/roundings/dtypes are named."""
    g = torch.Generator().manual_seed(0)
    y = attempt(
        "quantize",
        lowprec.quantize,
        x,
        fmt,
        rounding=rounding,
        saturate=saturate,
        generator=None if rounding == "nearest" else g,  # nearest refuses one (it draws none)
        names=("x", "fmt", "rounding"),
    )
    if isinstance(y, Refused):
        return
    f = lowprec.get_format(fmt)
    assert y.shape == x.shape and y.dtype == x.dtype
    nan_in = torch.isnan(x)
    assert bool(torch.isnan(y)[nan_in].all()), "documented: NaN in, NaN out"
    fin = torch.isfinite(x) & (f64(x).abs() <= f.max)
    if rounding == "nearest" and fmt in ML and x.dtype != torch.float64 and f.special != "e8m0":
        ref = torch.from_numpy(x.float().numpy().astype(ML[fmt]).astype(np.float32)).to(x.dtype)
        assert torch.equal(y[fin], ref[fin]), f"quantize({fmt}) differs from ml_dtypes"
    if saturate and fmt != "e8m0":
        over = torch.isfinite(x) & (f64(x).abs() > f.max)
        assert bool((f64(y)[over].abs() <= f.max).all()), "saturate: |y| <= fmt.max"
    if rounding == "stochastic" and fmt != "e8m0":  # |error| < one quantum
        err = (f64(y) - f64(x)).abs()[fin]
        assert bool((err <= f64(x).abs()[fin] * 2.0**-f.mantissa_bits + f.min_subnormal).all())


@FUZZ
@given(x=tensors(), fmt=mostly(st.sampled_from(FORMATS), names_st()), saturate=st.booleans())
def test_bits_round_trip(x: torch.Tensor, fmt: Any, saturate: bool) -> None:
    """from_bits(to_bits(x)) == quantize(x) (NaN as NaN)."""
    codes = attempt("to_bits", lowprec.to_bits, x, fmt, saturate=saturate, names=("x", "fmt"))
    if isinstance(codes, Refused):
        return
    back = attempt(
        "from_bits",
        lowprec.from_bits,
        codes,
        fmt,
        x.dtype if x.dtype in FLOAT_DTYPES else torch.float32,
        names=("codes", "fmt", "dtype"),
    )
    q = lowprec.quantize(x, fmt, saturate=saturate)
    assert not isinstance(back, Refused), back
    assert torch.equal(torch.isnan(back), torch.isnan(q))
    assert torch.equal(back[~torch.isnan(q)], q[~torch.isnan(q)])


@FUZZ
@given(
    name=st.one_of(names_st(), st.sampled_from(FORMATS)),
    ebits=st.integers(-2, 12),
    mbits=st.integers(-2, 60),
    bias=st.one_of(st.none(), st.integers(-5, 300)),
    special=st.sampled_from(["ieee", "fn", "fnuz", "finite", "e8m0", "bogus"]),
)
def test_formats(name: Any, ebits: int, mbits: int, bias: int | None, special: str) -> None:
    """get_format of any name/type and Format of any field values: a valid format (its
    max finite and > 0) or a named error."""
    f = attempt("get_format", lowprec.get_format, name, names=("name", "format"))
    if not isinstance(f, Refused):
        assert math.isfinite(f.max) and f.max > 0
    g = attempt(
        "Format",
        lowprec.Format,
        ebits,
        mbits,
        bias,
        special,  # type: ignore[arg-type]
        names=("exponent_bits", "mantissa_bits", "bias", "special"),
    )
    if not isinstance(g, Refused):
        assert math.isfinite(g.max) and g.max > 0 and g.min_subnormal > 0


@FUZZ
@given(
    g=mostly(st.sampled_from([x for x in GRANULARITIES if x]), names_st()),
    kind=mostly(st.sampled_from(["tensor", "axis", "block", "mx", "nv"]), names_st()),
    axis=mostly(st.integers(-4, 4), names_st()),
    block=mostly(st.tuples(st.integers(1, 64), st.integers(1, 64)), names_st()),
)
def test_granularity(g: Any, kind: Any, axis: Any, block: Any) -> None:
    r = attempt(
        "Granularity.from_name", lowprec.Granularity.from_name, g, names=("granularity", "name")
    )
    if not isinstance(r, Refused):
        assert lowprec.Granularity.from_name(r.name) == r, "name round-trips"
    attempt("Granularity", lowprec.Granularity, kind, axis, block, names=("kind", "axis", "block"))


@FUZZ
@given(
    a=tensors(dtypes=[*FLOAT_DTYPES, torch.int64, torch.bool]),
    fmt=st.sampled_from(["e4m3fn", "e5m2", "fp16", "e2m1", "bf16"]),
    margin=st.one_of(st.floats(-300, 300), st.sampled_from([math.nan, math.inf, -1e6, 0.0])),
    pow2=st.booleans(),
)
def test_scales(a: torch.Tensor, fmt: str, margin: float, pow2: bool) -> None:
    """compute_scale = clamp(amax·2^m/fmt.max, 2^-126, 2^127) in float64 (power of two
    rounded up), 1 for zero/Inf/NaN; mx_scale a power of two; all finite > 0."""
    am = a.abs() if a.dtype.is_floating_point else a
    s = attempt(
        "compute_scale",
        lowprec.compute_scale,
        am,
        fmt,
        margin=margin,
        power_of_two=pow2,
        names=("amax", "margin"),
    )
    if not isinstance(s, Refused):
        f = lowprec.get_format(fmt)
        assert s.dtype == torch.float32 and s.shape == am.shape
        assert bool((torch.isfinite(s) & (s > 0)).all())
        a64 = f64(am)
        ok = torch.isfinite(a64) & (a64 > 0)
        ref = (a64 * 2.0**margin / f.max).clamp(2.0**-126, 2.0**127)
        if pow2:
            ref = torch.exp2(torch.ceil(torch.log2(ref))).clamp(max=2.0**127)
        ref = torch.where(ok, ref, 1.0)
        good = torch.isfinite(ref)
        assert_close_normwise(
            f64(s)[good] / ref[good],
            torch.ones_like(ref[good]),
            2**-22,
            "compute_scale / reference",
        )
    m = attempt("mx_scale", scales.mx_scale, am, fmt, names=("amax",))
    if not isinstance(m, Refused):
        assert bool((torch.isfinite(m) & (m > 0)).all())
        mant, _ = torch.frexp(m)
        assert bool((mant == 0.5).all()), "mx scales are powers of two"
    x = attempt("amax", scales.amax, a, names=("x",))
    if not isinstance(x, Refused):
        ref64 = f64(a).abs().amax() if a.numel() else torch.tensor(0.0, dtype=torch.float64)
        assert torch.equal(torch.isnan(x), torch.isnan(ref64.float()))


@FUZZ
@given(
    x=tensors(),
    fmt=mostly(st.sampled_from(["e4m3fn", "e5m2", "e2m1", "fp16", "e3m2"]), names_st()),
    g=mostly(st.sampled_from(GRANULARITIES), names_st()),
    margin=mostly(st.sampled_from([0.0, 1.0, -2.0]), st.sampled_from([math.nan, 1e6])),
    pow2=st.booleans(),
)
def test_quantize_scaled(x: torch.Tensor, fmt: Any, g: Any, margin: float, pow2: bool) -> None:
    """dequantize(quantize_scaled(x)) ≈ x: each finite group's error is at most half a
    quantum of its largest element (relative 2^-(M+1)) plus the subnormal step at its
    scale, unless a negative margin saturates it on purpose; NaN/Inf entries stay
    non-finite (lowprec.core.scales.nonfinite_scale: their group's scale is 1, or NaN
    where the format or block kind cannot carry the value)."""
    q = attempt(
        "quantize_scaled",
        lowprec.quantize_scaled,
        x,
        fmt,
        granularity=g,
        margin=margin,
        power_of_two=pow2,
        names=("x", "fmt", "granularity", "margin", "name"),
    )  # fmt: name, see test_quantize_scaled_bad_fmt_names_fmt
    if isinstance(q, Refused):
        return
    f = lowprec.get_format(fmt)
    y = q.dequantize(torch.float64)
    assert y.shape == x.shape
    x64 = f64(x)
    bad = ~torch.isfinite(x64)
    finite_scale = torch.isfinite(q.scale)
    assert bool((q.scale[finite_scale] > 0).all())
    assert bool(finite_scale.all() or (bad.any() and torch.isnan(q.scale[~finite_scale]).all()))
    if not x.numel():
        return
    assert bool(torch.isnan(y[torch.isnan(x64)]).all()), "documented: NaN stays NaN"
    if f.special != "finite":  # a format without Inf/NaN saturates ±Inf (rounding table)
        assert bool((~torch.isfinite(y[bad])).all()) if bad.any() else True
    if not bad.any() and margin >= 0:  # (a negative margin saturates the largest values)
        amax = float(x64.abs().max())
        smax = float(q.scale.max())
        bound = amax * 2.0**-f.mantissa_bits * 2.0 ** max(margin, 0) + smax * f.min_subnormal
        err = float((y - x64).abs().max())
        assert err <= bound * 1.0001 + 1e-300, f"error {err:.3g} > {bound:.3g}"


def _scaler_args() -> st.SearchStrategy[dict[str, Any]]:
    num = mostly(st.floats(-10, 10), st.one_of(st.sampled_from([math.nan, math.inf]), names_st()))
    return st.fixed_dictionaries(
        {
            "fmt": mostly(st.sampled_from(["e4m3fn", "e5m2"]), names_st()),
            "granularity": mostly(st.sampled_from(["tensor", "row"]), names_st()),
            "margin": num,
        }
    )


@FUZZ
@given(
    kind=st.sampled_from(["dynamic", "delayed", "static"]),
    kw=_scaler_args(),
    extra=st.one_of(st.integers(-2, 20), st.floats(allow_nan=True), st.none()),
    xs=st.lists(tensors(shape=(3, 4), dtypes=FLOAT_DTYPES), min_size=1, max_size=3),
)
def test_scalers(kind: str, kw: dict[str, Any], extra: Any, xs: list[torch.Tensor]) -> None:
    """Every scaler's scale is finite and > 0 after any sequence of updates (Inf/NaN
    amaxes are not recorded), or its constructor names the bad argument."""
    cls = {
        "dynamic": lowprec.DynamicScaler,
        "delayed": lowprec.DelayedScaler,
        "static": lowprec.StaticScaler,
    }[kind]
    if kind == "delayed":
        kw["history_len"] = extra
    elif kind == "static":
        kw["scale"] = extra
    s = attempt(
        f"{cls.__name__}",
        cls,
        **kw,
        names=("fmt", "name", "granularity", "margin", "history_len", "scale"),
    )
    if isinstance(s, Refused):
        return
    for x in xs:
        q = attempt(
            "quantize_scaled(scaler=)",
            lowprec.quantize_scaled,
            x,
            kw["fmt"],
            granularity=kw["granularity"],
            scaler=s,
            names=("x", "scale", "scaler"),
        )
        if not isinstance(q, Refused):
            assert bool(torch.isfinite(q.scale).all() and (q.scale > 0).all()), q.scale


@FUZZ
@given(
    data=tensors(),
    scale=st.one_of(st.floats(allow_nan=True, allow_infinity=True), tensors(dtypes=FLOAT_DTYPES)),
    dtype=st.sampled_from([None, torch.float32, torch.int64, torch.float16]),
    fmt=st.one_of(st.none(), st.sampled_from(["e4m3fn"]), names_st()),
)
def test_scaled_tensor(data: torch.Tensor, scale: Any, dtype: Any, fmt: Any) -> None:
    """ScaledTensor(data, scale) dequantizes to data·scale (block-broadcast), or names
    data/scale/dtype/fmt."""
    t = attempt(
        "ScaledTensor",
        lowprec.ScaledTensor,
        data,
        scale,
        dtype,
        fmt,
        names=("data", "scale", "dtype", "fmt", "name"),
    )
    if isinstance(t, Refused):
        return
    y = t.dequantize(torch.float64)
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale)
    assert bool((torch.isfinite(s) & (s > 0)).all()), "a non-finite/<=0 scale was accepted"
    if s.numel() == 1:
        ref = f64(data) * float(s)
        same = torch.isfinite(ref)
        assert torch.allclose(y[same], ref[same], rtol=1e-12, atol=0)
    c = t.clone()
    assert torch.equal(torch.isnan(c.dequantize()), torch.isnan(t.dequantize()))


def test_scaled_tensor_clone_channels_last() -> None:
    """Issue 14 defect 7 (fixed in core/tensor.py by its owner)."""
    t = lowprec.quantize_scaled(torch.randn(2, 3, 4, 5), "e4m3fn")
    c = attempt(
        "ScaledTensor.clone", t.clone, memory_format=torch.channels_last, names=("memory_format",)
    )
    assert not isinstance(c, Refused) and torch.equal(c.dequantize(), t.dequantize())


def test_load_state_dict_with_scaled_tensor_buffer() -> None:
    """Issue 14 defect 7 (fixed in core/tensor.py by its owner)."""
    m = torch.nn.Module()
    m.register_buffer("b", lowprec.quantize_scaled(torch.ones(4), "e4m3fn"))
    m.load_state_dict({"b": lowprec.quantize_scaled(torch.full((4,), 2.0), "e4m3fn")})
    assert torch.equal(m.b.dequantize(), torch.full((4,), 2.0))


def test_quantize_scaled_bad_fmt_names_fmt() -> None:
    with pytest.raises(TypeError, match=r"^fmt"):
        lowprec.quantize_scaled(torch.ones(2), None)  # type: ignore[arg-type]
