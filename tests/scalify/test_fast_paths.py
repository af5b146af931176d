"""The eager fast paths of the scalify rules give bit-identical results to the general
(sync-free, compile-safe) paths they short-cut: the guard, saturation, the FP8 operand
rounding (with its cache of recent results) and the multiply by a number."""

from __future__ import annotations

import pytest
import torch

from lowprec.core import kernels
from lowprec.core.tensor import quantize_scaled
from lowprec.scalify import core, rules, rules_nn, scaled, unscale
from lowprec.scalify.config import config

# Magnitudes from float32's subnormals to near its max: the guard's power of two and the
# FP8 scale both come from the data's max, so every binade regime is covered.
EXPONENTS = [-140, -126, -60, -5, 0, 3, 5, 60, 120]


def _data(e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(67, 45, generator=g) * 2.0**e


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("e", EXPONENTS)
def test_guard_fast_path_matches_general(e: int, monkeypatch: pytest.MonkeyPatch) -> None:
    d, s = _data(e, e + 200), torch.tensor(0.75)
    fast = core.guard(d, s)
    monkeypatch.setattr(core, "compiling", lambda: True)  # the traced (general) path
    ref = core.guard(d, s)
    assert torch.equal(_bits(fast[0]), _bits(ref[0]))
    assert torch.equal(fast[1], ref[1]) and fast[1].dtype == ref[1].dtype


def test_guard_non_finite_takes_general_path() -> None:
    d = torch.tensor([1e-3, float("inf"), -2e-3, float("nan")])
    d_out, s_out = core.guard(d, torch.tensor(1.0))
    # largest finite |d| is 2e-3 < 2^-4: scaled up by 2^-9 (the power of two below it)
    assert torch.equal(d_out[[0, 2]], d[[0, 2]] / 2.0**-9)
    assert float(s_out) == 2.0**-9
    assert torch.isinf(d_out[1]) and torch.isnan(d_out[3])


@pytest.mark.parametrize("vals", [[1.0, -70000.0, 3.0], [1.0, float("-inf"), 2.0], [0.5, -0.25]])
def test_saturate_fast_path_matches_general(vals: list[float]) -> None:
    d = torch.tensor(vals)
    m = torch.finfo(torch.float16).max
    ref = torch.where(torch.isfinite(d), d.clamp(-m, m), d)
    assert torch.equal(core.saturate(d), ref)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("e", EXPONENTS)
def test_fp8_rounding_matches_quantize_scaled(fmt: str, e: int) -> None:
    d = _data(e, e + 400)
    ref = quantize_scaled(d, fmt, power_of_two=True).dequantize()
    fast = rules._fp8_eager(d, fmt)
    assert fast is not None
    assert torch.equal(_bits(fast), _bits(ref))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_fp8_rounding_kernel_matches_quantize_scaled(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused eager kernel (forced on these small tensors): amax, scale and rounding in
    one call, the quantize-dequantize's bits for every input, zeros of both signs,
    subnormals, Inf and NaN included (no host check, no fallback), transposed too."""
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "1")
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "1")
    special = _data(0, 7)
    special[0, :6] = torch.tensor([0.0, -0.0, 1e-45, -3e-39, float("inf"), float("nan")])
    inf = _data(3, 8)
    inf[5, 5] = float("-inf")
    cases = [_data(e, e + 900) for e in EXPONENTS] + [special, inf, torch.zeros(5, 7)]
    for d in [*cases, cases[3].t()]:
        ref = quantize_scaled(d.contiguous(), fmt, power_of_two=True).dequantize()
        got = rules._fp8_eager(d, fmt)
        assert got is not None and got.shape == d.shape
        nan = ref.isnan()
        assert torch.equal(got.contiguous().isnan(), nan)
        assert torch.equal(_bits(got)[~nan], _bits(ref)[~nan])
    assert not kernels._BROKEN, kernels._BROKEN


def test_fp8_cache_views_match_and_miss_after_change() -> None:
    """Views holding every element of their base (a transpose, a reshape) reuse the base's
    rounding; a partial view, or the same base after an in-place change, does not."""
    base = torch.randn(300, 260) * 7.0
    views = [base, base.t(), base.view(260, 300), base.view(3, 100, 260).transpose(1, 2)]
    for v in [*views, base[:, :100]]:
        for fmt in ("e4m3fn", "e5m2"):
            ref = quantize_scaled(v.contiguous(), fmt, power_of_two=True).dequantize()
            got = rules._fp8_cached(v, fmt)
            assert got is not None and torch.equal(got.contiguous(), ref)
    base.mul_(1000.0)  # bumps the version: the cached rounding must not be reused
    ref = quantize_scaled(base.t().contiguous(), "e4m3fn", power_of_two=True).dequantize()
    got = rules._fp8_cached(base.t(), "e4m3fn")
    assert got is not None and torch.equal(got.contiguous(), ref)


def test_times_number_keeps_data_and_folds_scale() -> None:
    """``x·c`` with ``|c|`` the chosen scale factor (pow2 "none") keeps the stored data
    (no rounding at all) and multiplies the scale; a one-element result keeps float32."""
    d = torch.randn(8, 8).half()
    x = scaled(d, 0.5)
    with config(data_format="fp16"):
        y = x * 0.3
        assert torch.equal(y.qdata, d) and float(y.scale) == pytest.approx(0.15, rel=1e-7)
        z = scaled(torch.tensor([3.0]).half(), 1.0) * 0.3
    assert z.qdata.dtype == torch.float32
    assert torch.equal(unscale(y), d.float() * (torch.tensor(0.5) * 0.3))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_fp8_rounding_traced_path_matches_quantize_scaled(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.compile on the CPU the FP8 operand rounding computes the values on the
    float32 bit pattern (no float8 cast): the same bits as the quantize-dequantize, across
    float32's range, with zeros of both signs, subnormals, Inf and NaN."""
    grad = fmt == "e5m2"
    cases = [_data(e, e + 600) for e in EXPONENTS]
    special = _data(0, 7)
    special[0, :6] = torch.tensor([0.0, -0.0, 1e-45, -3e-39, float("inf"), float("nan")])
    cases += [special, torch.zeros(5, 7)]
    monkeypatch.setattr(rules, "compiling", lambda: True)
    for d in cases:
        ref = quantize_scaled(d, fmt, power_of_two=True).dequantize()
        got = rules._fp8(d, torch.ones(()), grad)[0]
        nan = ref.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(_bits(got)[~nan], _bits(ref)[~nan])


@pytest.mark.slow
def test_fp8_rounding_compiled_matches_eager() -> None:
    """The same, through inductor's generated code."""
    torch._dynamo.reset()
    f = torch.compile(lambda d, g: rules._fp8(d, torch.ones(()), g)[0], fullgraph=True)
    for e in EXPONENTS:
        d = _data(e, e + 800)
        for grad in (False, True):
            assert torch.equal(_bits(f(d, grad)), _bits(rules._fp8(d, torch.ones(()), grad)[0]))


@pytest.mark.parametrize("op", ["cat", "stack"])
def test_cat_of_equal_scales_joins_the_stored_data(
    op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cat/stack of operands with one per-tensor scale keep their stored data (no upcast,
    no rounding): the bits and scale of the general path, which rounds ``d_i·s_i/s``."""
    g = torch.Generator().manual_seed(5)
    xs = [scaled(torch.randn(6, 7, generator=g).half(), 0.25) for _ in range(3)]
    xs[1].qdata[0, :3] = torch.tensor([float("inf"), -0.0, 65504.0]).half()
    fn = (lambda t: torch.cat(t, 1)) if op == "cat" else (lambda t: torch.stack(t, 0))
    fast = fn(xs)
    assert all(torch.equal(x.qdata, d) for x, d in zip(xs, fast.qdata.unbind(0), strict=True)) \
        if op == "stack" else torch.equal(fast.qdata[:, 7:14], xs[1].qdata)  # fmt: skip
    monkeypatch.setattr(core, "compiling", lambda: True)  # the general path
    monkeypatch.setattr(rules_nn, "fscale", lambda s: None)
    ref = fn(xs)
    assert torch.equal(fast.qdata.view(torch.int16), ref.qdata.view(torch.int16))
    assert torch.equal(fast.scale, ref.scale) and fast.dtype == ref.dtype
