"""The core scalers as the one home of "a scale from amax over time": a precomputed
``amax=``, a cross-rank ``reducer`` (simulated in-process here; the 2-process test is in
tests/distributed/test_amax_reducer.py), and ``scale_of``, the one scale function."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch

from lowprec.core.formats import get_format
from lowprec.core.scalers import DelayedScaler, DynamicScaler, StaticScaler
from lowprec.core.scales import group_scale
from lowprec.core.tensor import quantize_scaled

E4M3_MAX = 448.0


def _x(seed: int, mult: float) -> torch.Tensor:
    return torch.randn(5, 7, generator=torch.Generator().manual_seed(seed)) * mult


def test_given_amax_equals_calling_on_the_tensor() -> None:
    xs = [_x(i, 1 + i) for i in range(4)]
    for make in (
        lambda: DelayedScaler("e4m3fn", history_len=3),
        lambda: StaticScaler("e4m3fn", calibration_steps=3),
        lambda: DynamicScaler("e5m2", margin=1.0),
    ):
        a, b = make(), make()
        for x in xs:
            sa = a(x)
            sb = b(amax=x.abs().amax())
            assert torch.equal(sa, sb)
        assert a.state_dict().keys() == b.state_dict().keys()
        for k, v in a.state_dict().items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b.state_dict()[k]), k


def test_reducer_reduces_the_tensors_amax_not_a_given_one() -> None:
    """Two simulated ranks: each scaler's reducer returns the max over both ranks' local
    amax, so both record the amax of the concatenated data, as one process does."""
    xs0 = [_x(10 + i, 1.0) for i in range(3)]
    xs1 = [_x(20 + i, 4.0 - i) for i in range(3)]
    s0 = DelayedScaler("e4m3fn", history_len=4)
    s1 = DelayedScaler("e4m3fn", history_len=4)
    ref = DelayedScaler("e4m3fn", history_len=4)
    cur: dict[int, torch.Tensor] = {}
    s0.reducer = lambda a: torch.maximum(a, cur[1])
    s1.reducer = lambda a: torch.maximum(a, cur[0])
    for x0, x1 in zip(xs0, xs1, strict=True):
        cur = {0: x0.abs().amax(), 1: x1.abs().amax()}
        t0, t1, tr = s0(x0), s1(x1), ref(torch.cat([x0, x1]))
        assert torch.equal(t0, tr) and torch.equal(t1, tr)
    assert s0.amax_history is not None and ref.amax_history is not None
    assert torch.equal(s0.amax_history, ref.amax_history)
    assert float(ref.amax_history[0]) > float(xs0[-1].abs().max())  # rank 1 dominated

    doubling = DynamicScaler("e4m3fn", reducer=lambda a: 2 * a)
    x = _x(3, 1.0)
    assert float(doubling(x)) == pytest.approx(2 * float(x.abs().max()) / E4M3_MAX, rel=1e-6)
    assert float(doubling(amax=torch.tensor(448.0))) == 1.0  # a given amax is not reduced


def test_scale_of_is_group_scale() -> None:
    a = torch.tensor([0.0, 3.0, 896.0, float("inf"), float("nan")])
    for fmt in ("e4m3fn", "e5m2"):
        for margin, p2 in ((0.0, False), (1.0, True), (-0.5, False)):
            sc = DelayedScaler(fmt, margin=margin, power_of_two=p2)
            ref = group_scale(a, fmt, "tensor", margin, p2)
            assert torch.allclose(sc.scale_of(a), ref, rtol=0, atol=0, equal_nan=True)
    assert float(DynamicScaler("e4m3fn").scale_of(torch.tensor(896.0))) == 2.0


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="reducer must be callable"):
        DelayedScaler("e4m3fn", reducer=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="give the tensor x or its amax="):
        DelayedScaler("e4m3fn")()
    with pytest.raises(TypeError, match="amax must be a floating-point tensor"):
        DynamicScaler("e4m3fn")(amax=torch.tensor(3))
    sc = DelayedScaler("e4m3fn", history_len=2, granularity="row")
    sc(torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"from amax\) differs"):
        sc(amax=torch.ones(()))


# ---- a tensor holding Inf/NaN through a delayed or static scaler -------------------------

_BAD = [math.inf, -math.inf, math.nan, 1000.0, 1.0, -1.0, 0.5, 3.0]
_DELAYED_NOTE = (
    "DelayedScaler: non-finite amax (Inf/NaN in the tensor); those groups keep the scale of "
    "the amax history (scale 1 while it holds no positive amax), NaN in a format without "
    "Inf and NaN codes; the history records its newest amax again in their place "
    "(reported once)"
)
_STATIC_NOTE = (
    "StaticScaler: non-finite amax (Inf/NaN in the tensor) while calibrating; those groups "
    "get the scale of the calibration maximum so far (scale 1 where it is 0), NaN in a "
    "format without Inf and NaN codes; the maximum records 0 for them and the call counts "
    "as a calibration step (reported once)"
)


def _deq(st: Any) -> list[float]:
    return [float(v) for v in st.dequantize().tolist()]


def _same(got: list[float], want: list[float]) -> bool:
    return all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, want, strict=True))


def test_delayed_scaler_keeps_its_history_scale_for_a_nonfinite_tensor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The scale of a tensor holding Inf/NaN is the history's (amax 2: ``2/448``), not 1:
    the finite values saturate at ``448 · scale = 2``, ±Inf and NaN read NaN (E4M3FN has
    no Inf) or stay (E5M2); the history advances one slot, repeating its newest amax."""
    nan = math.nan
    for fmt, want in (
        ("e4m3fn", [nan, nan, nan, 2.0, 1.0, -1.0, 0.5, 2.0]),
        ("e5m2", [math.inf, -math.inf, nan, 2.0, 1.0, -1.0, 0.5, 2.0]),
    ):
        sc = DelayedScaler(fmt, history_len=4)
        quantize_scaled(torch.full((8,), 2.0), fmt, scaler=sc)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lowprec.core.scalers"):
            st = quantize_scaled(torch.tensor(_BAD), fmt, scaler=sc)
        assert st.scale.item() == torch.tensor(2.0 / get_format(fmt).max).item()
        assert _same(_deq(st), want), (fmt, _deq(st))
        assert sc.amax_history is not None and sc.amax_history.tolist() == [2.0, 2.0, 0.0, 0.0]
        assert sc.nonfinite_count == 1
        assert [r.getMessage() for r in caplog.records] == [_DELAYED_NOTE]
        quantize_scaled(torch.full((8,), 3.0), fmt, scaler=sc)
        assert sc.amax_history.tolist() == [3.0, 2.0, 2.0, 0.0]
    warm = DelayedScaler("e4m3fn", history_len=2)  # empty history: the tensor's own, 1
    st = quantize_scaled(torch.tensor(_BAD), "e4m3fn", scaler=warm)
    assert st.scale.item() == 1.0
    assert _same(_deq(st), [nan, nan, nan, 448.0, 1.0, -1.0, 0.5, 3.0])
    assert warm.amax_history is not None and warm.amax_history.tolist() == [0.0, 0.0]


