"""The float8 operands' fast paths and compiled kernels give the eager ops' bits.

``lowprec.float8.quant``'s fast paths (the quotient bound, the table upcast) and the
compiled kernels of ``lowprec.core.kernels`` behind ``quantize_parts``,
``dequantize_parts``, ``quantize_dequantize``, ``quantize_values`` and ``upcast`` (forced
on small tensors here) must not change a single bit, over every preset, role, layout and
the special values of ``tests/_bits.py``'s cases. (Moved from ``tests/core``, whose tests
import nothing above the core.)
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lowprec.core import kernels, layout
from lowprec.core.upcast import upcast
from lowprec.float8 import Float8Config, convert_to_float8
from lowprec.float8.config import PRESETS
from lowprec.float8.quant import (
    dequantize_parts,
    quantize_dequantize,
    quantize_parts,
    quantize_values,
)
from tests._bits import both, cases, same, same_values


# (delayed and static quantize like tensorwise when no scale is given)
@pytest.mark.parametrize("preset", [p for p in PRESETS.names() if p not in ("delayed", "static")])
def test_operand_bits(preset: str) -> None:
    r = Float8Config.from_name(preset)
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
        m = convert_to_float8(lin, Float8Config.from_name(preset))
        x = torch.randn(64, 128, requires_grad=True)
        y = m(x)
        (y * torch.linspace(-1, 1, 128)).sum().backward()
        assert x.grad is not None and m[0].weight.grad is not None
        return y.detach(), x.grad, m[0].weight.grad

    fast, ref = both(run)
    assert isinstance(fast, tuple) and isinstance(ref, tuple)
    assert all(same(a, b) for a, b in zip(fast, ref, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset", ["tensorwise", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4"]
)
def test_kernel_operands_match_the_eager_ops(preset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """quantize_parts / dequantize_parts / upcast through the compiled kernels (forced on
    these small tensors) against the eager ops: payload bits, scales, strides, values."""
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "1")
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "1")
    r = Float8Config.from_name(preset)
    for name, x in cases():
        for role in ("input", "grad_output"):
            for cd in (0, 1):
                fast = quantize_parts(x, r.cast(role), cd)
                with layout.reference_paths():
                    ref = quantize_parts(x, r.cast(role), cd)
                why = (name, role, cd)
                assert same(fast[0], ref[0]) and same(fast[1], ref[1]), why
                assert fast[0].stride() == ref[0].stride() and fast[2] == ref[2], why
                for dt in (torch.float32, torch.bfloat16):
                    d_fast = dequantize_parts(*fast, dt)
                    with layout.reference_paths():
                        d_ref = dequantize_parts(*ref, dt)
                    assert same_values(d_fast, d_ref), (*why, dt)
                    u_fast = upcast(fast[0], dt)
                    assert same(u_fast, fast[0].to(dt)) and u_fast.stride() == fast[0].stride()
                    # the fused quantize-dequantize of an emulated GEMM's block operand
                    fused = quantize_dequantize(x, r.cast(role), cd, dt)
                    if r.cast(role).bound_granularity(cd).kind in ("block", "mx", "nv"):
                        assert fused is not None, (*why, dt)
                        assert same_values(fused, d_ref), (*why, dt)
                        assert fused.stride() == d_fast.stride(), (*why, dt)
                    else:
                        assert fused is None, why
                    # the payload's values and scale, without the payload (tensor, axis)
                    vals = quantize_values(x, r.cast(role), cd, dt)
                    kind = r.cast(role).bound_granularity(cd).kind
                    if kind in ("tensor", "axis"):
                        assert vals is not None, (*why, dt)
                        assert same_values(vals[0], ref[0].to(dt)), (*why, dt)
                        assert vals[0].stride() == ref[0].stride(), (*why, dt)
                        assert same(vals[1], ref[1]), (*why, dt)
                    else:
                        assert vals is None, why
    assert not kernels._BROKEN, kernels._BROKEN
