"""Tests for :mod:`lowprec.core.formats`.

The oracles are independent of the code under test: hand-written constants, ``ml_dtypes``
(bit-exact reference for every format it has), numpy's own float16/float32 casts, and small
numpy re-implementations written here (tf32 rounding, round-to-odd). Comparisons are on bit
patterns (a NaN matches any NaN) unless a comment gives the reason for a tolerance.
"""

from __future__ import annotations

import doctest
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, reject, settings
from hypothesis import strategies as st

import lowprec.core.bits as bits_module
import lowprec.core.codes as codes_module
import lowprec.core.formats as formats_module
import lowprec.core.rounding as rounding_module
from lowprec.core.codes import from_bits, to_bits
from lowprec.core.formats import Format, format_names, get_format
from lowprec.core.rounding import quantize, snr_db, storage_dtype, to_format

# ---------------------------------------------------------------------------------------
# Reference tables
# ---------------------------------------------------------------------------------------

# name: (E, M, bias, special, signed, max, min_normal, min_subnormal, epsilon, num_codes),
# written out by hand from the format definitions (OCP FP8/MX, IEEE 754, NVIDIA tf32).
EXPECTED: dict[str, tuple[int, int, int, str, bool, float, float, float, float, int]] = {
    "fp32": (
        8,
        23,
        127,
        "ieee",
        True,
        3.4028234663852886e38,
        2.0**-126,
        2.0**-149,
        2.0**-23,
        2**32,
    ),
    "tf32": (8, 10, 127, "ieee", True, 2.0**128 - 2.0**117, 2.0**-126, 2.0**-136, 2.0**-10, 2**19),
    "bf16": (8, 7, 127, "ieee", True, 3.3895313892515355e38, 2.0**-126, 2.0**-133, 2.0**-7, 2**16),
    "fp16": (5, 10, 15, "ieee", True, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10, 2**16),
    "e4m3fn": (4, 3, 7, "fn", True, 448.0, 2.0**-6, 2.0**-9, 0.125, 256),
    "e5m2": (5, 2, 15, "ieee", True, 57344.0, 2.0**-14, 2.0**-16, 0.25, 256),
    "e4m3fnuz": (4, 3, 8, "fnuz", True, 240.0, 2.0**-7, 2.0**-10, 0.125, 256),
    "e5m2fnuz": (5, 2, 16, "fnuz", True, 57344.0, 2.0**-15, 2.0**-17, 0.25, 256),
    "e4m3": (4, 3, 7, "ieee", True, 240.0, 2.0**-6, 2.0**-9, 0.125, 256),
    "e3m4": (3, 4, 3, "ieee", True, 15.5, 0.25, 2.0**-6, 0.0625, 256),
    "e4m3b11fnuz": (4, 3, 11, "fnuz", True, 30.0, 2.0**-10, 2.0**-13, 0.125, 256),
    "e3m2": (3, 2, 3, "finite", True, 28.0, 0.25, 0.0625, 0.25, 64),
    "e2m3": (2, 3, 1, "finite", True, 7.5, 1.0, 0.125, 0.125, 64),
    "e2m1": (2, 1, 1, "finite", True, 6.0, 1.0, 0.5, 0.5, 16),
    "e8m0": (8, 0, 127, "fn", False, 2.0**127, 2.0**-127, 2.0**-127, 1.0, 256),
}

# A few dynamic ranges computed by hand: log2(max / min_subnormal).
EXPECTED_BINADES = {
    "fp16": math.log2(65504) + 24,  # 39.99997798...
    "e4m3fn": math.log2(448 * 512),  # 17.807...
    "e5m2": math.log2(57344) + 16,
    "e2m1": math.log2(12),  # 6 / 0.5
    "e8m0": 254.0,  # 2^127 / 2^-127
}

# Our format name -> the ml_dtypes (or numpy) scalar type with the same encoding.
ML_TYPES: dict[str, type] = {
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "e4m3": ml_dtypes.float8_e4m3,
    "e3m4": ml_dtypes.float8_e3m4,
    "e4m3b11fnuz": ml_dtypes.float8_e4m3b11fnuz,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
}
SHARED = list(ML_TYPES)
NO_NAN = ("e3m2", "e2m3", "e2m1")  # 'finite' formats: ml_dtypes maps NaN to a zero

ALIASES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8_e4m3": "e4m3fn",
    "fp8_e5m2": "e5m2",
    "e3m2fn": "e3m2",
    "fp6_e3m2": "e3m2",
    "e2m3fn": "e2m3",
    "fp6_e2m3": "e2m3",
    "e2m1fn": "e2m1",
    "fp4_e2m1": "e2m1",
    "e8m0fnu": "e8m0",
    " E4M3FN ": "e4m3fn",
    "BF16": "bf16",
}

TORCH_DTYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "e4m3fn",
    torch.float8_e5m2: "e5m2",
    torch.float8_e4m3fnuz: "e4m3fnuz",
    torch.float8_e5m2fnuz: "e5m2fnuz",
}
E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7
if E8M0_DTYPE is not None:  # storage only: quantize does not use torch's e8m0 cast
    TORCH_DTYPES[E8M0_DTYPE] = "e8m0"

N_RANDOM = 1_000_000

# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence numpy/ml_dtypes overflow and invalid-cast warnings (they are the point)."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _ml(x: np.ndarray, name: str) -> np.ndarray:
    """ml_dtypes' round-to-nearest-even of ``x`` into ``name``, decoded back to x's dtype."""
    with _quiet():
        return x.astype(ML_TYPES[name]).astype(x.dtype)


def _q(x: np.ndarray, fmt: str | Format, **kw: object) -> np.ndarray:
    return quantize(torch.from_numpy(np.ascontiguousarray(x)), fmt, **kw).numpy()  # type: ignore[arg-type]


def _uint(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])


def _assert_bits_equal(got: np.ndarray, want: np.ndarray, x: np.ndarray, what: str) -> None:
    """Bit-exact equality of two float arrays of one dtype; any NaN matches any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = (_uint(got) == _uint(want)) | (np.isnan(got) & np.isnan(want))
    if not same.all():
        idx = np.flatnonzero(~same)[:6]
        pytest.fail(
            f"{what}: {int((~same).sum())} of {same.size} differ; x={x.ravel()[idx]!r} "
            f"got={got.ravel()[idx]!r} want={want.ravel()[idx]!r}"
        )


def _codes(name: str) -> np.ndarray:
    """Every code of format ``name`` as unsigned integers."""
    f = get_format(name)
    return np.arange(f.num_codes, dtype=np.uint16 if f.total_bits > 8 else np.uint8)


def _decoded(name: str) -> np.ndarray:
    """ml_dtypes' float32 value of every code of ``name``."""
    return _codes(name).view(ML_TYPES[name]).astype(np.float32)


def _finite_values(name: str) -> np.ndarray:
    """Sorted distinct finite values of ``name`` (float64), negative ones included."""
    with _quiet():  # float32 signalling NaNs warn when widened
        v = _decoded(name).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def _ties(values: np.ndarray) -> np.ndarray:
    """Midpoints of adjacent values and the float32 numbers one ulp either side."""
    mid64 = (values[:-1] + values[1:]) / 2
    mid = mid64.astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), mid64)  # every midpoint is a float32
    inf = np.float32(np.inf)
    return np.concatenate([mid, np.nextafter(mid, inf), np.nextafter(mid, -inf)])


def _specials(fmt: str | Format) -> np.ndarray:
    """Zeros, Inf, NaN, the overflow threshold and the underflow threshold (float32)."""
    f = get_format(fmt)
    half_ulp = 2.0 ** (f.max_exponent - f.mantissa_bits - 1)
    inf, zero = np.float32(np.inf), np.float32(0)
    with _quiet():
        tie = np.float32(f.max + half_ulp)  # max + half an ulp
        tiny = np.float32(f.min_subnormal / 2)
        big = [
            f.max,
            tie,
            np.nextafter(tie, inf),
            np.nextafter(tie, -inf),
            2 * f.max,
            f.max * 1.01,
            1e30,
            3e38,
            np.finfo(np.float32).max,
        ]
        small = [
            f.min_subnormal,
            tiny,
            np.nextafter(tiny, inf),
            np.nextafter(tiny, zero),
            f.min_subnormal / 4,
            1e-45,
            f.min_normal,
            np.nextafter(np.float32(f.min_normal), zero),
        ]
        pos = np.array([0.0, np.inf, np.nan, *big, *small], dtype=np.float64)
        return np.concatenate([pos, -pos]).astype(np.float32)


