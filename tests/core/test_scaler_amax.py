"""The core scalers as the one home of "a scale from amax over time": a precomputed
``amax=``, a cross-rank ``reducer`` (simulated in-process here; the 2-process test is in
tests/distributed/test_amax_reducer.py), and ``scale_of``, the one scale function."""

from __future__ import annotations

import pytest
import torch

from lowprec.core.scalers import DelayedScaler, DynamicScaler, StaticScaler
from lowprec.core.scales import group_scale

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
