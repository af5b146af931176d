"""In-place ops on views of scalify tensors (``z[1:3] = y``, ``z[0] = ...``, ``z.t()[0:2]
.copy_(...)``, ``z[:, 2:4].mul_(3)``, ...) write into the viewed tensor, as in torch: the
view and its base share storage, so the values go into that storage at the view's scale
(:func:`lowprec.scalify.core.assign`). Before, the view took new data and the base kept
its old values: a silently wrong result, no fallback counted."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from lowprec.scalify import scalify

Case = Callable[[Tensor, Tensor], Tensor]


def _slice_copy(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    z[1:3] = y[1:3]
    return z


def _select_copy(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    z[0] = y[0]
    return z


def _slice_add(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    z[1:3].add_(y[1:3])
    return z


def _column_mul(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    z[:, 2:4].mul_(3.0)
    return z


def _slice_fill(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    z[1:3].fill_(2.5)
    z[:, 1] = 7.0
    return z


def _masked_on_view(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    z[1:3].masked_fill_(z[1:3] > 0, 0.0)
    z[3].relu_()
    return z


def _transpose_copy(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    z.t()[0:2].copy_(y.t()[0:2])
    return z


def _flat_view_add(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    z.view(-1)[:6].add_(y.view(-1)[6:12])
    return z


def _base_after_view(x: Tensor, y: Tensor) -> Tensor:
    z = x * 1
    row = z[2]
    z.mul_(2.0)  # the view sees the base's in-place op
    return torch.cat([z, row[None]])


CASES = [_slice_copy, _select_copy, _slice_add, _column_mul, _slice_fill, _masked_on_view,
         _transpose_copy, _flat_view_add, _base_after_view]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.strip("_"))
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("scale", [1.0, 2.0**20, 2.0**-20])
def test_inplace_on_a_view_equals_fp32(case: Case, fmt: str, scale: float) -> None:
    """Values equal FP32's to 2e-3 of the largest: FP16 data (both presets store FP16
    outside matmuls) round each element to 2^-11 relative, once per op. Scales 2^±20: the
    values far outside FP16's range, as scalify promises."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g) * scale
    y = torch.randn(4, 6, generator=g) * (10 * scale)
    ref = case(x.clone(), y.clone())
    got = scalify(case, fmt)(x.clone(), y.clone())
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-3 * float(ref.abs().max()))


def test_gradients_through_a_slice_assignment() -> None:
    """``z = 2x; z[1:3] = 3y; loss = Σ z·w``: ``∂x = 2w`` outside rows 1-2 and 0 inside,
    ``∂y = 3w`` inside and 0 outside, as in FP32 (exact: powers of two and 3·w in FP16)."""

    def f(x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        z = x * 2
        z[1:3] = y[1:3] * 3
        return (z * w).sum()

    g = torch.Generator().manual_seed(1)
    x, y, w = (torch.randn(4, 6, generator=g) for _ in range(3))
    grads = []
    for fn in (f, scalify(f, "fp16")):
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        fn(xs, ys, w).backward()
        assert xs.grad is not None and ys.grad is not None
        grads.append((xs.grad, ys.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_a_write_beyond_the_views_scale_rescales_the_storage() -> None:
    """Values 2^40 times a view's scale would overflow its FP16 storage at that scale: the
    whole storage (the base, the view) moves to the larger per-tensor scale first, so the
    written rows are right and the base's other rows keep their values to FP16's rounding
    at that scale (rows of size 1 next to 2^40: below its resolution, as one FP16 tensor
    of both would hold them). The written rows must equal FP32's to 2^-11 relative."""

    def f(x: Tensor, y: Tensor) -> Tensor:
        z = x * 1
        z[1:3] = y[1:3] * 2.0**40
        return z

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    ref, got = f(x, y), scalify(f, "fp16")(x, y)
    torch.testing.assert_close(got[1:3], ref[1:3], rtol=2.0**-10, atol=0)
    assert float((got - ref).abs().max()) <= 2e-3 * float(ref.abs().max())


def test_compiled_slice_assignment_equals_eager() -> None:
    """Under ``torch.compile`` (AOT autograd functionalizes the data's views) the same
    values as eager."""
    f = scalify(_slice_copy, "fp16")
    x, y = torch.randn(4, 6), torch.randn(4, 6) * 10
    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager", fullgraph=False)(x, y)
    torch.testing.assert_close(got, f(x, y), rtol=0, atol=0)
    torch.testing.assert_close(got, _slice_copy(x, y), rtol=0, atol=2e-3 * 10 * 4)


def _vecmat(v: Tensor, m: Tensor) -> Tensor:
    return v @ m


def _linear_1d(v: Tensor, m: Tensor) -> Tensor:
    return torch.nn.functional.linear(v, m.t())  # no bias: mm, then squeeze_


def _matvec_t(v: Tensor, m: Tensor) -> Tensor:
    return (v @ m).softmax(0)  # softmax over the 5 outputs: a (1, 5) result takes dim 0 alone


def _inplace_views(v: Tensor, m: Tensor) -> Tensor:
    y = m * 1.0
    y.t_()  # (5, 16)
    y.unsqueeze_(0)  # (1, 5, 16)
    y.transpose_(1, 2)  # (1, 16, 5)
    y.squeeze_(0)  # (16, 5)
    return v @ y


@pytest.mark.parametrize("fn", [_vecmat, _linear_1d, _matvec_t, _inplace_views])
@pytest.mark.parametrize("scale", [1.0, 2.0**-20])
def test_in_place_view_ops_change_the_shape(fn: Callable[[Tensor, Tensor], Tensor],
                                            scale: float) -> None:  # fmt: skip
    """torch's matmul of a 1-D and a 2-D tensor ends in an in-place ``squeeze_`` of the
    product; under scalify the wrapper kept its (1, N) shape (softmax(0) of it gave ones,
    and no fallback was counted). In-place view ops now reshape the ScaledTensor itself.
    Outputs and both inputs' gradients equal FP32 within FP16's rounding (2^-11 relative
    per element, a few of them summed: 4e-3)."""
    torch.manual_seed(0)
    v, m = torch.randn(16) * scale, torch.randn(16, 5) * scale
    vr, mr = v.clone().requires_grad_(True), m.clone().requires_grad_(True)
    want = fn(vr, mr)
    vs, ms = v.clone().requires_grad_(True), m.clone().requires_grad_(True)
    got = scalify(fn, "fp16")(vs, ms)
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=4e-3, atol=4e-3 * float(want.abs().max()))
    g = torch.randn(want.shape)
    want.backward(g)
    got.backward(g)
    # softmax's backward p·(g - Σ p·g) takes FP16's rounding of p (2^-11) times |g| (up
    # to 3) on each of 5 terms, and ∂m = v ⊗ ∂y multiplies that by |v| (up to 3): 3e-2
    # of the largest gradient
    tol = 3e-2 if fn is _matvec_t else 4e-3
    for a, b in ((vs.grad, vr.grad), (ms.grad, mr.grad)):
        assert a is not None and b is not None and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