def _random_bits32(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random float32 bit patterns: the whole float32 range, NaN and Inf included."""
    return rng.integers(0, 2**32, n, dtype=np.uint32).view(np.float32)


def _random_in_range(rng: np.random.Generator, f: Format, n: int) -> np.ndarray:
    """sign * 2^u, u uniform over the format's range and a couple of binades either side."""
    lo, hi = math.log2(f.min_subnormal) - 2, math.log2(f.max) + 1
    x = np.exp2(rng.uniform(lo, hi, n)) * rng.choice([-1.0, 1.0], n)
    with _quiet():
        return x.astype(np.float32)


def _round_to_odd_f32(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounding to odd (truncate, then set the last bit if inexact).

    Rounding to odd with >= 2 extra bits and then to nearest gives the same result as one
    rounding to nearest (Boldo & Melquiond, 2008): a correct float64 oracle built from
    ml_dtypes' float32 conversion.
    """
    with _quiet():
        r = x.astype(np.float32)
        away = np.abs(r.astype(np.float64)) > np.abs(x)  # RNE rounded up in magnitude
        r = np.where(away, np.nextafter(r, np.float32(0)), r)
        inexact = (r.astype(np.float64) != x) & ~np.isnan(x)
    return (r.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)


def _ml_rounds_float64_via_float32(name: str) -> bool:
    """Whether ml_dtypes converts float64 to ``name`` through float32 (double rounding).

    Probe: just above the tie between 1 and 1+eps (E8M0: just below its half-up point 1.5)
    float32 lands on the tie, so a double rounding gives the other neighbour.
    """
    f = get_format(name)
    if name == "e8m0":
        x, once, twice = 1.5 - 2.0**-40, 1.0, 2.0
    else:
        x, once, twice = 1 + f.epsilon / 2 + 2.0**-40, 1 + f.epsilon, 1.0
    got = float(_ml(np.array([x]), name)[0])
    assert got in (once, twice)
    return got == twice


def _ml64(x: np.ndarray, name: str) -> np.ndarray:
    """Correct single rounding of float64 ``x`` into ``name``, from ml_dtypes."""
    if _ml_rounds_float64_via_float32(name):
        # ml_dtypes (0.5/0.6) casts float64 to these types through float32, which rounds
        # twice; rounding to odd first makes its answer the single rounding.
        with _quiet():
            return _round_to_odd_f32(x).astype(ML_TYPES[name]).astype(np.float64)
    return _ml(x, name)


def _tf32_oracle(x: np.ndarray) -> np.ndarray:
    """tf32 (E8M10, IEEE) rounding in numpy float64: round-half-even of x / 2^(e - 10)."""
    with _quiet():
        x64 = x.astype(np.float64)
        ax = np.abs(x64)
        _, ex = np.frexp(ax)  # ax = frac * 2^ex, frac in [0.5, 1): floor(log2 ax) = ex - 1
        e = np.maximum(ex - 1, -126)  # below 2^-126 the quantum stays 2^-136 (subnormals)
        quantum = np.exp2((e - 10).astype(np.float64))
        r = np.rint(ax / quantum) * quantum  # both steps exact; np.rint ties to even
        r = np.where(r > EXPECTED["tf32"][5], np.inf, r)  # beyond max (incl. the tie): Inf
        r = np.where(np.isinf(ax), np.inf, r)
        out = np.where(np.isnan(x64), x64, np.copysign(r, x64))
    return out.astype(x.dtype)


def _np_round(x: np.ndarray, f: Format, saturate: bool = False) -> np.ndarray:
    """Round-to-nearest-even into a signed format, written from the definition in numpy
    float64: quantum 2^(max(floor(log2|x|), emin) - M), then the overflow/Inf/NaN table."""
    assert f.signed
    with _quiet():
        x64 = x.astype(np.float64)
        ax = np.abs(x64)
        _, ex = np.frexp(ax)
        e = np.maximum(ex - 1, 1 - f.bias)  # binade exponent; subnormals share the lowest
        quantum = np.exp2((e - f.mantissa_bits).astype(np.float64))
        t = ax / quantum  # exact: scaling by a power of two
        r = np.rint(t) * quantum  # ties to an even multiple of the quantum: an even code
        if f.mantissa_bits == 0:  # the code's last bit is the exponent's: 2^e has e + bias
            tie = (t == 1.5) & (ax >= f.min_normal)
            r = np.where(tie, np.where((e + f.bias) % 2 == 0, 1.0, 2.0) * quantum, r)
        over = r > f.max  # includes Inf inputs
        finite_over_value = {"ieee": np.inf, "fn": np.nan, "fnuz": np.nan, "finite": f.max}
        inf_value = finite_over_value[f.special]
        r = np.where(over & np.isfinite(ax), f.max if saturate else inf_value, r)
        r = np.where(np.isinf(ax), inf_value, r)
        out = np.copysign(r, x64)
        if f.special == "fnuz":
            out = np.where(out == 0, 0.0, out)  # no negative zero
        out = np.where(np.isnan(x64), x64, out)
    return out.astype(x.dtype)


def _float64_traps(values: np.ndarray) -> np.ndarray:
    """float64 numbers one float64 ulp off every tie: float32 would round them onto it."""
    mid = (values[:-1] + values[1:]) / 2
    return np.concatenate([mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)])


# ---------------------------------------------------------------------------------------
# 1. Format properties
# ---------------------------------------------------------------------------------------


def test_builtin_names_are_the_expected_set() -> None:
    assert sorted(format_names()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_format_properties_hand_written(name: str) -> None:
    e, m, bias, special, signed, fmax, min_normal, min_sub, eps, n_codes = EXPECTED[name]
    f = get_format(name)
    assert (f.exponent_bits, f.mantissa_bits, f.bias, f.special, f.signed) == (
        e,
        m,
        bias,
        special,
        signed,
    )
    assert f.name == name and str(f) == name
    assert f.max == fmax
    assert f.min_normal == min_normal
    assert f.min_subnormal == min_sub
    assert f.epsilon == eps
    assert f.num_codes == n_codes
    assert f.total_bits == int(signed) + e + m
    assert f.has_inf == (special == "ieee")
    assert f.has_nan == (special != "finite")
    assert f.has_subnormals == (m > 0)
    # log2 of an exact ratio of floats: math.log2 is correctly rounded to within 1 ulp.
    assert f.binades == pytest.approx(math.log2(fmax) - math.log2(min_sub), rel=1e-15)
    if name in EXPECTED_BINADES:
        assert f.binades == pytest.approx(EXPECTED_BINADES[name], rel=1e-15)  # same reason


@pytest.mark.parametrize("name", SHARED)
def test_format_properties_match_ml_dtypes_finfo(name: str) -> None:
    f, fi = get_format(name), ml_dtypes.finfo(ML_TYPES[name])
    assert f.max == float(fi.max)
    assert f.min_normal == float(fi.smallest_normal)
    assert f.min_subnormal == float(fi.smallest_subnormal)
    assert f.epsilon == float(fi.eps)
    assert f.total_bits == fi.bits
    assert f.mantissa_bits == fi.nmant
    assert f.exponent_bits == fi.nexp
    assert f.min_exponent == fi.minexp
    assert f.max_exponent == fi.maxexp - 1
    assert f.max == _finite_values(name).max()  # the largest finite code decodes to max


def test_torch_dtype_property() -> None:
    for dtype, name in TORCH_DTYPES.items():
        f = get_format(name)
        assert f.torch_dtype == dtype
        assert f.max == torch.finfo(dtype).max  # torch's finfo agrees on the native formats
        assert f.min_subnormal == torch.finfo(dtype).smallest_normal * 2.0**-f.mantissa_bits
    for name in ("tf32", "e4m3", "e3m4", "e4m3b11fnuz", "e3m2", "e2m3", "e2m1"):
        assert get_format(name).torch_dtype is None


# ---------------------------------------------------------------------------------------
# 2. get_format and Format validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(EXPECTED))
def test_get_format_by_name_and_passthrough(name: str) -> None:
    f = get_format(name)
    assert f.name == name
    assert get_format(f) is f
    e, m, bias, special, signed = EXPECTED[name][:5]
    assert f == Format(e, m, bias, special, signed)  # type: ignore[arg-type]
    assert Format(e, m, bias, special, signed).name == name  # type: ignore[arg-type]


@pytest.mark.parametrize(("alias", "name"), list(ALIASES.items()))
def test_get_format_aliases(alias: str, name: str) -> None:
    assert get_format(alias) is get_format(name)


@pytest.mark.parametrize(("dtype", "name"), list(TORCH_DTYPES.items()))
def test_get_format_torch_dtype(dtype: torch.dtype, name: str) -> None:
    assert get_format(dtype) is get_format(name)


def test_get_format_unsupported_torch_dtype() -> None:
    with pytest.raises(ValueError, match="name"):
        get_format(torch.float64)
    with pytest.raises(ValueError, match="name"):
        get_format(torch.int8)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        # spelling -> (E, M, bias, special, signed, max)
        ("e6m9", (6, 9, 31, "ieee", True, (2 - 2.0**-9) * 2.0**31)),
        ("e4m3fn", (4, 3, 7, "fn", True, 448.0)),
        ("e3m4fn", (3, 4, 3, "fn", True, 16 * 1.875)),
        ("e5m3fnuz", (5, 3, 16, "fnuz", True, 2.0**15 * 1.875)),
        ("e4m3b11fnuz", (4, 3, 11, "fnuz", True, 30.0)),
        ("e5m2fnuz", (5, 2, 16, "fnuz", True, 57344.0)),
        ("e5m2b16fnuz", (5, 2, 16, "fnuz", True, 57344.0)),
        ("e4m3b7", (4, 3, 7, "ieee", True, 240.0)),
        ("e4m3b9", (4, 3, 9, "ieee", True, 60.0)),
        ("e8m0fnu", (8, 0, 127, "fn", False, 2.0**127)),
        ("e4m0fnu", (4, 0, 7, "fn", False, 2.0**7)),
        ("e2m0", (2, 0, 1, "ieee", True, 2.0)),
    ],
)
def test_get_format_exmy_spelling(spec: str, expected: tuple[object, ...]) -> None:
    f = get_format(spec)
    e, m, bias, special, signed, fmax = expected
    assert (f.exponent_bits, f.mantissa_bits, f.bias, f.special, f.signed) == (
        e,
        m,
        bias,
        special,
        signed,
    )
    assert f.max == fmax
    assert get_format(f.name) == f  # the canonical name parses back to the same format


def test_get_format_exmy_reuses_builtin_names() -> None:
    assert get_format("e5m2b16fnuz") is get_format("e5m2fnuz")
    assert get_format("e4m3b7") is get_format("e4m3")
    assert get_format("e8m23") is get_format("fp32")
    assert get_format("e8m10") is get_format("tf32")
    assert get_format("e6m9").name == "e6m9"
    assert get_format("e4m3b9").name == "e4m3b9"


@pytest.mark.parametrize("bad", ["e4m3x", "fp7", "", "float8", "e4m3fnz", "m3e4", "bf17"])
def test_get_format_unknown_name_lists_valid_names(bad: str) -> None:
    with pytest.raises(ValueError, match="name") as info:
        get_format(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    for valid in format_names():
        assert valid in msg


@pytest.mark.parametrize("bad", [3, 4.5, None, b"e4m3fn", ["e4m3fn"]])
def test_get_format_wrong_type(bad: object) -> None:
    with pytest.raises(TypeError, match="name"):
        get_format(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"exponent_bits": 9, "mantissa_bits": 3}, ValueError, "exponent_bits"),
        ({"exponent_bits": 0, "mantissa_bits": 3}, ValueError, "exponent_bits"),
        ({"exponent_bits": 4, "mantissa_bits": 24}, ValueError, "mantissa_bits"),
        ({"exponent_bits": 4, "mantissa_bits": -1}, ValueError, "mantissa_bits"),
        ({"exponent_bits": 4.0, "mantissa_bits": 3}, TypeError, "exponent_bits"),
        ({"exponent_bits": True, "mantissa_bits": 3}, TypeError, "exponent_bits"),
        ({"exponent_bits": 4, "mantissa_bits": "3"}, TypeError, "mantissa_bits"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "bias": 1.5}, TypeError, "bias"),
        ({"exponent_bits": 8, "mantissa_bits": 3, "bias": -10}, ValueError, "bias"),
        ({"exponent_bits": 8, "mantissa_bits": 3, "bias": 200}, ValueError, "bias"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "special": "iee"}, ValueError, "special"),
        ({"exponent_bits": 1, "mantissa_bits": 3}, ValueError, "exponent_bits"),
        ({"exponent_bits": 1, "mantissa_bits": 0, "special": "fn"}, ValueError, "e1m0"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "signed": False}, ValueError, "mantissa_bits"),
        (
            {"exponent_bits": 8, "mantissa_bits": 0, "special": "fnuz", "signed": False},
            ValueError,
            "special",
        ),
    ],
)
def test_format_rejects_impossible_parameters(
    kwargs: dict[str, object], error: type[Exception], argument: str
) -> None:
    with pytest.raises(error, match=argument):
        Format(**kwargs)  # type: ignore[arg-type]


def test_get_format_exmy_out_of_range_raises() -> None:
    with pytest.raises(ValueError, match="exponent_bits"):
        get_format("e9m3")
    with pytest.raises(ValueError, match="mantissa_bits"):
        get_format("e4m24")
    with pytest.raises(ValueError, match="float32"):
        get_format("e8m3fn")  # 'fn' frees the top binade: max 2^128 * 1.75 > float32 max


# ---------------------------------------------------------------------------------------
# 3. Bit-exactness with ml_dtypes (round to nearest even)
# ---------------------------------------------------------------------------------------


def _check_against_ml(x: np.ndarray, name: str, what: str) -> None:
    """quantize(x) == ml_dtypes(x) for float32 x; NaN inputs of 'finite' formats left out
    (checked by test_nan_without_nan_code_stays_nan)."""
    if name in NO_NAN:
        x = x[~np.isnan(x)]
    _assert_bits_equal(_q(x, name), _ml(x, name), x, f"{name} {what}")


@pytest.mark.parametrize("name", SHARED)
def test_bit_exact_all_codes_idempotent(name: str) -> None:
    values = _decoded(name)
    got = _q(values, name)
    _assert_bits_equal(got, values, values, f"{name}: every code must round to itself")
    _check_against_ml(values, name, "codes")


@pytest.mark.parametrize("name", SHARED)
def test_bit_exact_ties(name: str) -> None:
    values = _finite_values(name)
    _check_against_ml(_ties(values), name, "ties and ties +- 1 ulp")


@pytest.mark.parametrize("name", SHARED)
def test_bit_exact_specials(name: str) -> None:
    _check_against_ml(_specials(name), name, "zeros, Inf, NaN, overflow, underflow")


@pytest.mark.parametrize("name", SHARED)
def test_bit_exact_random_float32_bits(name: str) -> None:
    rng = np.random.default_rng(1000 + SHARED.index(name))
    _check_against_ml(_random_bits32(rng, N_RANDOM), name, "random float32 bit patterns")


@pytest.mark.parametrize("name", SHARED)
def test_bit_exact_random_in_format_range(name: str) -> None:
    rng = np.random.default_rng(2000 + SHARED.index(name))
    x = _random_in_range(rng, get_format(name), N_RANDOM)
    _check_against_ml(x, name, "random values in the format's range")


@pytest.mark.parametrize("name", NO_NAN)
def test_nan_without_nan_code_stays_nan(name: str) -> None:
    """Documented divergence: ml_dtypes turns NaN into a zero; we keep NaN."""
    nans = np.array([np.nan, -np.nan], dtype=np.float32)
    ml = _ml(nans, name)
    assert np.all(ml == 0)  # what ml_dtypes does (documents why NaN is left out above)
    assert np.all(np.isnan(_q(nans, name)))
    assert np.all(np.isnan(_q(nans.astype(np.float64), name)))
    assert torch.isnan(quantize(torch.tensor([np.nan], dtype=torch.bfloat16), name)).all()


@pytest.mark.parametrize("src", [torch.float16, torch.bfloat16], ids=["fp16-in", "bf16-in"])
@pytest.mark.parametrize("name", [*SHARED, "fp32", "tf32"])
def test_bit_exact_16bit_inputs_exhaustive(name: str, src: torch.dtype) -> None:
    """Every float16 / bfloat16 bit pattern. The result is the value rounded into the format
    and, where the format is not narrower than the input, cast back with RNE."""
    np_src = np.float16 if src == torch.float16 else ml_dtypes.bfloat16
    x16 = np.arange(2**16, dtype=np.uint16).view(np_src)
    x32 = x16.astype(np.float32)
    if name in NO_NAN:
        keep = ~np.isnan(x32)
        x16, x32 = x16[keep], x32[keep]
    xt = torch.from_numpy(x16.view(np.int16).copy()).view(src)
    got = quantize(xt, name).float().numpy()
    if name in ("fp32", "tf32"):
        want = x32  # fp16 and bf16 values are all fp32 and tf32 values
    else:
        with _quiet():
            want = _ml(x32, name).astype(np_src).astype(np.float32)
    _assert_bits_equal(got, want, x32, f"{name} from {src}")


@pytest.mark.parametrize("name", SHARED)
def test_bit_exact_float64_inputs(name: str) -> None:
    """float64 inputs are rounded once. Where ml_dtypes goes through float32 (all its own
    types in 0.5/0.6; numpy's float16 rounds directly) the oracle rounds to odd first."""
    f = get_format(name)
    rng = np.random.default_rng(3000 + SHARED.index(name))
    values = _finite_values(name)
    parts = [
        _float64_traps(values),
        rng.integers(0, 2**64, 300_000, dtype=np.uint64).view(np.float64),
        np.exp2(rng.uniform(math.log2(f.min_subnormal) - 2, math.log2(f.max) + 1, 300_000))
        * rng.choice([-1.0, 1.0], 300_000),
        _specials(name).astype(np.float64),
        np.array([1e300, -1e300, 1e-300, -1e-300, 5e-324]),
    ]
    x = np.concatenate(parts)
    if name in NO_NAN:
        x = x[~np.isnan(x)]
    if name == "e8m0":
        # [2^-149, 2^-126) is float32's subnormal range, where the float32 bit rule (and so
        # ml_dtypes) differs from rounding the value: test_e8m0_float64_tiny_values.
        x = x[~((np.abs(x) >= 2.0**-149) & (np.abs(x) < 2.0**-126))]
    _assert_bits_equal(_q(x, name), _ml64(x, name), x, f"{name} float64")


@pytest.mark.parametrize("name", ["fp16", "bf16", "e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"])
def test_bit_path_of_native_formats(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile quantize uses bit arithmetic instead of torch's cast for the
    formats torch has (inductor drops cast round trips); check that path eagerly too."""
    rng = np.random.default_rng(19)
    f = get_format(name)
    x = np.concatenate(
        [
            _random_bits32(rng, 300_000),
            _random_in_range(rng, f, 300_000),
            _ties(_finite_values(name)),
            _specials(name),
        ]
    )
    native = _q(x, name)
    native_sat = _q(x, name, saturate=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _assert_bits_equal(_q(x, name), native, x, f"{name} bit path vs torch cast")
    _assert_bits_equal(_q(x, name, saturate=True), native_sat, x, f"{name} bit path, saturate")
    _check_against_ml(x, name, "bit path")


@pytest.mark.parametrize("name", SHARED)
def test_float64_double_rounding_trap(name: str) -> None:
    """A float64 just above a tie, which float32 rounds onto the tie, must round up."""
    f = get_format(name)
    if name == "e8m0":  # half-up rule: just below 1.5 goes down, 1.5 itself goes up
        x = np.array([1.5 - 2.0**-40, 1.5, -1.0])
        want = np.array([1.0, 2.0, np.nan])
    else:
        tie = 1 + f.epsilon / 2
        x = np.array([tie + 2.0**-40, -(tie + 2.0**-40), tie, tie - 2.0**-40])
        want = np.array([1 + f.epsilon, -(1 + f.epsilon), 1.0, 1.0])
    _assert_bits_equal(_q(x, name), want, x, f"{name} float64 trap")
    via32 = _ml_rounds_float64_via_float32(name)
    if via32:  # ml_dtypes rounds twice here; the documented reason for the odd-round oracle
        assert _ml(x[:1], name)[0] != want[0]
    else:
        _assert_bits_equal(_ml(x, name), want, x, f"ml_dtypes {name} float64 trap")


def test_e8m0_float64_tiny_values() -> None:
    """E8M0 from float64 in float32's subnormal range: half-way between 2^-127 and 2^-126
    by value (0.75 * 2^-126) rounds up; below, including far below 2^-149, gives 2^-127."""
    x = np.array(
        [
            2.0**-127,
            0.6 * 2**-126,
            0.75 * 2**-126 - 2**-160,
            0.75 * 2**-126,
            0.9 * 2**-126,
            1e-45,
            2.0**-149,
            1e-200,
            5e-324,
        ]
    )
    want = np.array(
        [
            2.0**-127,
            2.0**-127,
            2.0**-127,
            2.0**-126,
            2.0**-126,
            2.0**-127,
            2.0**-127,
            2.0**-127,
            2.0**-127,
        ]
    )
    _assert_bits_equal(_q(x, "e8m0"), want, x, "e8m0 float64 tiny")
    # float32 inputs follow the float32 bit pattern like ml_dtypes: above 2^-127 goes up.
    x32 = np.array([2.0**-127, 0.6 * 2**-126, 1e-45], dtype=np.float32)
    want32 = np.array([2.0**-127, 2.0**-126, 2.0**-127], dtype=np.float32)
    _assert_bits_equal(_q(x32, "e8m0"), want32, x32, "e8m0 float32 subnormal")
    _assert_bits_equal(_ml(x32, "e8m0"), want32, x32, "ml_dtypes e8m0 float32 subnormal")


@pytest.mark.parametrize("name", SHARED)
def test_to_bits_matches_ml_dtypes_codes(name: str) -> None:
    f = get_format(name)
    rng = np.random.default_rng(4000 + SHARED.index(name))
    x = np.concatenate(
        [
            _decoded(name),
            _ties(_finite_values(name)),
            _specials(name),
            _random_in_range(rng, f, 200_000),
        ]
    )
    x = x[~np.isnan(x)]
    got = to_bits(torch.from_numpy(x), name)
    assert got.dtype == torch.int64
    with _quiet():
        want = x.astype(ML_TYPES[name]).view(np.uint16 if f.total_bits > 8 else np.uint8)
    np.testing.assert_array_equal(got.numpy(), want.astype(np.int64))
    # float64 inputs give the same codes for the same values (E8M0 aside in float32's
    # subnormal range, where float32 follows its bit pattern: test_e8m0_float64_tiny_values).
    if name == "e8m0":
        keep = ~((np.abs(x) > 2.0**-127) & (np.abs(x) < 2.0**-126))
        x, got = x[keep], got[torch.from_numpy(keep)]
    np.testing.assert_array_equal(to_bits(torch.from_numpy(x.astype(np.float64)), name), got)


@pytest.mark.parametrize("name", SHARED)
def test_from_bits_matches_ml_dtypes_values(name: str) -> None:
    codes = _codes(name)
    want = _decoded(name)
    got = from_bits(torch.from_numpy(codes.astype(np.int64)), name)
    assert got.dtype == torch.float32
    _assert_bits_equal(got.numpy(), want, codes, f"{name} from_bits")
    got64 = from_bits(torch.from_numpy(codes.astype(np.int32)), name, dtype=torch.float64)
    with _quiet():
        want64 = want.astype(np.float64)
    _assert_bits_equal(got64.numpy(), want64, codes, f"{name} from_bits f64")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_to_bits_from_bits_round_trip(name: str) -> None:
    f = get_format(name)
    rng = np.random.default_rng(5000 + list(EXPECTED).index(name))
    x = np.concatenate(
        [_specials(name), _random_in_range(rng, f, 100_000), _random_bits32(rng, 100_000)]
    )
    if not f.has_nan:
        x = x[~np.isnan(x)]
    codes = to_bits(torch.from_numpy(x), name)
    assert int(codes.min()) >= 0 and int(codes.max()) < f.num_codes
    back = from_bits(codes, name).numpy()
    _assert_bits_equal(back, _q(x, name), x, f"{name} from_bits(to_bits(x))")


def test_nan_codes_follow_the_docstring() -> None:
    nan = torch.tensor([math.nan, -math.nan])
    signs = torch.signbit(nan).tolist()
    expected = {
        "e4m3fn": (0x7F, 0xFF),  # fn: all ones, with the input's sign
        "e5m2": (0x7E, 0xFE),  # ieee: all-ones exponent, top mantissa bit (quiet NaN)
        "fp16": (0x7E00, 0xFE00),
        "bf16": (0x7FC0, 0xFFC0),
        "e4m3fnuz": (0x80, 0x80),  # fnuz: the negative-zero code
        "e8m0": (0xFF, 0xFF),  # unsigned: all ones
    }
    for name, (pos, neg) in expected.items():
        got = to_bits(nan, name).tolist()
        assert got == [neg if s else pos for s in signs], name
        assert torch.isnan(from_bits(torch.tensor(got), name)).all()
        with _quiet():  # ml_dtypes picks the same NaN codes
            ml = nan.numpy().astype(ML_TYPES[name]).view(np.uint16 if pos > 255 else np.uint8)
        assert got == ml.tolist(), name


def test_fp32_and_tf32_codes_are_float32_bits() -> None:
    rng = np.random.default_rng(6)
    x = np.concatenate([_random_bits32(rng, 200_000), _specials("tf32")])
    x = x[~np.isnan(x)]
    np.testing.assert_array_equal(
        to_bits(torch.from_numpy(x), "fp32").numpy(), x.view(np.uint32).astype(np.int64)
    )
    q = _tf32_oracle(x)
    np.testing.assert_array_equal(
        to_bits(torch.from_numpy(x), "tf32").numpy(), (q.view(np.uint32) >> 13).astype(np.int64)
    )


def test_tf32_matches_numpy_oracle_float32() -> None:
    rng = np.random.default_rng(7)
    tf32 = get_format("tf32")
    # tf32 values from random patterns; their midpoints are those patterns with bit 12 set.
    grid = rng.integers(0, 2**32, 100_000, dtype=np.uint32) & np.uint32(0xFFFFE000)
    mids = grid | np.uint32(0x1000)
    ties = np.concatenate([mids, mids + 1, mids - 1]).view(np.float32)
    x = np.concatenate(
        [
            _random_bits32(rng, N_RANDOM),
            _random_in_range(rng, tf32, N_RANDOM),
            ties,
            _specials("tf32"),
        ]
    )
    _assert_bits_equal(_q(x, "tf32"), _tf32_oracle(x), x, "tf32 float32 input")


def test_tf32_float64_input_rounds_once() -> None:
    rng = np.random.default_rng(8)
    tf32 = get_format("tf32")
    x = np.concatenate(
        [
            rng.integers(0, 2**64, 300_000, dtype=np.uint64).view(np.float64),
            np.exp2(rng.uniform(-140, 129, 300_000)) * rng.choice([-1.0, 1.0], 300_000),
            np.array([1 + 2.0**-11 + 2.0**-40, 1 + 2.0**-11, tf32.max + 2.0**116, 1e300, 1e-300]),
        ]
    )
    _assert_bits_equal(_q(x, "tf32"), _tf32_oracle(x), x, "tf32 float64 input")
    assert _q(np.array([1 + 2.0**-11 + 2.0**-40]), "tf32")[0] == 1 + 2.0**-10  # trap


def test_fp32_of_float64_matches_numpy_cast() -> None:
    rng = np.random.default_rng(9)
    v = _random_bits32(rng, 200_000)
    v = v[np.abs(v) < np.finfo(np.float32).max]
    w = np.nextafter(v, np.float32(np.inf))  # adjacent float32 pairs (v, w)
    mid = (v.astype(np.float64) + w.astype(np.float64)) / 2  # their ties, exact in float64
    x = np.concatenate(
        [
            rng.integers(0, 2**64, 300_000, dtype=np.uint64).view(np.float64),
            np.exp2(rng.uniform(-152, 129, 300_000)) * rng.choice([-1.0, 1.0], 300_000),
            mid,
            np.nextafter(mid, np.inf),
            np.nextafter(mid, -np.inf),
            np.array(
                [3.4028235677973366e38, 3.4028235677973362e38, 2.0**-150, 2.0**-150 + 2**-200]
            ),
        ]
    )
    with _quiet():
        want = x.astype(np.float32).astype(np.float64)
    _assert_bits_equal(_q(x, "fp32"), want, x, "fp32 from float64")


def test_fp32_of_float32_is_identity() -> None:
    x = _random_bits32(np.random.default_rng(10), 100_000)
    _assert_bits_equal(_q(x, "fp32"), x, x, "fp32 of float32")


# ---------------------------------------------------------------------------------------
# 4. Saturation and the special-value table
# ---------------------------------------------------------------------------------------


def _table_row(f: Format) -> dict[str, float]:
    """The module docstring's table for positive inputs: what overflow, Inf, NaN and -0 give."""
    if not f.signed:  # E8M0: only positive powers of two
        return {"over": math.nan, "over_sat": f.max, "inf": math.nan, "neg_zero": math.nan}
    over = {"ieee": math.inf, "fn": math.nan, "fnuz": math.nan, "finite": f.max}[f.special]
    inf = {"ieee": math.inf, "fn": math.nan, "fnuz": math.nan, "finite": f.max}[f.special]
    neg_zero = 0.0 if f.special == "fnuz" else -0.0
    return {"over": over, "over_sat": f.max, "inf": inf, "neg_zero": neg_zero}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_overflow_inf_nan_zero_table(name: str) -> None:
    f = get_format(name)
    row = _table_row(f)
    half_ulp = 2.0 ** (f.max_exponent - f.mantissa_bits - 1)
    over = np.array([np.nextafter(f.max + half_ulp, np.inf), 2 * f.max, 1e300])
    for dtype in (np.float64, np.float32):
        with _quiet():
            xo = over.astype(dtype)
        xo = xo[np.isfinite(xo) & (xo.astype(np.float64) > f.max + half_ulp)]
        for s in (1.0, -1.0):
            for saturate in (False, True):
                want = row["over_sat" if saturate else "over"]
                if s < 0:
                    want = -want if f.signed else math.nan
                got = _q(s * xo, name, saturate=saturate)
                _assert_bits_equal(got, np.full_like(xo, want), s * xo, f"{name} overflow")
                x_inf = np.array([s * np.inf], dtype=dtype)
                want_inf = row["inf"] * s if f.signed else (row["inf"] if s > 0 else math.nan)
                _assert_bits_equal(
                    _q(x_inf, name, saturate=saturate),
                    np.array([want_inf], dtype=dtype),
                    x_inf,
                    f"{name} Inf",
                )
        x_special = np.array([np.nan, -np.nan, -0.0, -f.min_subnormal / 4], dtype=dtype)
        got = _q(x_special, name)
        assert np.isnan(got[:2]).all()
        _assert_bits_equal(
            got[2:],
            np.array([row["neg_zero"]] * 2, dtype=dtype),
            x_special[2:],
            f"{name} -0 and tiny negative",
        )
        if not f.signed:
            assert np.isnan(_q(np.array([0.0, -1.0], dtype=dtype), name)).all()


@pytest.mark.parametrize("name", list(EXPECTED))
def test_saturate_only_changes_finite_overflow(name: str) -> None:
    f = get_format(name)
    rng = np.random.default_rng(11)
    x = np.concatenate([_random_in_range(rng, f, 50_000), _specials(name)])
    plain, sat = _q(x, name), _q(x, name, saturate=True)
    finite_over = np.isfinite(x) & (np.isinf(plain) | np.isnan(plain)) & ~np.isnan(x)
    if f.special == "finite":
        finite_over[:] = False  # finite formats saturate anyway
    if not f.signed:
        finite_over &= x > 0
    _assert_bits_equal(
        sat[~finite_over], plain[~finite_over], x[~finite_over], f"{name} saturate elsewhere"
    )
    np.testing.assert_array_equal(sat[finite_over], np.sign(x[finite_over]) * np.float32(f.max))
    assert np.abs(sat[np.isfinite(sat)]).max() <= f.max
    codes = to_bits(torch.from_numpy(x[finite_over]), name, saturate=True)
    max_codes = to_bits(torch.from_numpy(sat[finite_over]), name)
    assert torch.equal(codes, max_codes)


@pytest.mark.parametrize("name", ["fp16", "bf16", "e4m3fn", "e5m2", "e4m3fnuz"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["eager", "eager-large", "compiled"])
def test_saturate_from_an_input_dtype_that_cannot_hold_the_max(
    name: str, in_dtype: torch.dtype, path: str
) -> None:
    """saturate=True from a 16-bit input: a finite value beyond ±max becomes ±max in the
    format (ml_dtypes on the value clamped in float64), and quantize casts that back to
    the input's dtype with round to nearest-even. bf16 cannot hold fp16's max 65504: a
    clamp in bf16 gave 65536, which the fp16 cast made Inf, with or without saturate."""
    f = get_format(name)
    big = float(torch.finfo(in_dtype).max)
    vals = [f.max * 0.99, f.max, f.max * 1.001, f.max * 1.5, f.max * 7, 1.0, -2 * f.max]
    x = torch.tensor([v for v in vals if abs(v) <= big] + [big, -big]).to(in_dtype)
    if path == "eager-large":  # the compiled eager kernels' size
        x = x.repeat(1 << 15)
    clamped = x.double().clamp(-f.max, f.max).float().numpy()
    want = torch.from_numpy(clamped.astype(ML_TYPES[name]).astype(np.float32))
    if path == "compiled":
        torch._dynamo.reset()  # (one code object, compiled per case: the recompile limit)
    q = torch.compile(quantize, fullgraph=True) if path == "compiled" else quantize
    got = q(x, name, saturate=True)
    assert got.dtype == in_dtype
    assert torch.equal(got, want.to(in_dtype)), (got[:9], want[:9])
    if path != "compiled":
        assert torch.equal(to_format(x, name, saturate=True).float(), want)


# ---------------------------------------------------------------------------------------
# 5. Stochastic rounding
# ---------------------------------------------------------------------------------------

STOCHASTIC_FORMATS = ("e4m3fn", "e5m2", "bf16", "fp16", "e2m1")
N_SR = 1_000_000


def _sr_point(name: str, region: str) -> tuple[float, float, float]:
    """(lo, x, hi): x (a float32) strictly between adjacent representable lo < hi."""
    f = get_format(name)
    if region == "normal":
        lo = 1.5
        hi = 2.0 if name == "e2m1" else 1.5 + f.epsilon
    else:  # subnormal: between the two smallest positive values
        lo, hi = f.min_subnormal, 2 * f.min_subnormal
    x = float(np.float32(lo + 0.3 * (hi - lo)))
    assert lo < x < hi
    if region == "subnormal":
        assert x < f.min_normal
    return lo, x, hi


@pytest.mark.parametrize("region", ["normal", "subnormal"])
@pytest.mark.parametrize("name", STOCHASTIC_FORMATS)
def test_stochastic_rounding_neighbours_and_unbiased(name: str, region: str) -> None:
    lo, xv, hi = _sr_point(name, region)
    x = torch.full((2 * N_SR,), xv)
    x[N_SR:] = -xv
    g = torch.Generator().manual_seed(1234)
    q = quantize(x, name, rounding="stochastic", generator=g).double()
    pos, neg = q[:N_SR], q[N_SR:]
    assert bool(((pos == lo) | (pos == hi)).all())
    assert bool(((neg == -lo) | (neg == -hi)).all())
    p = (xv - lo) / (hi - lo)
    # Mean of N Bernoulli(p) draws scaled by the gap: standard error gap*sqrt(p(1-p)/N);
    # 4 standard errors (fails with probability 6e-5 for an unbiased rounder). In the
    # subnormal range P(up) is quantised to 2^-23, a bias of at most 2^-23 * gap more.
    tol = 4 * (hi - lo) * math.sqrt(p * (1 - p) / N_SR) + 2.0**-23 * (hi - lo)
    assert abs(float(pos.mean()) - xv) <= tol
    assert abs(float(neg.mean()) + xv) <= tol
    # Both neighbours occur in about the right share (same 4-sigma reasoning, in counts).
    share = float((pos == hi).double().mean())
    assert abs(share - p) <= 4 * math.sqrt(p * (1 - p) / N_SR) + 2.0**-23


@pytest.mark.parametrize("name", STOCHASTIC_FORMATS)
def test_stochastic_rounding_random_inputs_stay_between_neighbours(name: str) -> None:
    f = get_format(name)
    rng = np.random.default_rng(12)
    x = _random_in_range(rng, f, 200_000)
    x = x[np.abs(x) < f.max]  # no overflow: the neighbours are both finite
    values = _finite_values(name)
    q = (
        quantize(
            torch.from_numpy(x),
            name,
            rounding="stochastic",
            generator=torch.Generator().manual_seed(5),
        )
        .numpy()
        .astype(np.float64)
    )
    x64 = x.astype(np.float64)
    i = np.searchsorted(values, x64, side="right")
    lo, hi = values[i - 1], values[np.minimum(i, values.size - 1)]
    assert np.all((q == lo) | (q == hi))
    exact = lo == x64
    assert np.array_equal(q[exact], x64[exact])  # representable values never move
    # Also float16 input for the float8 / e2m1 formats (float16 can carry their rounding).
    if name in ("e4m3fn", "e5m2", "e2m1"):
        x16 = x.astype(np.float16)
        x16 = x16[np.abs(x16) < f.max]
        q16 = quantize(torch.from_numpy(x16), name, rounding="stochastic").numpy()
        x16_64 = x16.astype(np.float64)
        i = np.searchsorted(values, x16_64, side="right")
        lo, hi = values[i - 1], values[np.minimum(i, values.size - 1)]
        assert np.all((q16 == lo) | (q16 == hi))


@pytest.mark.parametrize("name", STOCHASTIC_FORMATS)
def test_stochastic_rounding_keeps_representable_values(name: str) -> None:
    """P(up) is 0 for a representable value: not one of ~1e6 draws may move it."""
    values = _finite_values(name).astype(np.float32)
    x = np.resize(values, max(N_SR, values.size))
    q = quantize(
        torch.from_numpy(x),
        name,
        rounding="stochastic",
        generator=torch.Generator().manual_seed(11),
    ).numpy()
    _assert_bits_equal(q, x, x, f"{name} stochastic rounding of format values")


def test_stochastic_rounding_reproducible_with_generator() -> None:
    x = torch.from_numpy(_random_in_range(np.random.default_rng(13), get_format("e4m3fn"), 100_000))
    a = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    c = quantize(x, "e4m3fn", rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert not torch.equal(a, c)
    # Most inputs are not representable, so about half of them round differently.
    assert int((a != c).sum()) > 10_000


def test_stochastic_float64_into_fp32_unbiased() -> None:
    xv = 1.0 + 0.25 * 2.0**-23  # between float32 1 and 1 + 2^-23
    q = quantize(
        torch.full((N_SR,), xv, dtype=torch.float64),
        "fp32",
        rounding="stochastic",
        generator=torch.Generator().manual_seed(3),
    )
    assert bool(((q == 1.0) | (q == 1.0 + 2.0**-23)).all())
    # 4 standard errors of a Bernoulli(0.25) mean, scaled by the gap 2^-23.
    assert abs(float(q.mean()) - xv) <= 4 * 2.0**-23 * math.sqrt(0.25 * 0.75 / N_SR)


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (torch.float16, "fp16"),
        (torch.float16, "bf16"),
        (torch.bfloat16, "fp16"),
        (torch.bfloat16, "bf16"),
        (torch.float32, "fp32"),
        (torch.bfloat16, "tf32"),
        (torch.float16, "e8m0"),
    ],
)
def test_stochastic_rejects_dtype_that_cannot_carry_it(dtype: torch.dtype, name: str) -> None:
    with pytest.raises(ValueError, match="stochastic"):
        quantize(torch.ones(4, dtype=dtype), name, rounding="stochastic")


def test_stochastic_not_defined_for_e8m0() -> None:
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(ValueError, match="e8m0"):
            quantize(torch.ones(4, dtype=dtype), "e8m0", rounding="stochastic")


# ---------------------------------------------------------------------------------------
# 6. Property tests
# ---------------------------------------------------------------------------------------


@st.composite
def _formats(draw: st.DrawFn) -> Format:
    if draw(st.booleans()):
        return get_format(draw(st.sampled_from(format_names())))
    e = draw(st.integers(2, 8))
    m = draw(st.integers(0, 10))
    special = draw(st.sampled_from(["ieee", "fn", "fnuz", "finite", "unsigned"]))
    try:
        if special == "unsigned":
            return Format(e, 0, special="fn", signed=False)
        return Format(e, m, special=special)  # type: ignore[arg-type]
    except ValueError:  # e.g. e8m5 'fn' or 'finite' would exceed float32's range
        reject()


@st.composite
def _format_and_inputs(draw: st.DrawFn) -> tuple[Format, np.ndarray]:
    f = draw(_formats())
    top = min(2.5 * f.max, float(np.finfo(np.float32).max))
    listed = draw(
        st.lists(
            st.one_of(
                st.floats(width=32),
                st.floats(-top, top, width=32),
                st.floats(-4 * f.min_normal, 4 * f.min_normal, width=32),
            ),
            min_size=1,
            max_size=40,
        )
    )
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = np.concatenate(
        [np.array(listed, dtype=np.float32), _random_in_range(rng, f, 500), _specials(f)]
    )
    return f, x


PROPERTY_SETTINGS = settings(max_examples=120, deadline=None)


@PROPERTY_SETTINGS
@given(_format_and_inputs())
def test_property_idempotent(case: tuple[Format, np.ndarray]) -> None:
    f, x = case
    for saturate in (False, True):
        q = _q(x, f, saturate=saturate)
        _assert_bits_equal(_q(q, f, saturate=saturate), q, x, f"{f.name} q(q(x))")


@PROPERTY_SETTINGS
@given(_format_and_inputs())
def test_property_monotonic(case: tuple[Format, np.ndarray]) -> None:
    f, x = case
    x = np.sort(x[~np.isnan(x)])
    for saturate in (False, True):
        q = _q(x, f, saturate=saturate)
        ok = ~np.isnan(q)  # NaN results (overflow in fn/fnuz, E8M0 <= 0) are unordered
        xs, qs = x[ok], q[ok]
        bad = np.flatnonzero(qs[1:] < qs[:-1])
        assert bad.size == 0, (
            f"{f.name} saturate={saturate}: x {xs[bad[0]]!r} -> "
            f"{qs[bad[0]]!r} but x {xs[bad[0] + 1]!r} -> {qs[bad[0] + 1]!r}"
        )


@PROPERTY_SETTINGS
@given(_format_and_inputs())
def test_property_sign_symmetric(case: tuple[Format, np.ndarray]) -> None:
    f, x = case
    if not f.signed:  # E8M0-style: negative inputs are NaN
        assert np.isnan(_q(-np.abs(x), f)).all()
        return
    a, b = _q(-x, f), -_q(x, f)
    if f.special == "fnuz":  # no negative zero: both are +0
        zero = (a == 0) & (b == 0)
        assert not np.signbit(a[zero]).any()
        a, b = a[~zero], b[~zero]
        x = (-x)[~zero]
    _assert_bits_equal(a, b, x, f"{f.name} q(-x) == -q(x)")


@PROPERTY_SETTINGS
@given(_format_and_inputs())
def test_property_representable(case: tuple[Format, np.ndarray]) -> None:
    f, x = case
    if not f.has_nan:
        x = x[~np.isnan(x)]
    q = _q(x, f)
    if not f.has_nan:  # without a NaN code, only a NaN input may give NaN
        assert not np.isnan(q).any(), f.name
    codes = to_bits(torch.from_numpy(x), f)
    assert int(codes.min()) >= 0 and int(codes.max()) < f.num_codes
    _assert_bits_equal(from_bits(codes, f).numpy(), q, x, f"{f.name} from_bits(to_bits(x))")
    if f.total_bits <= 12:  # small formats: q is one of the format's values
        all_values = from_bits(torch.arange(f.num_codes), f).numpy()
        assert np.isin(q[~np.isnan(q)], all_values).all()


@PROPERTY_SETTINGS
@given(_format_and_inputs())
def test_property_matches_numpy_definition(case: tuple[Format, np.ndarray]) -> None:
    """Any signed eXmY format against _np_round, written from the module docstring."""
    f, x = case
    if not f.signed:
        return
    for saturate in (False, True):
        _assert_bits_equal(
            _q(x, f, saturate=saturate),
            _np_round(x, f, saturate),
            x,
            f"{f.name} saturate={saturate} vs numpy definition",
        )


@PROPERTY_SETTINGS
@given(_format_and_inputs())
def test_property_float32_and_float64_inputs_agree(case: tuple[Format, np.ndarray]) -> None:
    """A float32 value rounds the same when carried in float64 (float64 has no subnormals
    in this range, so this catches float32-subnormal slips; E8M0-style formats follow the
    float32 bit pattern there on purpose: test_e8m0_float64_tiny_values)."""
    f, x = case
    if not f.signed:
        x = x[~((np.abs(x) > f.min_normal) & (np.abs(x) < 2.0**-126))]
    with _quiet():  # widening float32 signalling NaNs warns
        q32 = _q(x, f).astype(np.float64)
    q64 = _q(x.astype(np.float64), f)
    _assert_bits_equal(q32, q64, x, f"{f.name} float32 vs float64 input")


@pytest.mark.parametrize("spec", ["e8m0fnuz", "e8m3fnuz", "e8m7fnuz", "e8m3b130", "e7m5b140"])
def test_formats_below_float32_normal_range(spec: str) -> None:
    """Regression: with bias >= 128 the format's normals include float32 subnormals, which
    the float32 bit rounding used to mis-round (2^-127 in e8m0fnuz gave 0)."""
    f = get_format(spec)
    assert f.min_normal < 2.0**-126
    values = from_bits(torch.arange(f.num_codes), f).numpy()
    values = values[~np.isnan(values)]
    _assert_bits_equal(_q(values, f), values, values, f"{spec} codes")
    rng = np.random.default_rng(18)
    x = _random_in_range(rng, f, 200_000)
    x = np.concatenate([x, _ties(np.unique(values.astype(np.float64))), _specials(f)])
    _assert_bits_equal(_q(x, f), _np_round(x, f), x, f"{spec} vs numpy definition")
    sr = quantize(torch.from_numpy(x[np.abs(x) < f.max]), f, rounding="stochastic").numpy()
    assert np.isin(sr, values).all()  # stochastic results are format values too


@pytest.mark.parametrize(
    ("spec", "x", "want"),
    [
        # M = 0: a tie between 2^e and 2^(e+1) goes to the even code (even exponent field).
        ("e4m0", [1.5, 3.0, 0.75, -1.5], [2.0, 2.0, 0.5, -2.0]),  # bias 7: 1 is field 7
        ("e4m0fnuz", [1.5, 3.0, 0.75, -1.5], [1.0, 4.0, 1.0, -1.0]),  # bias 8: 1 is field 8
        ("e3m0fn", [1.5, 6.0, 0.375], [2.0, 8.0, 0.5]),  # 0.375: field 1 (0.25) or 2 (0.5)
        # Between 0 and the smallest value the tie goes to 0.
        ("e4m0fnuz", [2.0**-8, -(2.0**-8)], [0.0, 0.0]),
    ],
)
def test_ties_without_mantissa_bits_go_to_even_code(
    spec: str, x: list[float], want: list[float]
) -> None:
    f = get_format(spec)
    got = quantize(torch.tensor(x), f)
    assert got.tolist() == want
    assert all(c % 2 == 0 for c in to_bits(torch.tensor(x), f).tolist())
    assert quantize(torch.tensor(x, dtype=torch.float64), f).tolist() == want


def test_format_without_nan_code_refuses_nan() -> None:
    # An 'ieee' format with no mantissa bits has Inf but no NaN code (bug fixed: to_bits
    # used to encode NaN as Inf).
    f = Format(5, 0)
    assert not f.has_nan and f.has_inf
    assert torch.isnan(quantize(torch.tensor([math.nan]), f)).all()
    with pytest.raises(ValueError, match="NaN"):
        to_bits(torch.tensor([math.nan]), f)
    assert from_bits(to_bits(torch.tensor([math.inf]), f), f).tolist() == [math.inf]


# ---------------------------------------------------------------------------------------
# 7. torch.compile
# ---------------------------------------------------------------------------------------

COMPILE_NATIVE = ("e4m3fn", "e5m2", "fp16", "bf16")
COMPILE_BITWISE = ("e4m3", "e2m1", "e3m2", "e8m0", "e4m3b11fnuz")


def _compile_inputs() -> np.ndarray:
    rng = np.random.default_rng(14)
    return np.concatenate(
        [
            _random_bits32(rng, 40_000),
            (np.exp2(rng.uniform(-140, 128, 60_000)) * rng.choice([-1.0, 1.0], 60_000)).astype(
                np.float32
            ),
            *[_specials(n) for n in COMPILE_NATIVE + COMPILE_BITWISE],
            *[_ties(_finite_values(n)) for n in (*COMPILE_BITWISE, "e4m3fn", "e5m2")],
        ]
    )


def _all_formats_fn(names: tuple[str, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        # to_format(...).float() checks that a cast round trip inside the graph still rounds.
        return torch.stack(
            [quantize(x, n, saturate=s) for n in names for s in (False, True)]
            + [to_format(x, n).float() for n in names]
        )

    return fn


@pytest.mark.slow
@pytest.mark.parametrize("names", [COMPILE_NATIVE, COMPILE_BITWISE], ids=["native", "bitwise"])
def test_compile_matches_eager(names: tuple[str, ...]) -> None:
    torch._dynamo.reset()
    x = torch.from_numpy(_compile_inputs())
    fn = _all_formats_fn(names)
    eager = fn(x).numpy()
    compiled = torch.compile(fn, fullgraph=True)(x).numpy()
    x_rows = np.broadcast_to(x.numpy(), eager.shape)
    _assert_bits_equal(compiled, eager, x_rows, f"compiled {names}")


@pytest.mark.slow
def test_compile_stochastic_rounding() -> None:
    """``generator=`` is not traceable by dynamo (torch 2.13: 'Failed to convert args/kwargs
    to proxy'), so the compiled case draws from torch's global RNG: checked for the neighbour
    property, unbiasedness and reproducibility under torch.manual_seed."""
    torch._dynamo.reset()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return quantize(x, "e4m3fn", rounding="stochastic")

    cfn = torch.compile(fn, fullgraph=True)
    values = _finite_values("e4m3fn")
    rng = np.random.default_rng(15)
    xr = _random_in_range(rng, get_format("e4m3fn"), 100_000)
    xr = xr[np.abs(xr) < 448]
    xv = float(np.float32(1.5 + 0.3 * 0.125))  # between 1.5 and 1.625
    x = torch.cat([torch.from_numpy(xr), torch.full((N_SR,), xv)])
    torch.manual_seed(0)
    q1 = cfn(x)
    torch.manual_seed(0)
    q2 = cfn(x)
    assert torch.equal(q1, q2)
    q = q1.numpy().astype(np.float64)
    x64 = x.numpy().astype(np.float64)
    i = np.searchsorted(values, x64, side="right")
    lo, hi = values[i - 1], values[np.minimum(i, values.size - 1)]
    assert np.all((q == lo) | (q == hi))
    p = 0.3
    # 4 standard errors of N Bernoulli(p) draws, times the gap 0.125.
    assert abs(q[xr.size :].mean() - xv) <= 4 * 0.125 * math.sqrt(p * (1 - p) / N_SR)


# ---------------------------------------------------------------------------------------
# 8. Bad input
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor([1, 2]),
        torch.tensor([True]),
        torch.tensor([1 + 2j]),
        torch.tensor([1], dtype=torch.uint8),
    ],
    ids=["int", "bool", "complex", "uint8"],
)
def test_quantize_rejects_non_float_tensors(x: torch.Tensor) -> None:
    for func in (quantize, to_bits):
        with pytest.raises(TypeError, match="x"):
            func(x, "e4m3fn")
    with pytest.raises(TypeError, match="x"):
        snr_db(x, "fp16")


@pytest.mark.parametrize(
    "x", [[1.0, 2.0], 1.0, np.ones(3, dtype=np.float32)], ids=["list", "float", "ndarray"]
)
def test_quantize_rejects_non_tensors(x: object) -> None:
    for func in (quantize, to_bits, snr_db):
        with pytest.raises(TypeError, match=r"torch\.Tensor"):
            func(x, "e4m3fn")  # type: ignore[operator]


def test_quantize_rejects_bad_options() -> None:
    x = torch.ones(3)
    with pytest.raises(ValueError, match="rounding"):
        quantize(x, "e4m3fn", rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rounding"):
        quantize(x, "e4m3fn", rounding="Nearest")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generator"):
        quantize(x, "e4m3fn", rounding="stochastic", generator=7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp7"):
        quantize(x, "fp7")


def test_from_bits_rejects_bad_codes() -> None:
    for codes in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1j])):
        with pytest.raises(TypeError, match="codes"):
            from_bits(codes, "e4m3fn")
    with pytest.raises(TypeError, match="codes"):
        from_bits([1, 2], "e4m3fn")  # type: ignore[arg-type]
    for name, bad in (("e4m3fn", 256), ("e4m3fn", -1), ("e2m1", 16), ("e3m2", 64), ("fp16", 65536)):
        with pytest.raises(ValueError, match="codes"):
            from_bits(torch.tensor([0, bad]), name)
    assert from_bits(torch.tensor([], dtype=torch.int64), "e2m1").numel() == 0


def test_to_bits_rejects_nan_without_nan_code() -> None:
    with pytest.raises(ValueError, match="x"):
        to_bits(torch.tensor([1.0, math.nan]), "e2m1")
    assert to_bits(torch.tensor([1.0, 7.0]), "e2m1").tolist() == [2, 7]  # 7 saturates to 6


# ---------------------------------------------------------------------------------------
# 9. snr_db
# ---------------------------------------------------------------------------------------


def test_snr_db_unit_normal_fp16_matches_float64_computation() -> None:
    x = np.random.default_rng(16).standard_normal(200_000)
    q = x.astype(np.float16).astype(np.float64)  # numpy rounds float64 -> float16 once
    want = 10 * math.log10(float(np.sum(x**2)) / float(np.sum((x - q) ** 2)))
    got = snr_db(torch.from_numpy(x), "fp16")
    # Same sums in another summation order: float64 rounding differences ~1e-12 relative.
    assert got == pytest.approx(want, rel=1e-9)
    # fp16 keeps 11 significant bits: about 6.02 dB per bit plus a few dB (74 dB here).
    assert 70 < got < 78
    # float32 input gives the same number (it is computed in float64 from the same values).
    x32 = torch.from_numpy(x.astype(np.float32))
    q32 = x.astype(np.float32).astype(np.float16).astype(np.float64)
    x32_64 = x.astype(np.float32).astype(np.float64)
    want32 = 10 * math.log10(np.sum(x32_64**2) / np.sum((x32_64 - q32) ** 2))
    assert snr_db(x32, "fp16") == pytest.approx(want32, rel=1e-9)  # same reason


def test_snr_db_edge_cases() -> None:
    exact = from_bits(torch.arange(127), "e4m3fn")  # every finite non-negative value
    assert snr_db(exact, "e4m3fn") == math.inf
    assert snr_db(torch.tensor([1.0, -2.0, 0.5]), "fp16") == math.inf
    overflow = torch.tensor([1e6, -2e6, 7e4])
    assert snr_db(overflow, "fp16") == 0.0  # Inf results: the whole signal is lost
    assert snr_db(overflow, "e4m3fn") == 0.0  # NaN results count the same
    assert snr_db(torch.tensor([1e-10, -3e-12]), "e4m3fn") == 0.0  # all flushed to zero
    # Saturated: the error is x - max.
    want = 10 * math.log10(1e12 / (1e6 - 65504) ** 2)
    # Direct formula in float64; only log10 / division rounding (~1e-15 relative).
    assert snr_db(torch.tensor([1e6]), "fp16", saturate=True) == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------
# to_format / storage_dtype and the docstring examples
# ---------------------------------------------------------------------------------------


def test_storage_dtype() -> None:
    expected = {
        "fp32": torch.float32,
        "tf32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "e4m3fn": torch.float8_e4m3fn,
        "e5m2": torch.float8_e5m2,
        "e4m3fnuz": torch.float8_e4m3fnuz,
        "e5m2fnuz": torch.float8_e5m2fnuz,
        "e4m3": torch.bfloat16,
        "e3m4": torch.bfloat16,
        "e4m3b11fnuz": torch.bfloat16,
        "e3m2": torch.bfloat16,
        "e2m3": torch.bfloat16,
        "e2m1": torch.bfloat16,
        "e8m0": E8M0_DTYPE or torch.bfloat16,
        "e6m9": torch.float32,
        "e5m9": torch.float16,
    }
    for name, dtype in expected.items():
        assert storage_dtype(name) == dtype, name


@pytest.mark.parametrize("name", list(EXPECTED))
def test_to_format_equals_quantize(name: str) -> None:
    f = get_format(name)
    x = np.concatenate([_specials(name), _random_in_range(np.random.default_rng(17), f, 20_000)])
    if not f.has_nan:
        x = x[~np.isnan(x)]
    xt = torch.from_numpy(x)
    for saturate in (False, True):
        y = to_format(xt, name, saturate=saturate)
        assert y.dtype == storage_dtype(name)
        _assert_bits_equal(
            y.float().numpy(), _q(x, name, saturate=saturate), x, f"{name} to_format"
        )


def test_docstring_examples() -> None:
    # formats.py was split into formats (Format), rounding (quantize), codes (to_bits) and bits.
    attempted = 0
    for module in (formats_module, rounding_module, codes_module, bits_module):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0
        attempted += result.attempted
    assert attempted > 0


def test_custom_finite_format_has_its_own_name() -> None:
    """A custom format without Inf/NaN must not share a name with the 'fn' format."""
    f = Format(4, 3, special="finite")
    assert f.name == "e4m3finite" and get_format("e4m3finite") == f
    assert get_format("e4m3fn") != f and get_format("e4m3fn").special == "fn"
    # e4m3 without NaN: the all-ones code is a number, 2^8 * 1.875 = 480.
    assert f.max == 480.0 and get_format("e2m1finite") is get_format("e2m1")


# ---- issue 14: float64 beyond float32's range, margins -------------------------------


@pytest.mark.parametrize("fn", ["quantize_scaled", "compute_scale", "mx_scale", "nv_scale", "amax"])
def test_float64_beyond_float32_range_is_refused(fn: str) -> None:
    from lowprec.core import scales
    from lowprec.core.tensor import quantize_scaled

    x = torch.tensor([1e300, 1.0], dtype=torch.float64)
    call = {
        "quantize_scaled": lambda: quantize_scaled(x, "e4m3fn"),
        "compute_scale": lambda: scales.compute_scale(x, "e4m3fn"),
        "mx_scale": lambda: scales.mx_scale(x, "e4m3fn"),
        "nv_scale": lambda: scales.nv_scale(x, "e2m1"),
        "amax": lambda: scales.amax(x),
    }[fn]
    with pytest.raises(ValueError, match=r"(x|amax): finite float64 magnitude 1e\+300"):
        call()


def test_float64_below_float32_range_is_reported_and_clamped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lowprec.core import scales
    from lowprec.core.tensor import quantize_scaled
    from lowprec.core.warn import reset_warnings

    tiny = torch.tensor([1e-300, -2e-300], dtype=torch.float64)
    # a float64 amax is used in float64: the scale is the clamp 2^-126 (not 1, as for 0)
    assert scales.compute_scale(tiny.abs().amax(), "e4m3fn").item() == 2.0**-126
    assert scales.mx_scale(tiny.abs().amax(), "e4m3fn").item() == 2.0**-127  # E8M0's least
    reset_warnings("scales:")
    with caplog.at_level("WARNING", logger="lowprec.core.scales"):
        q = quantize_scaled(tiny, "e4m3fn")
    assert torch.equal(q.dequantize(), torch.zeros(2, dtype=torch.float64))  # documented
    assert "below float32's normal range" in caplog.text


@pytest.mark.parametrize("margin", [-1e6, 1e6, 257.0, math.nan, math.inf])
def test_compute_scale_refuses_huge_margin(margin: float) -> None:
    from lowprec.core.scales import compute_scale

    with pytest.raises(ValueError, match="margin"):
        compute_scale(torch.tensor(1.0), "e4m3fn", margin=margin)


def test_compute_scale_extreme_margins_clamp() -> None:
    from lowprec.core.scales import compute_scale

    one = torch.tensor(448.0)
    assert compute_scale(one, "e4m3fn", margin=256).item() == 2.0**127
    assert compute_scale(one, "e4m3fn", margin=-256).item() == 2.0**-126
    assert compute_scale(one, "e4m3fn", margin=2.5).item() == pytest.approx(2.0**2.5, rel=2**-23)


@pytest.mark.parametrize("granularity", ["tensor", "row", "column", "mx", "nv", "block:1x32"])
@pytest.mark.parametrize("shape", [(4, 0), (0, 0)])
def test_quantize_scaled_of_zero_size_tensor(granularity: str, shape: tuple[int, ...]) -> None:
    """An empty group has amax 0 (scale 1): quantizing a zero-size tensor is a no-op."""
    from lowprec.core.tensor import quantize_scaled

    x = torch.empty(*shape)
    q = quantize_scaled(x, "e2m1" if granularity == "nv" else "e4m3fn", granularity=granularity)
    assert q.shape == x.shape and q.dequantize().shape == x.shape
    assert torch.isfinite(q.scale).all()
