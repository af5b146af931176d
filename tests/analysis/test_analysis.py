"""lowprec.analysis: tensor statistics against direct computation, the tracker's hooks, plots.

Oracles: hand-counted shares on a tensor built to have known underflow and overflow, and on
random data the same shares from numpy with the format limits taken from ml_dtypes (an
independent source for smallest subnormal, smallest normal and max).
"""

from __future__ import annotations

import doctest
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import lowprec.analysis.tracking as track_mod
from lowprec import quantize_scaled
from lowprec.analysis import plot_exp_histograms, plot_scale_chart, tensor_stats, track
from lowprec.float8 import convert_to_float8


def test_doctests() -> None:
    assert doctest.testmod(track_mod).failed == 0


def test_known_underflow_and_overflow_shares() -> None:
    # fp16: smallest subnormal 2^-24 ~ 5.96e-8, smallest normal 2^-14 ~ 6.1e-5, max 65504.
    x = torch.tensor([0.0, 1e-9, 1e-6, -1.0, 7e4, math.inf, math.nan, 3.0])
    s = tensor_stats(x, ["fp16", "e4m3fn"])
    n = 8
    assert s["numel"] == n and s["zero"] == 1 / n and s["nonfinite"] == 2 / n
    assert s["below_subnormal"]["fp16"] == 1 / n  # 1e-9
    assert s["below_normal"]["fp16"] == 2 / n  # 1e-9, 1e-6
    assert s["above_max"]["fp16"] == 3 / n  # 7e4, inf, nan
    # e4m3fn: subnormal >= 2^-9, normal >= 2^-6, max 448
    assert s["below_subnormal"]["e4m3fn"] == 2 / n
    assert s["below_normal"]["e4m3fn"] == 2 / n
    assert s["above_max"]["e4m3fn"] == 3 / n  # 7e4, inf, nan
    assert s["amax"] == pytest.approx(7e4)
    fin = np.array([0, 1e-9, 1e-6, 1, 7e4, 0, 0, 3.0], dtype=np.float32).astype(np.float64)
    assert s["rms"] == pytest.approx(math.sqrt((fin**2).sum() / n), rel=1e-6)
    assert s["mean_abs"] == pytest.approx(fin.sum() / n, rel=1e-6)
    # exponents: 1e-9 -> -30, 1e-6 -> -20, 1 -> 0, 3 -> 1, 7e4 -> 16
    h = s["exp_hist"]
    assert h["lo"] == -30
    got = {h["lo"] + i: c for i, c in enumerate(h["counts"]) if c}
    assert got == {-30: 1, -20: 1, 0: 1, 1: 1, 16: 1}


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [
        ("e4m3fn", ml_dtypes.float8_e4m3fn),
        ("e5m2", ml_dtypes.float8_e5m2),
        ("fp16", np.float16),
        ("bf16", ml_dtypes.bfloat16),
    ],
)
def test_shares_match_numpy_with_ml_dtypes_limits(fmt: str, dtype: type) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_000, generator=g) * torch.exp2(
        torch.randint(-40, 20, (100_000,), generator=g).float()
    )
    s = tensor_stats(x, [fmt])
    a = np.abs(x.double().numpy())
    fi = ml_dtypes.finfo(dtype)
    sub, tiny, mx = float(fi.smallest_subnormal), float(fi.smallest_normal), float(fi.max)
    assert s["below_subnormal"][fmt] == pytest.approx(((a > 0) & (a < sub)).mean(), abs=1e-12)
    assert s["below_normal"][fmt] == pytest.approx(((a > 0) & (a < tiny)).mean(), abs=1e-12)
    assert s["above_max"][fmt] == pytest.approx((a > mx).mean(), abs=1e-12)
    e = np.floor(np.log2(a[a > 0])).astype(int)
    lo = int(e.min())
    want = np.bincount(e - lo)
    assert s["exp_hist"]["lo"] == lo
    assert s["exp_hist"]["counts"] == want.tolist()


