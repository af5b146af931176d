"""CastConfig arguments for every granularity: each non-default ``margin``,
``power_of_two``, ``history_len`` and ``algo`` either changes the scale as the
CastConfig docstring states (checked against a hand formula in float64) or raises a
``ValueError`` naming the argument.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import Tensor

from lowprec.float8 import CastConfig, Float8Config, quantize_operand
from lowprec.float8.grouped import grouped_config
from lowprec.float8.grouped_quant import quantize_grouped
from lowprec.float8.quant import dequantize_parts, quantize_parts

EMAX = {"e4m3fn": 8, "e5m2": 15, "e2m1": 2}  # exponent of fmt.max
FMAX = {"e4m3fn": 448.0, "e5m2": 57344.0, "e2m1": 6.0}


def _x(seed: int = 0) -> Tensor:
    """Rows spanning 2^-6..2^6 in magnitude: blocks with very different maxima."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(16, 64, generator=gen) * torch.rand(16, 1, generator=gen).mul(12).sub(6).exp2()
    )


def _block_amax(x: Tensor, b: int) -> Tensor:
    """float64 maxima of ``b`` consecutive elements along dim 1 (the contracted dim)."""
    return x.double().abs().reshape(x.shape[0], -1, b).amax(-1)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e2m1"])
@pytest.mark.parametrize("margin", [3.0, -2.0, 1.0])
def test_mx_floor_margin_shifts_the_e8m0_exponent(fmt: str, margin: float) -> None:
    """``mx_scale="floor"``: ``2^(floor(log2 amax) - emax + margin)``, exactly (the
    values here are far inside E8M0's range, so no clamp)."""
    x = _x(1)
    a = _block_amax(x, 32)
    want = torch.tensor(
        [
            [2.0 ** (math.floor(math.log2(v)) - EMAX[fmt] + margin) for v in row]
            for row in a.tolist()
        ]
    )
    got = quantize_operand(x, CastConfig(fmt, granularity="mx:32", margin=margin), 1).scale
    assert torch.equal(got.double(), want.double())
    base = quantize_operand(x, CastConfig(fmt, granularity="mx:32"), 1).scale
    assert torch.equal(got, base * 2.0**margin)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e2m1"])
@pytest.mark.parametrize("margin", [3.0, -2.0])
def test_mx_ceil_margin_rounds_amax_with_headroom_up(fmt: str, margin: float) -> None:
    """``mx_scale="ceil"``: the power of two at or above ``amax · 2^margin / fmt.max``."""
    x = _x(2)
    a = _block_amax(x, 32)
    want = torch.tensor(
        [[2.0 ** math.ceil(math.log2(v * 2.0**margin / FMAX[fmt])) for v in r] for r in a.tolist()]
    )
    cast = CastConfig(fmt, granularity="mx:32", mx_scale="ceil", margin=margin)
    got = quantize_operand(x, cast, 1).scale
    assert torch.equal(got.double(), want.double())
    # no element exceeds fmt.max · 2^-margin after scaling: the headroom the margin buys
    data = dequantize_parts(
        *quantize_parts(x, cast, 1), torch.float64
    ) / got.double().repeat_interleave(32, 1)
    assert float(data.abs().max()) <= FMAX[fmt] * 2.0**-margin


def _nv_reference(x: Tensor, margin: float) -> Tensor:
    """NVFP4 scales by hand: ``s_t = max(amax)/(6·448)`` (float32), block scales
    ``Q_E4M3(amax/(6·s_t))`` (torch's float8_e4m3fn cast of the float64 quotient), and
    the tensor scale times ``2^margin``."""
    a = _block_amax(x, 16)
    s_t = torch.tensor(float(a.max()) / (6.0 * 448.0), dtype=torch.float32).double()
    s_b = (a / (6.0 * s_t)).to(torch.float8_e4m3fn).double()
    return (s_b * (s_t * 2.0**margin).float().double()).float()


@pytest.mark.parametrize("margin", [3.0, -2.0, 1.0])
def test_nv_margin_multiplies_the_tensor_scale(margin: float) -> None:
    x = _x(3)
    got = quantize_operand(x, CastConfig("e2m1", granularity="nv:16", margin=margin), 1).scale
    assert torch.equal(got, _nv_reference(x, margin))
    base = quantize_operand(x, CastConfig("e2m1", granularity="nv:16"), 1).scale
    assert torch.equal(base, _nv_reference(x, 0.0))
    assert torch.equal(got, base * 2.0**margin)


