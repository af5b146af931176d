"""The 1-byte float8 codes in integer arithmetic and the compiled eager kernels built on them.

``lowprec.core.bits.encode``/``decode`` must give torch's own cast bits (encode: the
saturating cast ``_cast_native``; decode: ``.to(float32/bfloat16)``, NaN payloads included),
eager and compiled; the kernels behind ``quantize_parts``, ``dequantize_parts`` and
``upcast`` (forced on small tensors here) must give the eager ops' payload bits, scales and
strides for every preset and layout. Exactness is the contract: every comparison is on
bit patterns.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from lowprec.core import bits, kernels, layout, rounding
from lowprec.core.formats import get_format
from lowprec.core.rounding import _cast_native
from lowprec.core.tensor import quantize_scaled
from tests._bits import cases, same, same_values

BYTE = [f.name for f in bits.BYTE_FORMATS]


def all_codes(fmt: str) -> Tensor:
    dt = bits.BYTE_FORMATS[get_format(fmt)]
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt)


def probe_values(fmt: str) -> Tensor:
    """Every finite value of ``fmt``, the midpoints between neighbours (ties) and the
    float32 numbers on either side of each midpoint, specials, and random values across
    the normal, subnormal and overflow ranges."""
    f = get_format(fmt)
    v = all_codes(fmt).float()
    grid = v[~torch.isnan(v) & ~torch.isinf(v)].double().unique()
    mid = ((grid[1:] + grid[:-1]) / 2).float()
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    g = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e-45, -1e-40, 3e38,
               -3e38, f.max * 1.0625, f.max * 1.125, -f.max * 1.2, 2 * f.max]  # fmt: skip
    return torch.cat([grid.float(), mid, mid.nextafter(up), mid.nextafter(down),
                      torch.tensor(special), torch.randn(1 << 16, generator=g) * f.max / 4,
                      torch.randn(1 << 16, generator=g) * f.min_normal,
                      (torch.rand(1 << 16, generator=g) - 0.5) * 3 * f.max])  # fmt: skip


@pytest.mark.parametrize("fmt", BYTE)
def test_encode_is_torchs_saturating_cast(fmt: str) -> None:
    f = get_format(fmt)
    x = probe_values(fmt)
    ref = _cast_native(x, f, bits.BYTE_FORMATS[f], saturate=True)
    got = bits.encode(x, f)
    assert got.dtype == ref.dtype
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("fmt", BYTE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_torchs_cast_bit_for_bit(fmt: str, dtype: torch.dtype) -> None:
    c = all_codes(fmt)
    assert same(bits.decode(c, get_format(fmt), dtype), c.to(dtype))


def test_codes_reject_other_formats() -> None:
    with pytest.raises(ValueError, match="fmt: e2m1 is not a 1-byte"):
        bits.encode(torch.ones(2), get_format("e2m1"))
    with pytest.raises(ValueError, match="dtype must be"):
        bits.decode(all_codes("e4m3fn"), get_format("e4m3fn"), torch.float16)


@pytest.mark.slow
def test_compiled_codes_are_bit_exact() -> None:
    """Inductor vectorises these functions; the generated code must keep every bit
    (rounding carries, ties, subnormals, saturation, NaN payloads)."""
    for fmt in ("e4m3fn", "e5m2", "e4m3fnuz"):
        f = get_format(fmt)
        enc = kernels._compile(lambda x, f=f: bits.encode(x, f))
        x = probe_values(fmt)
        ref = _cast_native(x, f, bits.BYTE_FORMATS[f], saturate=True)
        assert torch.equal(enc(x).view(torch.uint8), ref.view(torch.uint8)), fmt
        c = all_codes(fmt)
        for dt in (torch.float32, torch.bfloat16):
            dec = kernels._compile(lambda c, f=f, dt=dt: bits.decode(c, f, dt))
            assert same(dec(c), c.to(dt)), (fmt, dt)


@pytest.mark.parametrize("fmt", [*BYTE, "e2m1", "e3m2", "fp16", "bf16"])
@pytest.mark.parametrize("saturate", [False, True])
def test_round_bits_is_the_formats_rounding(fmt: str, saturate: bool) -> None:
    """round_bits (the bit-pattern rounding the fused kernels trace, for formats with a
    torch dtype too) against torch's own cast where there is one (``_cast_native``: the
    saturating or plain cast, read back in float32) and the reference rounding otherwise;
    signed zeros included, NaN where NaN."""
    f = get_format(fmt)
    x = probe_values(fmt if fmt in BYTE else "e4m3fn") * (1.0 if fmt in BYTE else f.max / 448)
    got = bits.round_bits(x, f, "nearest", saturate)
    if f.torch_dtype is not None:
        ref = _cast_native(x, f, f.torch_dtype, saturate).float()
    else:
        with layout.reference_paths():
            ref = rounding.quantize(x, f, saturate=saturate)
    assert same_values(got, ref)


@pytest.mark.slow
def test_kernels_of_one_function_keep_separate_caches() -> None:
    """Each kernel is compiled from its own code object: closures of one function for
    different formats must not share Dynamo's cache (nor its recompile limit)."""
    x = probe_values("e4m3fn")
    for fmt in ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "e4m3fn"):
        f = get_format(fmt)
        got = kernels.run_scaled_encode(x, torch.ones(()), f)
        assert got is not None and got.dtype == bits.BYTE_FORMATS[f]
        ref = _cast_native(x, f, bits.BYTE_FORMATS[f], saturate=True)
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), fmt


