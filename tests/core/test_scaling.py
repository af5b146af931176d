"""Tests for lowprec.core.granularity, scales and scalers: granularities, amax -> scale,
MX scales, stateful scalers."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from lowprec.core.formats import get_format
from lowprec.core.granularity import Granularity, apply_scale, pad_to_blocks
from lowprec.core.scalers import DelayedScaler, DynamicScaler, StaticScaler
from lowprec.core.scales import _div_const, amax, compute_scale, mx_scale, round_pow2

# ---- granularity -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("tensor", (4, 256), ()),
        ("row", (4, 256), (4, 1)),
        ("column", (4, 256), (1, 256)),
        ("axis:0", (3, 4, 256), (1, 4, 256)),
        ("block:1x128", (4, 256), (4, 2)),
        ("128x128", (256, 384), (2, 3)),
        ("block:1x128", (2, 4, 256), (2, 4, 2)),
        ("mx", (4, 256), (4, 8)),
        ("mx:16", (4, 64), (4, 4)),
    ],
)
def test_scale_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    assert Granularity.from_name(name).scale_shape(shape) == expected


@pytest.mark.parametrize("name", ["rows", "block:1x", "mx:", "blockwise", ""])
def test_unknown_granularity_lists_valid_names(name: str) -> None:
    with pytest.raises(ValueError, match=r"granularity: unknown name.*'tensor'.*'row'"):
        Granularity.from_name(name)


@pytest.mark.parametrize(
    ("name", "shape"),
    [("block:1x128", (4, 200)), ("block:128x128", (100, 128)), ("mx", (4, 33)), ("row", ())],
)
def test_blocks_that_do_not_divide_are_refused(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="x:"):
        Granularity.from_name(name).scale_shape(shape)


def test_bad_block_and_axis() -> None:
    with pytest.raises(ValueError, match="block"):
        Granularity("block", block=(0, 128))
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        Granularity.along(2).scale_shape((4, 4))
    with pytest.raises(TypeError, match="axis"):
        Granularity("axis", axis=1.0)  # type: ignore[arg-type]


# ---- amax --------------------------------------------------------------------------------


def _np_block_amax(x: np.ndarray, r: int, c: int) -> np.ndarray:
    """Independent block amax: explicit loops over blocks."""
    rows, cols = x.shape
    out = np.zeros((rows // r, cols // c))
    for i in range(rows // r):
        for j in range(cols // c):
            out[i, j] = np.abs(x[i * r : (i + 1) * r, j * c : (j + 1) * c]).max()
    return out


def test_amax_matches_direct_computation() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 384, generator=g) * torch.logspace(-3, 3, 384)
    xn = x.double().numpy()
    # Exact: amax selects an element, no arithmetic.
    assert amax(x).item() == np.abs(xn).max()
    assert np.array_equal(amax(x, "row").numpy()[:, 0], np.abs(xn).max(axis=1))
    assert np.array_equal(amax(x, "column").numpy()[0], np.abs(xn).max(axis=0))
    assert np.array_equal(amax(x, "block:1x128").numpy(), _np_block_amax(xn, 1, 128))
    assert np.array_equal(amax(x, "block:128x128").numpy(), _np_block_amax(xn, 128, 128))
    assert np.array_equal(amax(x, "block:4x3").numpy(), _np_block_amax(xn, 4, 3))
    assert np.array_equal(amax(x, "mx").numpy(), _np_block_amax(xn, 1, 32))


def test_amax_propagates_nan_and_inf() -> None:
    x = torch.ones(2, 64)
    x[0, 3] = math.nan
    x[1, 40] = -math.inf
    a = amax(x, "mx")
    assert math.isnan(a[0, 0]) and a[0, 1] == 1
    assert a[1, 0] == 1 and math.isinf(a[1, 1])


def test_amax_bad_input() -> None:
    with pytest.raises(TypeError, match="x must be a floating-point"):
        amax(torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        amax([1.0, 2.0])  # type: ignore[arg-type]


# ---- round_pow2 ---------------------------------------------------------------------------


def _pow2_reference(v: float, up: bool) -> float:
    """Exact reference from Python's frexp: v = m·2^e with m in [0.5, 1)."""
    if not (math.isfinite(v) and v > 0):
        return v
    m, e = math.frexp(v)
    return v if m == 0.5 else math.ldexp(1.0, e if up else e - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["up", "down"])
