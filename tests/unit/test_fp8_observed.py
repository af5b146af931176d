"""Unit scaling's scale-free FP8 products are observed (lowprec.core.observe) as the float8
linears are: the observed operands are what the products multiplied.

Oracle: the product's own forward output and gradients. ``y = s_out·(Q(a) Q(B))`` and the
backward GEMMs multiply the E5M2-rounded gradient by the E4M3 operands, so each must equal
the product of the observed cast operands times the op's fixed scales (float32 GEMMs on the
same values: equal to rounding, tolerance 1e-5 relative).
"""

from __future__ import annotations

import math

import torch

from lowprec.analysis.gemms import GemmRecorder
from lowprec.core.observe import CastOperand, GemmSink, observing
from lowprec.unit import functional as U


def test_linear_fp8_gemms_are_observed_and_exact() -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    got: dict[str, tuple[CastOperand, CastOperand]] = {}

    class Keep:
        def capture(self) -> GemmSink:
            return lambda gemm, a, b: got.__setitem__(gemm, (a, b))

    with observing(Keep()):
        y = U.linear(x, w, None, float8=True)
        g = torch.randn_like(y)
        y.backward(g)
    assert set(got) == {"forward", "input_grad", "weight_grad"}
    fa, fb = got["forward"]
    assert (fa.role, fb.role, fa.fmt) == ("input", "weight", "e4m3fn")
    prod = fa.cast @ fb.cast
    ratio = float((y.detach() * prod).sum() / (prod * prod).sum())  # y = s_out · prod
    torch.testing.assert_close(y.detach(), ratio * prod, rtol=1e-5, atol=1e-5)
    assert math.isclose(ratio, 1 / math.sqrt(64), rel_tol=1e-3)  # the forward scale 1/√K
    ga, gb = got["input_grad"]
    assert ga.role == "grad_output" and ga.fmt == "e5m2"
    d = ga.cast @ gb.cast  # ∂x = s_x · Q(g_y) W, g_y the gradient into the product
    assert x.grad is not None
    torch.testing.assert_close(x.grad, x.grad.norm() / d.norm() * d, rtol=1e-5, atol=1e-5)
    wa, wb = got["weight_grad"]
    dw = wa.cast @ wb.cast
    assert w.grad is not None
    torch.testing.assert_close(w.grad, w.grad.norm() / dw.norm() * dw, rtol=1e-5, atol=1e-5)


def test_attention_products_get_numbered_gemms() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(3))
    rec = GemmRecorder(torch.nn.Module(), every=1, auto_step=False)  # no module: "model"
    with observing(rec):
        s = U.matmul(q, k.transpose(-2, -1), float8=True)
        out = U.matmul(s.softmax(-1), v, float8=True)
        out.sum().backward()
    gemms = sorted(r["gemm"] for r in rec.records)
    assert gemms == sorted(
        ["forward", "forward#2", "input_grad", "input_grad#2", "weight_grad", "weight_grad#2"]
    )
    assert all(set(r["operands"]) <= {"a", "b", "grad_output"} for r in rec.records)