@pytest.mark.parametrize("fmt", BYTE)
def test_encode_without_saturation_is_torchs_cast(fmt: str) -> None:
    f = get_format(fmt)
    x = probe_values(fmt)
    ref = _cast_native(x, f, bits.BYTE_FORMATS[f], saturate=False)
    assert torch.equal(bits.encode(x, f, saturate=False).view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("saturate", [False, True])
def test_to_format_and_quantize_scaled_kernels(
    saturate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``to_format`` and ``quantize_scaled`` through the kernels: the eager bits, every
    layout and input dtype, with and without saturation."""
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "1")
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "1")
    for fmt in ("e4m3fn", "e5m2", "e4m3fnuz"):
        for name, x in cases():
            fast = rounding.to_format(x, fmt, saturate=saturate)
            with layout.reference_paths():
                ref = rounding.to_format(x, fmt, saturate=saturate)
            assert same(fast, ref) and fast.stride() == ref.stride(), (fmt, name)
            for g in ("tensor", "mx:8"):
                if g != "tensor" and x.shape[-1] % 8:
                    continue
                sf = quantize_scaled(x, fmt, granularity=g, saturate=saturate)
                with layout.reference_paths():
                    sr = quantize_scaled(x, fmt, granularity=g, saturate=saturate)
                assert same(sf.qdata, sr.qdata) and same(sf.scale, sr.scale), (fmt, name, g)
    assert not kernels._BROKEN, kernels._BROKEN


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_round_trip_kernel(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_round_trip`` (scalify's FP8 matmul-input rounding) against the eager divide,
    saturating cast, upcast and multiply, for a power-of-two and an arbitrary scale."""
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "1")
    f = get_format(fmt)
    v = probe_values(fmt)
    x = v[: v.numel() // 4 * 4].view(-1, 4)
    for s in (torch.tensor(2.0**-3), torch.tensor(0.3)):
        got = kernels.run_round_trip(x, s, f)
        assert got is not None
        ref = _cast_native(x / s, f, bits.BYTE_FORMATS[f], saturate=True).float() * s
        assert same_values(got, ref), (fmt, float(s))
        got_t = kernels.run_round_trip(x.t(), s, f)
        assert got_t is not None and same_values(got_t, ref.t()) and got_t.stride() == (1, 4)


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3fn", "e5m2", "e3m2"])
def test_stochastic_kernel_takes_the_eager_draws(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stochastic ``quantize`` through the compiled kernel: the bits of the eager bit path
    with the same generator, which ends in the same state (the draws are taken eagerly,
    once); every input dtype, saturating or not, on the probe values (ties, specials,
    subnormals, overflow) and on a transposed (non-contiguous) input, which rounds eagerly
    with the draws already taken."""
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "1")
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "1")
    f = get_format(fmt)
    v = probe_values("e4m3fn")  # the ties of one grid, specials, wide random values
    v = v[: v.numel() // 8 * 8].view(-1, 8) * (f.max / 448)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        if dtype == torch.float16 and fmt == "e5m2":
            continue  # fp16 cannot carry stochastic rounding into e5m2 (same subnormals)
        for x in (v.to(dtype), v.to(dtype).t()):
            for saturate in (False, True):
                g1 = torch.Generator().manual_seed(3)
                g2 = torch.Generator().manual_seed(3)
                got = rounding.quantize(x, fmt, "stochastic", saturate, generator=g1)
                with layout.reference_paths():
                    ref = rounding.quantize(x, fmt, "stochastic", saturate, generator=g2)
                assert same(got, ref), (fmt, dtype, saturate, x.is_contiguous())
                assert torch.equal(g1.get_state(), g2.get_state())
    assert kernels._CACHE.get(("quantize-sr", f.name, True, torch.float32, "cpu")) is not None
    assert not kernels._BROKEN, kernels._BROKEN


def test_counter_draws_kernel_eager_and_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """``quantize(..., seed=k)``: the compiled kernel gives the eager bits; the draws of a
    slice of the element indices are the whole tensor's (a shard draws what its elements
    draw in the whole); other seeds give other roundings; bad arguments are refused."""
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "1")
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "1")
    v = probe_values("e4m3fn")
    v = v[: v.numel() // 8 * 8].view(-1, 8)
    for fmt in ("e2m1", "e4m3fn", "e3m2"):
        for saturate in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                x = v.to(dtype)
                got = rounding.quantize(x, fmt, "stochastic", saturate, seed=2**40 + 3)
                with layout.reference_paths():
                    ref = rounding.quantize(x, fmt, "stochastic", saturate, seed=2**40 + 3)
                assert same(got, ref), (fmt, saturate, dtype)
    keys = torch.tensor([7, 9])
    idx = torch.arange(1 << 12)
    whole = bits.counter_bits(keys, idx)
    assert torch.equal(bits.counter_bits(keys, idx[1000:2000]), whole[1000:2000])
    assert int(whole.min()) >= 0 and int(whole.max()) < 2**23
    # 23-bit draws, uniform: the mean of 4096 draws within 5 sd of 2^22
    assert abs(float(whole.double().mean()) - 2**22) < 5 * 2**23 / (12 * 4096) ** 0.5
    assert not torch.equal(whole, bits.counter_bits(torch.tensor([8, 9]), idx))
    assert not torch.equal(whole, bits.counter_bits(torch.tensor([7, 10]), idx))
    x = torch.randn(64, 64)
    assert not torch.equal(
        rounding.quantize(x, "e2m1", "stochastic", seed=1),
        rounding.quantize(x, "e2m1", "stochastic", seed=2),
    )
    with pytest.raises(ValueError, match="seed"):
        rounding.quantize(x, "e2m1", "stochastic", seed=-1)
    with pytest.raises(ValueError, match="seed"):
        rounding.quantize(x, "e2m1", "nearest", seed=1)
    with pytest.raises(ValueError, match="seed"):
        rounding.quantize(x.double(), "e2m1", "stochastic", seed=1)
    with pytest.raises(ValueError, match="seed"):
        rounding.quantize(x, "e2m1", "stochastic", generator=torch.Generator(), seed=1)
    assert not kernels._BROKEN, kernels._BROKEN


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_with_sign_is_copysign_bit_for_bit(dtype: torch.dtype) -> None:
    # Magnitudes (NaN, Inf, zero, subnormal, random) against signs of every kind, -0 and
    # negative NaN included: the bits of torch.copysign, eager and compiled.
    tiny = torch.finfo(dtype).tiny
    mags = torch.tensor([math.nan, math.inf, 0.0, tiny / 4, tiny, 1.0, 3.5], dtype=dtype)
    signs = torch.tensor([-1.0, 1.0, -0.0, 0.0, -math.inf, math.inf, 2.0], dtype=dtype)
    signs = torch.cat([signs, -torch.tensor([math.nan], dtype=dtype).abs().neg()])
    a = torch.cat([mags.repeat_interleave(len(signs)), torch.rand(64).to(dtype)])
    x = torch.cat([signs.repeat(len(mags)), torch.randn(64).to(dtype)])
    ref = torch.copysign(a, x)
    assert same(bits.with_sign(a, x), ref)
    assert same(torch.compile(bits.with_sign, fullgraph=True)(a, x), ref)


def test_compiled_rounding_has_no_out_of_line_copysign() -> None:
    # Inductor's CPU code calls torch.copysign as a function per vector (every live
    # register spilled around it): the rounding kernels set the sign on the bits instead.
    from torch._inductor.utils import run_and_get_code

    fmt = get_format("e4m3fn")
    x = torch.randn(4096)

    def f(t: Tensor) -> Tensor:
        return (
            bits.round_bits(t, fmt, "nearest", True)
            + rounding._cast_native(t, fmt, torch.float8_e4m3fn, True).float()
        )

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(f), x)
    assert codes and not any("copysign" in c for c in codes)


@pytest.mark.parametrize("fmt", BYTE)
@pytest.mark.parametrize("saturate", [False, True])
def test_compiled_native_cast_is_the_eager_cast(fmt: str, saturate: bool) -> None:
    # Under torch.compile on the CPU, _cast_native encodes on the bit pattern (fewer
    # vector ops than torch's float8 conversion): the eager cast's bits, specials included.
    f = get_format(fmt)
    native = bits.BYTE_FORMATS[f]
    for x in (probe_values(fmt), probe_values(fmt).to(torch.bfloat16)):
        ref = _cast_native(x, f, native, saturate)
        torch._dynamo.reset()
        got = torch.compile(lambda t: _cast_native(t, f, native, saturate), fullgraph=True)(x)
        assert same(got, ref), (fmt, saturate, x.dtype)


def test_compiled_native_cast_takes_the_bit_path() -> None:
    from torch._inductor.utils import run_and_get_code

    f = get_format("e4m3fn")
    torch._dynamo.reset()
    fn = torch.compile(lambda t: _cast_native(t, f, torch.float8_e4m3fn, True))
    _, codes = run_and_get_code(fn, torch.randn(4096))
    assert codes and not any("convert<at::Float8" in c for c in codes)