def test_round_pow2_exact_against_frexp(dtype: torch.dtype, mode: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.rand(4000, generator=g) * 2.0 ** torch.randint(-140, 120, (4000,), generator=g)
    # Just above / below powers of two (where a log2-based rounding can go wrong), 2^k
    # itself, subnormals, the largest normals and the special values.
    k = torch.arange(-120, 120, dtype=torch.float64)
    edges = torch.cat([2.0**k * (1 + 2**-23), 2.0**k * (1 - 2**-24), 2.0**k])
    specials = [0.0, -0.0, -3.0, math.inf, -math.inf, math.nan, 2.0**-149, 3 * 2.0**-149]
    x = torch.cat([x.double(), edges, torch.tensor([*specials, 1.5 * 2.0**127])]).to(dtype)
    r = round_pow2(x, mode)  # type: ignore[arg-type]
    assert r.dtype == dtype and r.shape == x.shape
    # The reference in float64, then cast to dtype (an "up" beyond the range becomes Inf).
    ref = [_pow2_reference(v, mode == "up") for v in x.tolist()]
    want = torch.tensor(ref, dtype=torch.float64).to(dtype)
    assert bool(((r == want) | (r.isnan() & want.isnan())).all())
    assert round_pow2(x, "none") is x


def test_round_pow2_floats_and_bad_input() -> None:
    assert round_pow2(3.0, "up") == 4.0 and round_pow2(3.0, "down") == 2.0
    assert round_pow2(4, "down") == 4.0 and round_pow2(0.3, "none") == 0.3
    for v in (0.0, -2.5, math.inf):
        assert round_pow2(v, "up") == v
    assert math.isnan(round_pow2(math.nan, "down"))
    assert round_pow2(2.0**-1074 * 3, "up") == 2.0**-1072, "subnormal doubles are exact"
    with pytest.raises(ValueError, match="mode must be"):
        round_pow2(1.0, "nearest")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="s must be"):
        round_pow2(torch.ones(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="s must be"):
        round_pow2("1.0")  # type: ignore[arg-type]


# ---- compute_scale -----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "fp16", "e2m1"])
@pytest.mark.parametrize("margin", [0.0, 1.0, 2.5])
def test_compute_scale_formula(fmt: str, margin: float) -> None:
    f = get_format(fmt)
    a = torch.tensor([1e-3, 0.7, 1.0, 3.0, 448.0, 1e6])
    s = compute_scale(a, fmt, margin=margin)
    expected = a.double() * 2.0**margin / f.max
    # float32 result of a float32 computation: one rounding of the division (<= 2^-24 rel).
    assert torch.allclose(s.double(), expected, rtol=2**-23, atol=0)
    assert bool((a / s <= f.max * 2.0**-margin * (1 + 2**-23)).all())
    p = compute_scale(a, fmt, margin=margin, power_of_two=True)
    m, _ = np.frexp(p.numpy())
    assert np.all(m == 0.5), "power-of-two scales have mantissa exactly 0.5 in frexp"
    assert bool((p >= s).all()) and bool((p < 2 * s).all()), "rounded up, by less than 2x"
    assert bool((a / p <= f.max * 2.0**-margin).all())


@pytest.mark.parametrize("c", [448.0, 57344.0, 6.0, 240.0, 6.0 * 448.0, 56.0, 381.0 * 2**-4])
def test_division_by_a_constant_is_correctly_rounded_also_by_reciprocal(c: float) -> None:
    """``scales._div_const`` (the scale division) against the CPU's float32 division,
    which is correctly rounded, on random values over many binades and on values whose
    quotient sits next to a float32 rounding midpoint; and the same quotient formed as
    the GPU forms it (float64 times the rounded reciprocal) rounds to it too. The plain
    float32 reciprocal product does not, for some of these values (why the float64
    step)."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 18
    rand = torch.randn(n, generator=g) * 2.0 ** torch.randint(-60, 60, (n,), generator=g)
    # midpoints m = k + 1/2 ulp of float32 quotients k, times c, and their float32 neighbours
    k = (torch.rand(n, generator=g, dtype=torch.float64) + 1.0).float()
    mid = k.double() + torch.ldexp(torch.ones(n, dtype=torch.float64), torch.tensor(-24))
    near = (mid * c).float()
    up, down = torch.nextafter(near, near + 1), torch.nextafter(near, near - 1)
    x = torch.cat([rand, near, up, down])
    want = x / c
    assert torch.equal(_div_const(x, c).view(torch.int32), want.view(torch.int32))
    by_reciprocal = (x.double() * (1.0 / c)).float()
    assert torch.equal(by_reciprocal.view(torch.int32), want.view(torch.int32))
    naive = x * torch.tensor(1.0 / c, dtype=torch.float32)
    assert bool((naive != want).any()), "the float32 reciprocal should miss somewhere"


def test_compute_scale_specials_never_nan() -> None:
    a = torch.tensor([0.0, math.inf, -math.inf, math.nan, 1e-45, 3e38])
    s = compute_scale(a, "e4m3fn")
    assert s.tolist()[:4] == [1.0, 1.0, 1.0, 1.0]
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
    assert s[4] == 2.0**-126, "a denormal amax clamps the scale to the smallest normal"
    assert s[5] == pytest.approx(3e38 / 448, rel=1e-6)
    huge = compute_scale(torch.tensor(3e38), "e2m1", margin=100.0, power_of_two=True)
    assert huge.item() == 2.0**127, "scale clamps to 2^127 instead of overflowing to Inf"


def test_compute_scale_bad_margin() -> None:
    with pytest.raises(ValueError, match="margin must be finite"):
        compute_scale(torch.tensor(1.0), "e4m3fn", margin=math.inf)
    with pytest.raises(TypeError, match="margin"):
        compute_scale(torch.tensor(1.0), "e4m3fn", margin="1")  # type: ignore[arg-type]


# ---- MX ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "emax"), [("e4m3fn", 8), ("e5m2", 15), ("e2m1", 2), ("e3m2", 4)])
def test_mx_scale_rule(fmt: str, emax: int) -> None:
    a = torch.tensor([1e-30, 0.3, 1.0, 1.5, 2.0 - 2**-20, 448.0, 7e10])
    s = mx_scale(a, fmt).double().numpy()
    for ai, si in zip(a.double().numpy(), s, strict=True):
        _, e = math.frexp(ai)  # ai = m * 2^e with m in [0.5, 1): floor(log2 ai) = e - 1
        assert si == 2.0 ** (e - 1 - emax)
        assert 2.0**emax <= ai / si < 2.0 ** (emax + 1)
    assert get_format(fmt).max_exponent == emax
    # Clamped to E8M0's range [2^-127, 2^127]; zero / non-finite -> 1.
    edge = mx_scale(torch.tensor([1e-44, 3e38, 0.0, math.nan, math.inf]), "e2m1")
    assert edge.tolist() == [2.0**-127, 2.0 ** (127 - 2), 1.0, 1.0, 1.0]


def test_mx_scale_every_e8m0_exponent() -> None:
    """Each of E8M0's 255 scales 2^-127 ... 2^127 (the least a float32 subnormal), from an
    amax in its binade, against math.ldexp; float32 and float64 amax alike."""
    es = list(range(-127, 128))
    for dt in (torch.float32, torch.float64):
        a = torch.tensor([math.ldexp(1.5, e + 8) if e + 8 < 128 else 3e38 for e in es], dtype=dt)
        got = mx_scale(a, "e4m3fn")
        assert got.dtype == torch.float32
        want = [math.ldexp(1.0, min(e, 127 - 8) if e + 8 >= 128 else max(e, -127)) for e in es]
        assert got.double().tolist() == want


# ---- apply_scale -------------------------------------------------------------------------


def test_apply_scale_blockwise_equals_explicit_expansion() -> None:
    x = torch.randn(6, 8, dtype=torch.float64)
    s = torch.rand(3, 2, dtype=torch.float64) + 0.5
    full = s.repeat_interleave(2, dim=0).repeat_interleave(4, dim=1)
    assert torch.equal(apply_scale(x, s), x * full)
    assert torch.equal(apply_scale(x, s, op="div"), x / full)
    with pytest.raises(ValueError, match="not block-broadcastable"):
        apply_scale(x, torch.ones(4, 2))


# ---- stateful scalers --------------------------------------------------------------------


def _const(a: float, n: int = 64) -> torch.Tensor:
    x = torch.full((n,), 0.5 * a)
    x[7] = -a
    return x


def test_dynamic_scaler() -> None:
    sc = DynamicScaler("e4m3fn")
    assert sc(_const(896.0)).item() == 2.0
    assert sc.last_amax is not None and sc.last_amax.item() == 896.0
    restored = DynamicScaler("e4m3fn")
    restored.load_state_dict(sc.state_dict())
    assert restored.last_amax is not None and restored.last_amax.item() == 896.0
    row = DynamicScaler("e5m2", granularity="row")(torch.tensor([[1.0, -2.0], [57344.0, 0.0]]))
    # float32 result of one float32 division: within 2^-24 relative of the exact value.
    assert row.flatten().tolist() == pytest.approx([2.0 / 57344.0, 1.0], rel=2**-23)


def test_delayed_scaler_max_history_and_outlier_recovery() -> None:
    fmt = get_format("e4m3fn")
    sc = DelayedScaler(fmt, history_len=3, algo="max")
    amaxes = [1.0, 2.0, 4.0, 1000.0, 1.0, 1.0, 1.0, 1.0]
    scales = [sc(_const(a)).item() for a in amaxes]
    # Warm-up uses the first tensor itself; then max over the (up to 3) previous amaxes.
    expected_ref = [1.0, 1.0, 2.0, 4.0, 1000.0, 1000.0, 1000.0, 1.0]
    assert scales == pytest.approx([r / fmt.max for r in expected_ref], rel=2**-23)
    # The outlier is gone exactly history_len steps after it was recorded.
    assert scales[3 + 3 + 1] == pytest.approx(1.0 / fmt.max, rel=2**-23)


def test_delayed_scaler_most_recent() -> None:
    sc = DelayedScaler("e5m2", history_len=4, algo="most_recent")
    got = [sc(_const(a)).item() * 57344.0 for a in [3.0, 5.0, 100.0, 2.0]]
    assert got == pytest.approx([3.0, 3.0, 5.0, 100.0], rel=2**-23)


def test_delayed_scaler_skips_nonfinite(caplog: pytest.LogCaptureFixture) -> None:
    sc = DelayedScaler("e4m3fn", history_len=2)
    sc(_const(8.0))
    bad = _const(8.0)
    bad[0] = math.nan
    s = sc(bad)
    assert torch.isfinite(s).all()
    assert sc.nonfinite_count == 1
    assert sc.amax_history is not None and sc.amax_history.tolist() == [8.0, 8.0]
    assert "non-finite amax" in caplog.text


def test_delayed_scaler_state_dict_resumes_exactly(tmp_path: object) -> None:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 64, generator=g) * 10 ** (i % 5) for i in range(12)]
    a = DelayedScaler("e4m3fn", history_len=4, granularity="row")
    for x in xs[:6]:
        a(x)
    b = DelayedScaler("e4m3fn", history_len=4, granularity="row")
    b.load_state_dict(a.state_dict())
    for x in xs[6:]:
        assert torch.equal(a(x), b(x))
    other = DelayedScaler("e4m3fn", history_len=5, granularity="row")
    with pytest.raises(ValueError, match="does not match"):
        other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="x: scale shape"):
        a(torch.randn(4, 64))


def test_delayed_and_static_refuse_mx_and_bad_args() -> None:
    with pytest.raises(ValueError, match="MX scales are dynamic"):
        DelayedScaler("e4m3fn", granularity="mx")
    with pytest.raises(ValueError, match="history_len"):
        DelayedScaler("e4m3fn", history_len=0)
    with pytest.raises(ValueError, match="algo"):
        DelayedScaler("e4m3fn", algo="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="calibration_steps"):
        StaticScaler("e4m3fn", calibration_steps=0)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_static_scaler_rejects_bad_scale(bad: float) -> None:
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        StaticScaler("e4m3fn", scale=bad)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        StaticScaler("e4m3fn", scale=torch.tensor([1.0, bad]), granularity="row")


def test_static_scaler_given_and_calibrated() -> None:
    assert StaticScaler("e4m3fn", scale=0.25)(_const(1e6)).item() == 0.25
    sc = StaticScaler("e4m3fn", calibration_steps=3)
    assert not sc.frozen
    seen = [sc(_const(a)).item() * 448.0 for a in [2.0, 8.0, 4.0, 1000.0, 1.0]]
    # Running max over the first three calls, then frozen at the max (8).
    assert seen == pytest.approx([2.0, 8.0, 8.0, 8.0, 8.0], rel=2**-23)
    assert sc.frozen
    resumed = StaticScaler("e4m3fn", calibration_steps=3)
    resumed.load_state_dict(sc.state_dict())
    assert resumed.frozen and resumed(_const(1e9)).item() * 448.0 == pytest.approx(8.0)
    with pytest.raises(ValueError, match="no tensor seen yet"):
        StaticScaler("e4m3fn").freeze()


def test_scalers_match_ml_dtypes_roundtrip_bound() -> None:
    """A dynamic scale maps amax exactly onto fmt.max, so the cast never overflows."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, generator=g) * 1e4
    s = DynamicScaler("e4m3fn")(x)
    y = (x / s).numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.isfinite(y).all() and np.abs(y).max() == 448.0


# ---- the one grammar: relative form, bind, padding policy ----------------------------------


@pytest.mark.parametrize(
    ("name", "cd", "shape", "expected"),
    [
        ("axis", 1, (4, 256), (4, 1)),  # M×K: one scale per row
        ("axis", 0, (256, 8), (1, 8)),  # K×N: one scale per column
        ("block:1x128", 1, (4, 256), (4, 2)),
        ("block:1x128", 0, (256, 8), (2, 8)),  # 128 along K (rows), 1 along N
        ("block:128x128", 0, (256, 384), (2, 3)),
        ("mx:32", 0, (64, 4), (2, 4)),
        ("nv", 1, (4, 64), (4, 4)),
    ],
)
def test_relative_granularity_binds_to_the_contracted_dim(
    name: str, cd: int, shape: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    g = Granularity.from_name(name, axis="K")
    assert g.relative and Granularity.from_name(g.name) == g  # the name round-trips
    assert g.bind(cd).scale_shape(shape) == expected
    with pytest.raises(ValueError, match="bind it first"):
        g.scale_shape(shape)


def test_absolute_names_round_trip_and_padding_is_explicit() -> None:
    for name in ["tensor", "row", "axis:0", "block:1x128", "block:4x8@0", "mx", "mx:16@0", "nv"]:
        g = Granularity.from_name(name)
        assert Granularity.from_name(g.name) == g and not g.relative
    g = Granularity.from_name("block:4x8")
    x = torch.randn(5, 9)
    p = pad_to_blocks(x, g)
    assert p.shape == (8, 16) and torch.equal(p[:5, :9], x) and not p[5:].any()
    assert not p[:, 9:].any() and pad_to_blocks(p, g) is p
    # Zero padding leaves every block's amax unchanged (the policy's reason).
    assert amax(p, g)[0, 0] == x[:4, :8].abs().max()


def test_scalers_over_given_state_tensors() -> None:
    """The state lives in tensors the caller gives (e.g. module buffers), updated in place;
    ``state=`` threads another tensor through one call."""
    hist = torch.zeros(3)
    sc = DelayedScaler("e4m3fn", history_len=3, amax_history=hist)
    sc(_const(4.0))
    sc(_const(8.0), update=False)  # evaluation: nothing recorded
    assert sc.amax_history is hist and hist.tolist() == [4.0, 0.0, 0.0]
    other = torch.zeros(3)
    assert sc(_const(2.0), state=other).item() == pytest.approx(2.0 / 448, rel=2**-23)
    assert other.tolist() == [2.0, 0.0, 0.0] and hist.tolist() == [4.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="amax_history"):
        DelayedScaler("e4m3fn", history_len=4, amax_history=torch.zeros(3))
    calib = torch.zeros(())
    st = StaticScaler("e4m3fn", calibration_steps=None, calib_amax=calib)
    for a in (2.0, 8.0, 4.0):
        st(_const(a))
    assert not st.frozen and calib.item() == 8.0  # None: calibrates until freeze()
    st.freeze()
    assert st.frozen and st(_const(1e6)).item() == pytest.approx(8.0 / 448, rel=2**-23)
    st.reset()
    assert not st.frozen and calib.item() == 0.0 and st.calib_amax is calib
    restored = DelayedScaler("e4m3fn", history_len=3, amax_history=torch.zeros(3))
    bound = restored.amax_history
    restored.load_state_dict(sc.state_dict())
    assert restored.amax_history is bound and bound.tolist() == hist.tolist()  # in place


def test_nonfinite_count_is_a_tensor() -> None:
    """Counted in a tensor (no host sync per call; reducible across ranks)."""
    sc = DynamicScaler("e4m3fn")
    sc(_const(1.0))
    bad = _const(1.0)
    bad[1] = math.inf
    sc(bad)
    sc(bad)
    assert isinstance(sc.nonfinite, torch.Tensor) and sc.nonfinite_count == 2
    old = {**sc.state_dict(), "nonfinite_count": 5}
    del old["nonfinite"]  # a state saved when the count was a Python int
    fresh = DynamicScaler("e4m3fn")
    fresh.load_state_dict(old)
    assert fresh.nonfinite_count == 5


@pytest.mark.parametrize("bad", [-1.0, 0.0, math.nan, math.inf])
def test_static_scaler_refuses_a_bad_scale_on_load(bad: float) -> None:
    sc = StaticScaler("e4m3fn", scale=0.5)
    state = {**sc.state_dict(), "scale": torch.tensor(bad)}
    with pytest.raises(ValueError, match=r"state\['scale'\] must be finite and > 0"):
        StaticScaler("e4m3fn").load_state_dict(state)
    state = {**sc.state_dict(), "calib_amax": torch.tensor(bad if bad != 0 else -2.0)}
    with pytest.raises(ValueError, match=r"state\['calib_amax'\]"):
        StaticScaler("e4m3fn").load_state_dict(state)