def test_static_scaler_calibrating_on_a_nonfinite_tensor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While calibrating, the scale is the calibration maximum's (2 / 448), which records 0
    for the non-finite group; the call counts as a calibration step."""
    sc = StaticScaler("e4m3fn", calibration_steps=3)
    quantize_scaled(torch.full((8,), 2.0), "e4m3fn", scaler=sc)
    with caplog.at_level(logging.WARNING, logger="lowprec.core.scalers"):
        st = quantize_scaled(torch.tensor(_BAD), "e4m3fn", scaler=sc)
    assert st.scale.item() == torch.tensor(2.0 / E4M3_MAX).item()
    assert _same(_deq(st), [math.nan] * 3 + [2.0, 1.0, -1.0, 0.5, 2.0])
    assert sc.calib_amax is not None and sc.calib_amax.item() == 2.0 and sc.steps == 2
    assert [r.getMessage() for r in caplog.records] == [_STATIC_NOTE]
    first = StaticScaler("e4m3fn")  # nothing seen yet: the maximum is 0, scale 1, frozen
    st = quantize_scaled(torch.tensor(_BAD), "e4m3fn", scaler=first)
    assert st.scale.item() == 1.0 and first.frozen and first.calib_amax is not None
    assert first.calib_amax.item() == 0.0


@pytest.mark.parametrize("make", ["delayed", "calibrating", "frozen", "given"])
def test_a_format_without_inf_and_nan_reads_nan_through_any_scaler(make: str) -> None:
    """E2M1 has no Inf and NaN codes: a group holding Inf/NaN gets the NaN scale and reads
    NaN, whatever scaler gave its scale (a history's or a frozen scale clamped ±Inf to
    ±max·scale: a non-finite value turned finite)."""
    sc: DelayedScaler | StaticScaler
    if make == "delayed":
        sc = DelayedScaler("e2m1", history_len=2, granularity="row")
    elif make == "given":
        sc = StaticScaler("e2m1", scale=torch.tensor([[1.0], [1.0]]), granularity="row")
    else:
        sc = StaticScaler("e2m1", calibration_steps=1 if make == "frozen" else 4,
                          granularity="row")  # fmt: skip
    quantize_scaled(torch.full((2, 4), 2.0), "e2m1", scaler=sc)
    x = torch.tensor([[math.inf, 1.0, -1.0, 2.0], [1.0, -1.0, 2.0, 0.5]])
    st = quantize_scaled(x, "e2m1", scaler=sc)
    deq = st.dequantize()
    assert deq[0].isnan().all(), deq
    assert torch.isfinite(deq[1]).all() and st.scale.shape == (2, 1)
    assert not math.isnan(st.scale[1].item())


def test_group_scale_mx_rounding_floor_is_ocp_and_ceil_the_power_of_two_above() -> None:
    """MX block scales: ``"floor"`` is OCP's ``2^(floor(log2 amax) - emax)``; ``"ceil"``
    the power of two at or above ``amax/max`` (float8's ``mx_scale="ceil"``), which keeps
    every element in range. Oracle: the formulas in float64."""
    a = torch.tensor([1.0, 3.0, 448.0, 500.0, 0.3])
    floor = group_scale(a, "e4m3fn", "mx:32")
    ceil = group_scale(a, "e4m3fn", "mx:32", mx_rounding="ceil")
    emax = 8  # E4M3's largest exponent
    assert floor.tolist() == [2.0 ** (math.floor(math.log2(v)) - emax) for v in a.tolist()]
    assert ceil.tolist() == [2.0 ** math.ceil(math.log2(v / 448.0)) for v in a.tolist()]
    assert bool((a / ceil <= 448.0).all()) and not bool((a / floor <= 448.0).all())
    ceil_m = group_scale(a, "e4m3fn", "mx:32", margin=1.0, mx_rounding="ceil")
    assert torch.equal(ceil_m, 2 * ceil)
    with pytest.raises(ValueError, match="mx_rounding must be 'floor' or 'ceil', got 'up'"):
        group_scale(a, "e4m3fn", "mx:32", mx_rounding="up")
