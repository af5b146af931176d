"""Ops whose output range is not their input's, at input scales far outside FP16's range
(scalify's promise): a bound far above the values (``clamp``), ``log_softmax`` of large
logits (and the cross-entropy on it), ``tanh``/``sigmoid`` of tiny or very negative
inputs, layer norm's input gradient (which carries ``1/σ`` of its input). Each output
used to be stored at a scale that left its data outside FP16 (Inf, or subnormals
rounding to 2^-24 absolute); now :func:`lowprec.scalify.core.guard` moves the magnitude
into the scale. Reference: the same function in FP32."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.scalify import scalify

_LABELS = torch.arange(8)

CASES: list[tuple[str, Callable[[Tensor], Tensor], float]] = [
    ("clamp_min", lambda t: t.clamp(min=0.25), 2.0**-20),
    ("clamp_both", lambda t: t.clamp(-(2.0**-30), 2.0**10), 2.0**-20),
    ("log_softmax", lambda t: F.log_softmax(t, -1), 2.0**20),
    ("cross_entropy", lambda t: F.cross_entropy(t, _LABELS), 2.0**20),
    ("tanh", torch.tanh, 2.0**-20),
    ("layer_norm", lambda t: F.layer_norm(t, (8,)), 2.0**20),
]


@pytest.mark.parametrize(("name", "f", "scale"), CASES, ids=[c[0] for c in CASES])
def test_output_and_input_gradient_equal_fp32(
    name: str, f: Callable[[Tensor], Tensor], scale: float
) -> None:
    """Output and input gradient (for a random output gradient) within 2e-3 relative
    (norm) of FP32's: FP16 data round to 2^-11 = 4.9e-4 relative once per op, and these
    are a few ops (measured before the fix: Inf, or 1.6e-2 to 3.7e-2 from subnormals). A
    zero reference (clamp's gradient where every value is below the bound) must be 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 8, generator=g) * scale
    go = torch.randn(8, 8, generator=g)
    outs = []
    for fn in (f, scalify(f, "fp16")):
        xs = x.clone().requires_grad_()
        y = fn(xs)
        (y * go.reshape(-1)[: y.numel()].reshape(y.shape)).sum().backward()
        assert xs.grad is not None
        outs.append((y.detach(), xs.grad))
    (y_ref, g_ref), (y, gx) = outs
    assert torch.isfinite(y).all() and torch.isfinite(gx).all()
    for a, r in ((y, y_ref), (gx, g_ref)):
        if not r.any():
            assert not a.any(), name
            continue
        err = float((a - r).norm() / r.norm())
        assert err < 2e-3, (name, err)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("exp", "eps"), [(-30, 1e-5), (-40, 1e-5), (-20, 1.0)])
def test_layer_norm_output_and_weight_gradient_where_the_variance_is_below_eps(
    bias: bool, exp: int, eps: float
) -> None:
    """``LayerNorm`` whose input variance is far below ``eps`` normalises to values far
    below 1 (x at 2^-40 under eps 1e-5: ~2^-23); stored at the affine's scale they were
    FP16 subnormals or zeros (output and weight gradient 100% off at 2^-40, 14% at
    2^-30). The output and the weight gradients now pass through the range guard. Output,
    every parameter's gradient and the input's against FP32: 2e-3 (a few FP16 roundings,
    2^-11 each; measured <= 6e-4)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.LayerNorm(64, eps=eps, bias=bias),
                            torch.nn.Linear(64, 64, bias=False))  # fmt: skip
    with torch.no_grad():
        m[0].weight.normal_()
    x = torch.randn(32, 64) * 2.0**exp
    ref, sc = copy.deepcopy(m), copy.deepcopy(m)
    xr, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y0 = ref(xr)
    y1 = scalify(sc, "fp16")(xs)
    y0.pow(2).sum().backward()
    y1.pow(2).sum().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b).norm() / b.norm())

    assert rel(y1.detach(), y0.detach()) < 2e-3
    assert xs.grad is not None and xr.grad is not None and rel(xs.grad, xr.grad) < 2e-3
    for (n, p), q in zip(sc.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert rel(p.grad, q.grad) < 2e-3, n
