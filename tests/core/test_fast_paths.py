"""The eager fast paths give the same bits as the reference (general) paths.

The fast paths (``lowprec.core.rounding``: range-driven cast shortcuts, ``dense_view``
reductions; ``lowprec.float8.quant``: the quotient bound, the table upcast;
``lowprec.core.kernels``: compiled rounding for large tensors) must not change a single
bit: every comparison here is exact (``torch.equal`` on the bit patterns), over formats,
granularities, layouts (contiguous and transposed), NaN, ±Inf, ±0, subnormals and values
that saturate.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from lowprec.core import kernels, rounding
from lowprec.core.rounding import quantize, to_format
from lowprec.core.scales import amax
from lowprec.float8 import Float8Recipe, convert_to_float8
from lowprec.float8.quant import quantize_parts, upcast
from lowprec.float8.recipe import PRESETS

SPECIALS = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-42, 1e30, -1e30,
            448.0, 449.0, 464.0, 465.0, 57344.0, 61440.0, 1e-8, 6.0, 7.0, 2.0**-126]  # fmt: skip


def bits(t: Tensor) -> Tensor:
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def cases(rows: int = 40, cols: int = 72) -> Iterator[tuple[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(rows, cols, generator=g) * 3
    sp = base.clone()
    sp.view(-1)[: len(SPECIALS) * 7 : 7] = torch.tensor(SPECIALS)
    for name, x in [("randn", base), ("big", base * 1e4), ("tiny", base * 1e-6),
                    ("zeros", torch.zeros(rows, cols)), ("specials", sp)]:  # fmt: skip
        yield name, x
        yield name + "_T", x.t()
    for dt in (torch.bfloat16, torch.float16):
        yield f"randn_{dt}", base.to(dt)
        yield f"specials_{dt}", sp.to(dt)


def both(fn: object, *args: object, **kw: object) -> tuple[object, object]:
    """``fn(*args)`` with the fast paths, then with the reference paths."""
    assert callable(fn)
    fast = fn(*args, **kw)
    with rounding._reference_paths():
        ref = fn(*args, **kw)
    return fast, ref


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e4m3fnuz", "e2m1", "fp16", "bf16"])
@pytest.mark.parametrize("saturate", [False, True])
def test_quantize_and_to_format_bits(fmt: str, saturate: bool) -> None:
    for name, x in cases():
        for f in (quantize, to_format):
            fast, ref = both(f, x, fmt, saturate=saturate)
            assert isinstance(fast, Tensor) and isinstance(ref, Tensor)
            assert same(fast, ref), (f.__name__, name)


def test_amax_of_a_transposed_tensor_is_exact() -> None:
    for name, x in cases():
        fast, ref = both(amax, x)
        assert isinstance(fast, Tensor) and isinstance(ref, Tensor)
        assert same(fast, ref), name


# (delayed and static quantize like tensorwise when no scale is given)
@pytest.mark.parametrize("preset", [p for p in PRESETS.names() if p not in ("delayed", "static")])
def test_operand_bits(preset: str) -> None:
    r = Float8Recipe.from_name(preset)
    for name, x in cases():
        for role in ("input", "weight", "grad_output"):
            for cd in (0, 1):
                fast, ref = both(quantize_parts, x, r.cast(role), cd)
                assert isinstance(fast, tuple) and isinstance(ref, tuple)
                assert same(fast[0], ref[0]) and same(fast[1], ref[1]), (name, role, cd)
                assert fast[2] == ref[2]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("to", [torch.float32, torch.bfloat16])
def test_table_upcast_bits_and_strides(dtype: torch.dtype, to: torch.dtype) -> None:
    # Every code, tiled past the table's size threshold, contiguous and transposed.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    data = codes.repeat(256).view(256, 256)
    for d in (data, data.t()):
        fast, ref = upcast(d, to), d.to(to)
        assert same(fast, ref) and fast.stride() == ref.stride()


@pytest.mark.parametrize("preset", ["tensorwise", "rowwise", "mxfp8", "nvfp4"])
def test_training_step_bits(preset: str) -> None:
    """A whole fwd+bwd of a two-layer MLP: output and gradients bit for bit."""

    def run() -> tuple[Tensor, ...]:
        torch.manual_seed(0)
        lin = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
        m = convert_to_float8(lin, Float8Recipe.from_name(preset))
        x = torch.randn(64, 128, requires_grad=True)
        y = m(x)
        (y * torch.linspace(-1, 1, 128)).sum().backward()
        assert x.grad is not None and m[0].weight.grad is not None
        return y.detach(), x.grad, m[0].weight.grad

    fast, ref = both(run)
    assert isinstance(fast, tuple) and isinstance(ref, tuple)
    assert all(same(a, b) for a, b in zip(fast, ref, strict=True))


@pytest.mark.slow
def test_compiled_kernel_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled rounding kernel (forced on small tensors) against the eager bit path.
    Compiles once per (format, saturate, dtype): marked slow."""
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "1")
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "1")
    x = next(cases())[1]
    sp = torch.cat([x.view(-1)[:1000], torch.tensor(SPECIALS)]).view(-1, 1)
    for t in (x, x.t(), sp):
        assert kernels.applies(t)
        fast, ref = both(quantize, t, "e2m1", saturate=True)
        assert isinstance(fast, Tensor) and isinstance(ref, Tensor)
        assert same(fast, ref) and fast.stride() == ref.stride()
    assert not kernels._BROKEN, kernels._BROKEN


def test_kernel_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "0")
    assert not kernels.enabled()
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "maybe")
    with pytest.raises(ValueError, match="LOWPREC_EAGER_KERNELS"):
        kernels.enabled()
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "x")
    with pytest.raises(ValueError, match="LOWPREC_EAGER_KERNELS_MIN_NUMEL"):
        kernels.min_numel()


def test_cast_saturation_is_probed_per_device_type() -> None:
    saturates = float(torch.tensor([1e30]).to(torch.float8_e4m3fn).float()) == 448.0
    assert rounding._cast_saturates(torch.device("cpu")) is saturates
    # no data to probe on the meta device: the clamp is kept, nothing is cached
    assert rounding._cast_saturates(torch.device("meta")) is False
    assert "meta" not in rounding._SATURATES


def test_non_saturating_cast_device_gives_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose float32 -> e4m3fn cast does not saturate (the general path clamps
    first) gives the saturating device's bits: finite overflow to +-448, Inf to NaN."""
    x = next(iter(cases()))[1].clone()
    x.view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS)
    with rounding._reference_paths():  # the general masked path
        want = to_format(x, "e4m3fn", saturate=True)
        monkeypatch.setitem(rounding._SATURATES, "cpu", False)
        got = to_format(x, "e4m3fn", saturate=True)
    assert same(got, want)
    v = got.float()
    assert float(v[v.isfinite()].abs().max()) == 448.0
    assert int(v.isnan().sum()) == 3  # the two Infs and the NaN


def test_kernel_device_types() -> None:
    x = torch.randn(1024, 1024)
    assert kernels.applies(x) and kernels.applies(x, devices=kernels.quantize_devices())
    assert not kernels.applies(x, devices=("cuda",))
    m = torch.empty(1024, 1024, device="meta")
    assert not kernels.applies(m, devices=kernels.quantize_devices())