def test_scaled_tensor_measures_its_narrow_data() -> None:
    x = torch.randn(64, 64) * 1e-6
    st = quantize_scaled(x, "e4m3fn")
    s = tensor_stats(st, ["e4m3fn"])
    assert s["dtype"] == "float8_e4m3fn"
    assert s["amax"] == pytest.approx(448.0)  # the scale puts amax at e4m3's max
    assert tensor_stats(x, ["e4m3fn"])["below_subnormal"]["e4m3fn"] == 1.0  # unscaled: all lost


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_tracker_records_forward_and_backward_against_autograd() -> None:
    m = _mlp()
    x = torch.randn(5, 8)
    with track(m, ["fp16"], every=2) as t:
        for step in range(3):
            h = m[0](x)
            h.retain_grad()
            y = m[2](m[1](h))
            # the same computation through the model, so the hooks fire
            m.zero_grad()
            out = m(x)
            out.pow(2).sum().backward()
            if step == 2:
                y.pow(2).sum().backward()  # h.grad: the gradient into m[0]'s output
    by = {(r["step"], r["name"], r["kind"]): r for r in t.records}
    assert {k[0] for k in by} == {0, 2}  # every=2 of steps 0, 1, 2
    kinds = {k[2] for k in by if k[1] == "0"}
    assert kinds == {"input", "output", "grad_output"}
    assert {k[2] for k in by if k[1] == "0.weight"} == {"weight", "weight_grad"}
    assert by[(2, "0", "output")]["amax"] == pytest.approx(float(h.detach().abs().max()))
    assert by[(2, "0", "grad_output")]["rms"] == pytest.approx(
        float(h.grad.pow(2).mean().sqrt()), rel=1e-6
    )
    wg = by[(2, "2.weight", "weight_grad")]
    assert wg["amax"] == pytest.approx(float(m[2].weight.grad.abs().max()))
    assert by[(2, "1", "output")]["zero"] == pytest.approx(float((m[1](h) == 0).float().mean()))
    # hooks are removed on exit
    n = len(t.records)
    m(x).sum().backward()
    assert len(t.records) == n


def test_eval_passes_are_not_counted() -> None:
    m = _mlp()
    with track(m, ["e5m2"], every=1) as t:
        m(torch.randn(2, 8))
        m.eval()
        with torch.no_grad():
            m(torch.randn(2, 8))
        m.train()
        m(torch.randn(2, 8))
    assert sorted({r["step"] for r in t.records}) == [0, 1]


def test_tracks_a_float8_model() -> None:
    m = convert_to_float8(_mlp(), "tensorwise")
    with track(m, ["e4m3fn", "e5m2"]) as t:
        m(torch.randn(16, 8)).sum().backward()
    names = {(r["name"], r["kind"]) for r in t.records}
    assert ("0", "grad_output") in names and ("2.weight", "weight_grad") in names


def test_tracks_a_unit_scaled_model() -> None:
    """The tracker sees what a unit-scaled model computes: its hooks sit on the swapped
    modules, and the numbers are those of the unit-scaled tensors (about unit RMS at
    init, where the standard model's hidden activations are ~0.5)."""
    import lowprec.unit.functional as U
    from lowprec.unit import unit_scale

    torch.manual_seed(0)
    m = unit_scale(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)), reinit=True)
    x = torch.randn(512, 256)
    with track(m, ["e4m3fn", "e5m2"]) as t:
        m(x).backward(torch.randn(512, 256))
    h = U.linear(x, m[0].weight, m[0].bias).detach()  # the first layer's op, as an oracle
    by = {(r["name"], r["kind"]): r for r in t.records}
    assert {k for k in by if k[0] == "0"} == {("0", "input"), ("0", "output"), ("0", "grad_output")}
    assert by[("0", "output")]["rms"] == pytest.approx(float(h.pow(2).mean().sqrt()), rel=1e-5)
    # unit scaling: weight N(0, 1) and unit-RMS activations (512·256 samples: ±1%)
    assert by[("0.weight", "weight")]["rms"] == pytest.approx(1.0, abs=0.02)
    assert by[("0", "output")]["rms"] == pytest.approx(1.0, abs=0.05)
    assert by[("0.weight", "weight_grad")]["rms"] > 0.1


def test_tracks_a_scalify_model() -> None:
    """On a scalify'd model the hooks see ScaledTensors: the records measure their narrow
    FP16 data (what must fit the format), and that data times its scale is the input."""
    from lowprec import ScaledTensor
    from lowprec.scalify import scalify

    torch.manual_seed(0)
    s = scalify(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), data_format="fp16")
    seen: list[ScaledTensor] = []
    s.module[0].register_forward_hook(lambda m, a, o: seen.append(a[0]))
    x = torch.randn(32, 64)
    with track(s, ["fp16", "e5m2"]) as t:
        y = s(x)
        y.backward(torch.randn_like(y))
    by = {(r["name"], r["kind"]): r for r in t.records}
    kinds = {k for n, k in by if n == "module.0"}
    assert kinds == {"input", "output", "grad_output"}
    assert ("module.2.weight", "weight_grad") in by
    (inp,) = seen
    assert isinstance(inp, ScaledTensor) and by[("module.0", "input")]["dtype"] == "float16"
    torch.testing.assert_close(inp.dequantize(), x, rtol=2**-10, atol=0)  # FP16 rounding
    rms = float(inp.qdata.float().pow(2).mean().sqrt())
    assert by[("module.0", "input")]["rms"] == pytest.approx(rms, rel=1e-6)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="every"):
        track(_mlp(), every=0).__enter__()
    with pytest.raises(ValueError, match="formats"):
        track(_mlp(), formats="fp16").__enter__()
    with pytest.raises(ValueError, match="exponent_bits"):
        track(_mlp(), formats=["e9m9"]).__enter__()
    with pytest.raises(TypeError, match="model"):
        track("model").__enter__()  # type: ignore[arg-type]
    for bad in (-2, 1.5, True):  # -2 recorded steps -2, -1 (a new user's report)
        with pytest.raises(ValueError, match=r"^start_step must be an int >= 0, got "):
            track(_mlp(), start_step=bad).__enter__()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="auto_step must be a bool"):
        track_mod.Tracker(_mlp(), auto_step=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="floating"):
        tensor_stats(torch.arange(3), ["fp16"])