@pytest.mark.parametrize(
    "cast",
    [
        CastConfig("e2m1", granularity="nv:16", margin=2.0),
        CastConfig("e2m1", granularity="mx:32", margin=-1.0),
        CastConfig("e2m1", granularity="mx:32", mx_scale="ceil", margin=2.0),
    ],
    ids=["nv", "mx-floor", "mx-ceil"],
)
def test_grouped_quantization_honours_the_margin(cast: CastConfig) -> None:
    """The grouped quantizer (MoE experts) gives each group what :func:`quantize_parts`
    gives it alone with the margin, bit for bit, and not the ``margin=0`` values (E2M1:
    a power-of-two change of scale moves values across its few codes, where E4M3's
    normal range would round them alike)."""
    x = _x(4)
    counts = [5, 0, 11]
    offs = torch.cumsum(torch.tensor(counts), 0)
    got = quantize_grouped(x, offs, cast, 1)
    want = torch.cat(
        [
            dequantize_parts(*quantize_parts(xe, cast, 1), torch.float32)
            for xe in torch.split(x, counts)
        ]
    )
    assert torch.equal(got, want)
    assert not torch.equal(got, quantize_grouped(x, offs, dataclasses.replace(cast, margin=0.0), 1))


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"granularity": "mx:32", "power_of_two": True}, "power_of_two"),
        ({"granularity": "mx:32", "mx_scale": "ceil", "power_of_two": True}, "power_of_two"),
        ({"fmt": "e2m1", "granularity": "nv:16", "power_of_two": True}, "power_of_two"),
        ({"granularity": "mx:32", "margin": 0.5}, "margin"),
        ({"history_len": 5}, "history_len"),
        ({"algo": "most_recent"}, "algo"),
        ({"granularity": "axis", "history_len": 4}, "history_len"),
        ({"scaling": "static", "history_len": 4}, "history_len"),
        ({"scaling": "static", "static_scale": 0.5, "algo": "most_recent"}, "algo"),
        # an unsigned (scale) element format: every negative value was NaN (48% of randn)
        ({"fmt": "e8m0"}, "unsigned"),
        # formats whose max² overflows the emulated GEMM's FP32 product: NaN outputs
        ({"fmt": "bf16"}, "above 2\\^48"),
        ({"fmt": "tf32"}, "above 2\\^48"),
        ({"fmt": "e4m3fn", "granularity": "nv:16"}, "needs fmt 'e2m1'"),
    ],
)
def test_arguments_without_a_meaning_raise(kw: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        CastConfig(**kw)  # type: ignore[arg-type]


def test_delayed_only_fields_are_accepted_where_they_apply() -> None:
    """Delayed scaling takes them; defaults pass everywhere; a delayed cast with its own
    history made dynamic by ``grouped_config`` (MoE experts without per-expert histories)
    gets the defaults back instead of failing."""
    d = CastConfig("e4m3fn", scaling="delayed", history_len=4, algo="most_recent")
    assert (d.history_len, d.algo) == (4, "most_recent")
    with pytest.raises(ValueError, match="history_len"):
        dataclasses.replace(d, scaling="dynamic")
    r = Float8Config(input=d, weight=d, grad_output=dataclasses.replace(d, fmt="e5m2"))
    g, changes = grouped_config(r)
    assert changes
    for role in ("input", "weight", "grad_output"):
        c = g.cast(role)
        assert (c.scaling, c.history_len, c.algo) == ("dynamic", 16, "max")
    assert CastConfig("e4m3fn", granularity="mx:32", margin=2.0).margin == 2.0


@pytest.mark.parametrize("kind", ["mx", "nv"])
def test_core_group_scale_honours_margin(kind: str) -> None:
    """lowprec.core.scales.group_scale took ``margin`` and dropped it for MX and NVFP4
    (ratio 1): every scale is now 2^margin times the margin-0 one, as the casts' are;
    ``power_of_two`` with NVFP4's E4M3 block scales is refused."""
    from lowprec.core.scales import group_scale

    a = torch.tensor([3.0, 100.0, 0.5])
    for margin in (2.0, -1.0):
        ratio = group_scale(a, "e2m1", kind, margin) / group_scale(a, "e2m1", kind, 0.0)
        assert ratio.tolist() == [2.0**margin] * 3
    if kind == "nv":
        with pytest.raises(ValueError, match="power_of_two"):
            group_scale(a, "e2m1", kind, 0.0, True)
