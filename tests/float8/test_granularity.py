"""float8 states granularity in the core grammar (lowprec.core.granularity), relative to the
GEMM's contracted dimension K; it has no parser of its own."""

from __future__ import annotations

import pytest
import torch

import lowprec.float8.config as f8rec
from lowprec.core.granularity import Granularity
from lowprec.float8 import CastConfig, Float8Config, dequantize, quantize_operand


def test_no_float8_granularity_parser() -> None:
    assert not hasattr(f8rec, "parse_granularity") and not hasattr(f8rec, "GemmGranularity")


@pytest.mark.parametrize(
    ("name", "same_as"),
    [
        ("axis:K", "axis"),
        ("rowwise", "axis"),
        ("row", "axis"),
        ("block:1x128@K", "block:1x128"),
        ("1x128", "block:1x128"),
        ("mx:32@K", "mx"),
        ("mx32", "mx:32"),
    ],
)
def test_relative_names_are_one_grammar(name: str, same_as: str) -> None:
    a, b = CastConfig(granularity=name), CastConfig(granularity=same_as)
    assert a.gemm_granularity == b.gemm_granularity == Granularity.from_name(same_as, axis="K")
    assert a.gemm_granularity.relative or a.gemm_granularity.kind == "tensor"
    t = torch.randn(40, 300, generator=torch.Generator().manual_seed(0))
    for cd in (0, 1):
        qa, qb = quantize_operand(t, a, cd), quantize_operand(t, b, cd)
        torch.testing.assert_close(dequantize(qa), dequantize(qb), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["axis:0", "axis:-1", "block:1x128@1", "mx:32@0", "column"])
def test_absolute_axes_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="absolute axis"):
        CastConfig(granularity=name)


def test_bound_granularity_fixes_k_per_gemm() -> None:
    w = Float8Config.from_name("blockwise").weight  # 128x128 blocks: K is either dim
    inp = Float8Config.from_name("blockwise").input
    assert inp.bound_granularity(1) == Granularity.blocks(1, 128, axis=1)
    assert inp.bound_granularity(0) == Granularity.blocks(1, 128, axis=0)
    assert inp.bound_granularity(0).scale_shape((256, 8)) == (2, 8)
    assert w.bound_granularity(1).scale_shape((256, 256)) == (2, 2)
    with pytest.raises(ValueError, match="cd must be 0 or 1"):
        inp.bound_granularity(2)
    with pytest.raises(TypeError, match="granularity must be a str"):
        CastConfig(granularity=3)  # type: ignore[arg-type]
