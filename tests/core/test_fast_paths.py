"""The eager fast paths give the same bits as the reference (general) paths.

The fast paths (``lowprec.core.rounding``: range-driven cast shortcuts; ``dense_view``
reductions of ``lowprec.core.layout``; ``lowprec.core.kernels``: compiled rounding for
large tensors) must not change a single
bit: every comparison here is exact (``torch.equal`` on the bit patterns), over formats,
granularities, layouts (contiguous and transposed), NaN, ±Inf, ±0, subnormals and values
that saturate. (The float8 operands' fast paths, on the same cases:
``tests/float8/test_kernel_bits.py``.)
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lowprec.core import kernels, layout, rounding
from lowprec.core.rounding import quantize, to_format
from lowprec.core.scales import amax
from tests._bits import SPECIALS, both, cases, same


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
    with layout.reference_paths():  # the general masked path
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
