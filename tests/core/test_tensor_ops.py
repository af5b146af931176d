"""Layout ops of ScaledTensor (issue 40 item 4, ``lowprec.core.tensor_ops``): each supported
op on ``(data, scale)`` gives exactly the values of the same op on the dequantized tensor
(bit for bit: the payloads and scales are only moved), and an op that would cut a scale
block is refused with the layout reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lowprec import ScaledTensor, quantize_scaled

X = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
GRANS = ["tensor", "row", "column", "block:1x32", "block:2x16"]


def _q(g: str, x: torch.Tensor = X) -> ScaledTensor:
    return quantize_scaled(x, "e4m3fn", granularity=g)


def _same(got: Any, want: Any) -> None:
    if isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _same(a, b)
        return
    assert isinstance(got, ScaledTensor)
    assert got.shape == want.shape
    assert torch.equal(got.dequantize(), want)


OPS: dict[str, Callable[[Any], Any]] = {
    "t": lambda q: q.t(),
    "transpose": lambda q: q.transpose(0, 1),
    "permute": lambda q: q.permute(1, 0),
    "rows": lambda q: q[2:4],
    "cols_aligned": lambda q: q[:, 32:64],
    "split_rows": lambda q: torch.split(q, 2, 0),
    "chunk_cols": lambda q: q.chunk(2, dim=1),
    "split_sizes": lambda q: torch.split(q, [2, 2], 0),
    "select_row_then_cols": lambda q: q[:, :32][2:4],
    "unbind_rows": lambda q: q.unbind(0),
    "cat_rows": lambda q: torch.cat([q[:2], q[2:]], 0),
    "cat_cols": lambda q: torch.cat([q[:, :32], q[:, 32:]], 1),
}


@pytest.mark.parametrize("g", GRANS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_layout_op_equals_the_op_on_the_values(g: str, op: str) -> None:
    q = _q(g)
    f = OPS[op]
    if op == "unbind_rows" and g == "block:2x16":
        with pytest.raises(ValueError, match="cuts the ScaledTensor's scale blocks of 2"):
            f(q)
        return
    _same(f(q), f(q.dequantize()))


def test_transpose_keeps_a_tensor_scale_and_its_granularity() -> None:
    q = _q("tensor")
    t = q.t()
    assert t.scale is q.scale and t.granularity == q.granularity
    r = _q("row").t()
    assert tuple(r.scale.shape) == (1, 4) and r.granularity is None  # now column-scaled


def test_views_of_a_tensor_scaled_value() -> None:
    q = _q("tensor")
    _same(q.reshape(2, 128), X.reshape(2, 128) * 0 + q.dequantize().reshape(2, 128))
    _same(q.view(4, 2, 32), q.dequantize().view(4, 2, 32))


@pytest.mark.parametrize("g", ["row", "block:1x32"])
def test_reshape_of_a_finer_scale_is_refused(g: str) -> None:
    with pytest.raises(ValueError, match="cannot be reshaped: its scale blocks would be split"):
        _q(g).reshape(2, 128)


@pytest.mark.parametrize(
    ("g", "op", "match"),
    [
        ("block:1x32", lambda q: q[:, 16:48], r"\[16:48\] along dim 1 cuts .* blocks of 32"),
        ("block:2x16", lambda q: q[1:3], r"\[1:3\] along dim 0 cuts .* blocks of 2"),
        ("block:1x32", lambda q: q[:, ::2], "a step of 2 along dim 1 cuts the scale blocks"),
        ("block:1x32", lambda q: q[:, 5], "select: one element of dim 1 cuts"),
        ("block:1x32", lambda q: torch.split(q, 24, 1), r"\[0:24\] along dim 1 cuts"),
    ],
)  # fmt: skip
def test_ops_that_cut_a_scale_block_are_refused(g: str, op: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        op(_q(g))


def test_cat_keeps_equal_scales_and_joins_whole_blocks() -> None:
    a, b = _q("tensor"), _q("tensor", X * 2)
    joined = torch.cat([a, a], 0)
    assert joined.scale is a.scale and joined.granularity == a.granularity
    _same(joined, torch.cat([a.dequantize()] * 2, 0))
    # two tensor scales over equal extents: one block each, a valid (new) layout
    ab = torch.cat([a, b], 0)
    assert tuple(ab.scale.shape) == (2, 1) and ab.granularity is None
    _same(ab, torch.cat([a.dequantize(), b.dequantize()], 0))
    with pytest.raises(ValueError, match=r"block sizes \[2, 4\]"):
        torch.cat([a, b[:2]], 0)  # blocks of 4 and 2 rows: not one layout
    ra, rb = _q("row"), _q("row", X * 2)
    _same(torch.cat([ra, rb], 0), torch.cat([ra.dequantize(), rb.dequantize()], 0))
    _same(torch.cat([ra, rb], 1), torch.cat([ra.dequantize(), rb.dequantize()], 1))
    with pytest.raises(ValueError, match="differ in format, dtype or granularity"):
        torch.cat([a, quantize_scaled(X, "e5m2")], 0)
    with pytest.raises(ValueError, match="joins only ScaledTensors"):
        torch.cat([a, X], 0)


def test_copy_into_a_plain_tensor_writes_the_values() -> None:
    for g in GRANS:
        q = _q(g)
        out = torch.empty(4, 64)
        out.copy_(q)
        assert torch.equal(out, q.dequantize())
        half = torch.empty(4, 64, dtype=torch.bfloat16)
        half.copy_(q)
        assert torch.equal(half, q.dequantize().bfloat16())
    with pytest.raises(TypeError, match="a plain tensor cannot be copied into a ScaledTensor"):
        _q("tensor").copy_(X)


def test_index_put_of_equally_scaled_values() -> None:
    q = _q("tensor")
    rows = quantize_scaled(X[:1] * 0.5, "e4m3fn")
    with pytest.raises(ValueError, match="scale differs"):
        q.index_put_((torch.tensor([1]),), rows)
    same = ScaledTensor(
        (X[:1] * 0.5 / q.scale).to(torch.float8_e4m3fn), q.scale, fmt="e4m3fn", dtype=q.dtype
    )
    want = q.dequantize().clone()
    want[1] = same.dequantize()[0]
    q.index_put_((torch.tensor([1]),), same)
    assert torch.equal(q.dequantize(), want)
    with pytest.raises(ValueError, match="values must be a ScaledTensor of the same format"):
        q.index_put_((torch.tensor([0]),), X[:1])
    with pytest.raises(ValueError, match="only into a ScaledTensor with a tensor-wise scale"):
        _q("row").index_put_((torch.tensor([0]),), same)


def test_domain_tensors_keep_their_own_rules() -> None:
    # The layout rules apply to ScaledTensors of no domain: another domain's tensor still
    # goes to its own rules (here: none, so the op is named as unsupported).
    q = _q("tensor")
    other = ScaledTensor._wrap(q.qdata, q.scale, q.dtype, "e4m3fn", domain="some-domain")
    with pytest.raises(NotImplementedError, match=r"no rule for aten\.t\.default"):
        other.t()