def test_plots_write_pngs(tmp_path: Path) -> None:
    m = _mlp()
    with track(m, ["fp16", "e4m3fn", "e5m2"]) as t:
        m(torch.randn(4, 8)).sum().backward()
    p = plot_scale_chart(t.records, 0, t.formats, tmp_path / "s.png")
    assert p.stat().st_size > 10_000
    h = plot_exp_histograms(
        t.records, 0, [("0", "output"), ("2.weight", "weight_grad")], t.formats, tmp_path / "h.png"
    )
    assert h.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="step 7"):
        plot_scale_chart(t.records, 7, t.formats, tmp_path / "x.png")
    with pytest.raises(ValueError, match="names"):
        plot_exp_histograms(t.records, 0, [("nope", "output")], t.formats, tmp_path / "y.png")


def test_rms_of_huge_values_and_finite_only_moments() -> None:
    x = torch.tensor([1e20, 3e38, math.inf, math.nan], dtype=torch.bfloat16)
    s = tensor_stats(x, ["bf16"])
    vals = x.double()[:2]  # the finite ones
    assert s["rms"] == pytest.approx(math.sqrt(float((vals**2).sum()) / 4), rel=1e-6)
    assert s["amax"] == pytest.approx(float(vals.max())) and s["nonfinite"] == 0.5


def test_parameters_of_non_leaf_modules_and_eval_between_passes() -> None:
    class Gain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.gain

    m = Gain()
    with track(m, ["fp16"]) as t:
        loss = m(torch.randn(3, 4)).sum()
        m.eval()
        with torch.no_grad():
            m(torch.randn(3, 4))  # an evaluation pass between forward and backward
        m.train()
        loss.backward()
    kinds = {(r["name"], r["kind"]) for r in t.records}
    assert {("gain", "weight"), ("gain", "weight_grad"), ("lin.weight", "weight_grad")} <= kinds


def test_grad_stats_grad_meter_and_tensor_stats_agree() -> None:
    """The three reports of one FP16 tensor count through ``count_values``: hand-counted
    zeros (2), non-finite (Inf, NaN: 2), values below FP16's smallest normal 2^-14
    (2^-20 and -2^-16, plus the zeros for the meter), and ‖finite‖² = 1 + 4 + 2^-40 + 2^-32."""
    from lowprec.amp import grad_stats
    from lowprec.analysis.stats import GradMeter, count_values

    vals = [0.0, 2.0**-20, -(2.0**-16), 1.0, -2.0, 0.0, math.inf, math.nan]
    x = torch.tensor(vals, dtype=torch.float16)
    n = len(vals)
    p = nn.Parameter(torch.zeros(n, dtype=torch.float16))
    p.grad = x.clone()
    g = grad_stats([p])
    meter = GradMeter(nn.Identity())
    meter._on_grad(x)
    m = meter.result()
    s = tensor_stats(x, ["fp16"])
    c = count_values(x, below=[2.0**-14], moments=True)
    assert (c.zero, c.nonfinite, c.nan, c.below) == (2, 2, 1, (2,))
    assert g["grad_zero_share"] == s["zero"] == m["act_grad_zero"] == 2 / n
    assert g["grad_nonfinite_share"] == s["nonfinite"] == 2 / n
    assert m["act_grad_underflow"] == s["below_normal"]["fp16"] + s["zero"] == 4 / n
    sumsq = 1.0 + 4.0 + 2.0**-40 + 2.0**-32  # exact in float64
    # rel 1e-15: the norm is a float64 sqrt, squared again (two roundings of 2^-53)
    assert g["grad_norm"] ** 2 == pytest.approx(sumsq, rel=1e-15)
    assert s["rms"] ** 2 * n == pytest.approx(sumsq, rel=1e-15)
    assert c.sumsq == pytest.approx(sumsq, rel=1e-15)
