"""Per-GEMM numerics (lowprec.analysis.gemms) against independent computations.

Oracles: the casts recomputed in numpy with ml_dtypes (E4M3/E5M2 rounding, a scale of
amax / max) for the shares, the SQNR and the GEMM's relative error; and the layer's own
outputs and gradients, which must equal the product of the observed cast operands (what the
observation reports is what the GEMM multiplied).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from lowprec.analysis.gemms import GemmRecorder, cast_stats, gemm_rel_err, measure_gemms
from lowprec.core.observe import CastOperand, GemmSink, gemm_sink, observing
from lowprec.float8 import CastConfig, Float8Config, Float8Linear

ML = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _cast_np(x: np.ndarray, fmt: str, scale: float) -> np.ndarray:
    """Round ``x / scale`` to ``fmt`` with saturation (ml_dtypes), times ``scale``."""
    fmax = float(ml_dtypes.finfo(ML[fmt]).max)
    q = np.clip(x / scale, -fmax, fmax).astype(ML[fmt]).astype(np.float64)
    return q * scale


def _sqnr(h: np.ndarray, c: np.ndarray) -> float:
    return 10 * math.log10(float((h**2).sum()) / float(((h - c) ** 2).sum()))


def _layer(recipe: str, k: int = 64, n: int = 48, seed: int = 0) -> Float8Linear:
    torch.manual_seed(seed)
    return Float8Linear.from_linear(nn.Linear(k, n, bias=False), recipe)


def _run(layer: nn.Module, x: torch.Tensor, every: int = 1) -> list[dict]:
    model = nn.Sequential(layer)
    with measure_gemms(model, every=every) as g:
        y = model(x)
        y.backward(torch.randn_like(y) * 1e-3)
    return g.records


def test_tensorwise_forward_matches_ml_dtypes() -> None:
    torch.manual_seed(1)
    layer = _layer("tensorwise")
    x = torch.randn(32, 64, dtype=torch.float32).requires_grad_()
    rec = {r["gemm"]: r for r in _run(layer, x)}
    assert set(rec) == {"forward", "input_grad", "weight_grad"}
    xs, ws = x.detach().double().numpy(), layer.weight.detach().double().numpy()
    cx = _cast_np(xs, "e4m3fn", float(np.abs(xs).max()) / 448)
    cw = _cast_np(ws, "e4m3fn", float(np.abs(ws).max()) / 448)
    op = rec["forward"]["operands"]["input"]
    # float32 scale vs float64 here: the shares are exact counts, the SQNR agrees to ~1e-6.
    assert op["format"] == "e4m3fn" and op["n_scales"] == 1
    assert op["sqnr_db"] == pytest.approx(_sqnr(xs, cx), rel=1e-5)
    assert rec["forward"]["operands"]["weight"]["sqnr_db"] == pytest.approx(_sqnr(ws, cw), rel=1e-5)
    assert op["flushed"] == float(((xs != 0) & (cx == 0)).mean())
    assert op["saturated"] == 0.0  # amax maps onto 448 exactly
    ref = xs @ ws.T
    want = np.linalg.norm(cx @ cw.T - ref) / np.linalg.norm(ref)
    assert rec["forward"]["rel_err"] == pytest.approx(want, rel=1e-4)  # float32 products
    go = rec["input_grad"]["operands"]["grad_output"]
    assert go["format"] == "e5m2" and rec["weight_grad"]["operands"]["input"]["format"] == "e4m3fn"


def test_naive_flush_and_saturation_at_scale_one() -> None:
    # Scale 1: values below E4M3's smallest subnormal / 2 (2^-10) flush, above 448 saturate.
    layer = _layer("naive")
    x = torch.tensor([[1e-4, -3e-4, 5e-3, 600.0] * 16] * 4).requires_grad_()
    rec = {r["gemm"]: r for r in _run(layer, x)}
    op = rec["forward"]["operands"]["input"]
    assert op["flushed"] == pytest.approx(0.5)  # 1e-4, -3e-4 < 2^-10 ≈ 9.8e-4
    assert op["saturated"] == pytest.approx(0.25)  # 600 > 448 · (1 + 2^-4) = 476
    assert (op["scale_min"], op["scale_max"], op["n_scales"]) == (1.0, 1.0, 1)
    # The gradient at scale 1 in E5M2 (smallest subnormal 2^-16): the ml_dtypes oracle.
    torch.manual_seed(3)
    model = nn.Sequential(layer)
    g = torch.randn(4, 48) * 1e-5
    with measure_gemms(model, every=1) as m:
        model(x).backward(g)
    go = {r["gemm"]: r for r in m.records}["input_grad"]["operands"]["grad_output"]
    gn = g.double().numpy()
    cg = _cast_np(gn, "e5m2", 1.0)
    assert go["format"] == "e5m2"
    assert go["flushed"] == pytest.approx(float(((gn != 0) & (cg == 0)).mean()))
    assert go["flushed"] > 0.2
    assert go["sqnr_db"] == pytest.approx(_sqnr(gn, cg), rel=1e-6)


@pytest.mark.parametrize(
    "name",
    [
        "tensorwise",
        "delayed",
        "rowwise",
        "blockwise",
        "mxfp8",
        "mxfp4",
        "nvfp4",
        "naive",
        # Formats per GEMM: each GEMM's operands are observed with that GEMM's casts.
        "mxfp8-nvfp4-bwd",
        "tensorwise-wgrad-nvfp4",
        Float8Config.from_name("tensorwise", gemms={"forward": "nvfp4"}),
        Float8Config.from_name("delayed", gemms={"input_grad": "rowwise"}),
        Float8Config.from_name(
            "tensorwise", gemms={"weight_grad": Float8Config(input=CastConfig("e5m2"))}
        ),
        Float8Config.from_name("rowwise", gemms={"forward": "mxfp4", "weight_grad": "blockwise"}),
    ],
    ids=lambda v: v if isinstance(v, str) else f"{v.name}+" + "+".join(g for g, _ in v.gemms),
)
def test_observed_operands_are_what_the_gemm_multiplied(name: str | Float8Config) -> None:
    """y, dx and dW of the layer equal the products of the observed cast operands: the
    observation reports the GEMM's own operands (emulated in float32: equal to ~1e-6),
    with per-GEMM configs too."""
    torch.manual_seed(2)
    layer = _layer(name, k=64, n=64)  # type: ignore[arg-type]
    x = torch.randn(40, 64).requires_grad_()
    got: dict[str, tuple[CastOperand, CastOperand]] = {}

    class Keep:
        def capture(self) -> GemmSink:
            return lambda gemm, a, b: got.__setitem__(gemm, (a, b))

    g = torch.randn(40, 64)
    with observing(Keep()):
        y = layer(x)
        y.backward(g)
    for gemm, out in (("forward", y), ("input_grad", x.grad), ("weight_grad", layer.weight.grad)):
        a, b = got[gemm]
        assert a.cast.shape == a.hp.shape and b.cast.shape == b.hp.shape
        prod = a.cast.float() @ b.cast.float()
        assert out is not None
        torch.testing.assert_close(
            out.float(), prod, rtol=1e-5, atol=1e-5 * float(prod.abs().max())
        )


def test_high_precision_gemm_is_recorded_as_such() -> None:
    cfg = Float8Config.from_name("rowwise-gw-hp")
    layer = _layer(cfg)  # type: ignore[arg-type]
    x = torch.randn(16, 64).requires_grad_()
    rec = {r["gemm"]: r for r in _run(layer, x)}
    wg = rec["weight_grad"]
    assert all(o["high_precision"] for o in wg["operands"].values())
    assert wg["operands"]["input"]["format"] == "fp32" and wg["rel_err"] == 0.0
    assert not rec["forward"]["operands"]["input"]["high_precision"]


def test_sampling_interval_and_eval_passes() -> None:
    layer = _layer("tensorwise")
    model = nn.Sequential(layer)
    with measure_gemms(model, every=3) as g:
        for _ in range(7):
            model.train()
            model(torch.randn(4, 64)).sum().backward()
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 64))
    steps = sorted({r["step"] for r in g.records})
    assert steps == [0, 3, 6]
    assert all(r["layer"] == "0" for r in g.records)


def test_no_observer_no_records_and_nested_names() -> None:
    assert gemm_sink() is None
    model = nn.Sequential(nn.Sequential(_layer("tensorwise")), nn.ReLU())
    rec = GemmRecorder(model, every=1)
    with observing(rec):
        model(torch.randn(4, 64)).sum().backward()
    rec.remove()
    assert {r["layer"] for r in rec.records} == {"0.0"}
    n = len(rec.records)
    model(torch.randn(4, 64)).sum().backward()  # no observer: nothing more
    assert len(rec.records) == n


def test_cast_stats_and_rel_err_by_hand() -> None:
    h = torch.tensor([[1.0, 2.0], [0.5, 0.0]])
    c = torch.tensor([[1.0, 1.5], [0.0, 0.0]])
    op = CastOperand("input", h, c, "e2m1", scale=torch.tensor(0.25))
    s = cast_stats(op)
    # E2M1 max 6, 1 mantissa bit: |h| > 6 · 1.25 · 0.25 = 1.875 for the 2.0 only; 0.5 -> 0
    assert s["saturated"] == 0.25 and s["flushed"] == 0.25
    assert s["sqnr_db"] == pytest.approx(10 * math.log10(5.25 / 0.5))
    b = CastOperand("weight", torch.eye(2), torch.eye(2), "e4m3fn")
    want = float(torch.linalg.norm(c - h) / torch.linalg.norm(h))
    assert gemm_rel_err(op, b) == pytest.approx(want)
    assert (
        cast_stats(CastOperand("input", torch.zeros(3), torch.zeros(3), "e4m3fn"))["sqnr_db"]
        is None
    )


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="model"):
        GemmRecorder("x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every"):
        GemmRecorder(nn.Linear(2, 2), every=0)
    with pytest.raises(ValueError, match="rel_err_rows"):
        GemmRecorder(nn.Linear(2, 2), rel_err_rows=0)
    with pytest.raises(TypeError, match="capture"):
        with observing(object()):  # type: ignore[arg-type]
            pass


@pytest.mark.slow
def test_a_compiled_model_is_not_observed_and_never_recompiles() -> None:
    """Compiled GEMMs are not observed (documented), and the recorder's module hooks put no
    guard on the step counter: a compiled model runs 4 steps without one recompilation."""
    import torch._dynamo

    torch._dynamo.reset()  # no cache entries of earlier tests' compiles: a first compile here
    m = nn.Sequential(_layer("tensorwise", k=32, n=32), nn.ReLU())
    rec = GemmRecorder(m, every=1, auto_step=False)
    cm = torch.compile(m)
    with torch._dynamo.config.patch(error_on_recompile=True), observing(rec):
        for step in range(4):
            rec.step = step
            cm(torch.randn(8, 32)).sum().backward()
    assert rec.records == []


def test_cast_stats_nonfinite_and_per_row_scales_by_hand() -> None:
    # Inf/NaN count in nonfinite only; per-row scales 1 and 0.01: 5.0 > 448·1.0625·0.01 = 4.76
    h = torch.tensor([[1.0, math.inf], [5.0, math.nan]])
    c = torch.tensor([[1.0, 448.0], [4.48, 0.0]])
    s = torch.tensor([[1.0], [0.01]])
    st = cast_stats(CastOperand("input", h, c, "e4m3fn", scale=s, scales=s))
    assert st["nonfinite"] == 0.5 and st["saturated"] == 0.25 and st["flushed"] == 0.0
    assert st["sqnr_db"] == pytest.approx(10 * math.log10(26.0 / 0.52**2))
    assert (st["scale_min"], st["scale_max"], st["n_scales"]) == (pytest.approx(0.01), 1.0, 2)


def test_batched_rel_err_samples_matrices_and_rows() -> None:
    """Attention-like batched GEMMs: with room for every row the sampled error is the full
    one (float32 products of the same values); sampled (2 of 32 matrices), it estimates it
    (unit-normal data: the per-row errors are alike, within 10%)."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 4, 128, 32), torch.randn(8, 4, 32, 128)
    ca, cb = a.to(torch.float8_e4m3fn).float(), b.to(torch.float8_e4m3fn).float()
    op_a, op_b = CastOperand("a", a, ca, "e4m3fn"), CastOperand("b", b, cb, "e4m3fn")
    full = float(torch.linalg.norm(ca @ cb - a @ b) / torch.linalg.norm(a @ b))
    assert gemm_rel_err(op_a, op_b, rows=10**6) == pytest.approx(full, rel=1e-5)
    assert gemm_rel_err(op_a, op_b) == pytest.approx(full, rel=0.1)
