"""Fuzz: lowprec.unit.functional and lowprec.unit.nn. A unit op is its torch op times one
positive constant (the forward scale), on finite float32/float64 inputs; bad dtypes,
numbers and dims are refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from lowprec.unit import functional as U
from lowprec.unit import nn as unn
from tests.fuzz._support import (
    DTYPES,
    FUZZ,
    Refused,
    assert_constant_multiple,
    attempt,
    finite,
    mostly,
    names_st,
    tensors,
)

# op name -> (unit call, torch reference, shapes of its tensor args, argument names)
Op = tuple[Callable[..., Any], Callable[..., Any], Callable[[int, int, int], list[tuple[int, ...]]]]
OPS: dict[str, Op] = {
    "linear": (
        lambda x, w: U.linear(x, w),
        lambda x, w: F.linear(x, w),
        lambda b, k, n: [(b, k), (n, k)],
    ),
    "linear_readout": (
        lambda x, w: U.linear_readout(x, w),
        lambda x, w: F.linear(x, w),
        lambda b, k, n: [(b, k), (n, k)],
    ),
    "matmul": (U.matmul, torch.matmul, lambda b, k, n: [(b, k), (k, n)]),
    "gelu": (U.gelu, F.gelu, lambda b, k, n: [(b, k)]),
    "silu": (U.silu, F.silu, lambda b, k, n: [(b, k)]),
    "relu": (U.relu, F.relu, lambda b, k, n: [(b, k)]),
    "softmax": (U.softmax, lambda x: torch.softmax(x, -1), lambda b, k, n: [(b, k)]),
    "log_softmax": (U.log_softmax, lambda x: torch.log_softmax(x, -1), lambda b, k, n: [(b, k)]),
    "silu_glu": (U.silu_glu, lambda x, g: x * F.silu(g), lambda b, k, n: [(b, k), (b, k)]),
    "layer_norm": (
        lambda x: U.layer_norm(x, (x.shape[-1],)),
        lambda x: F.layer_norm(x, (x.shape[-1],)),
        lambda b, k, n: [(b, k)],
    ),
    "rms_norm": (
        lambda x: U.rms_norm(x, (x.shape[-1],)),
        lambda x: F.rms_norm(x, (x.shape[-1],)),
        lambda b, k, n: [(b, k)],
    ),
    "dropout(eval)": (
        lambda x: U.dropout(x, 0.3, training=False),
        lambda x: x,
        lambda b, k, n: [(b, k)],
    ),
    "sdpa": (
        U.scaled_dot_product_attention,
        F.scaled_dot_product_attention,
        lambda b, k, n: [(1, b, k), (1, n, k), (1, n, k)],
    ),
    "sdpa(causal)": (
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda b, k, n: [(1, b, k), (1, b, k), (1, b, k)],
    ),
    "conv1d": (U.conv1d, F.conv1d, lambda b, k, n: [(b, k, 4), (n, k, 2)]),
    "residual_add": (
        lambda a, b: U.residual_add(a, b, 0.3),
        lambda a, b: a,
        lambda b, k, n: [(b, k), (b, k)],
    ),
}  # residual_add: checked separately (two different factors)
NAMES = (
    "x",
    "weight",
    "a",
    "b",
    "gate",
    "q",
    "k",
    "v",
    "dim",
    "residual",
    "skip",
    "normalized_shape",
    "need",
)


@FUZZ
@given(op=st.sampled_from(sorted(OPS)), dims=st.tuples(*[st.integers(0, 5)] * 3), data=st.data())
def test_unit_ops(op: str, dims: tuple[int, int, int], data: st.DataObject) -> None:
    fn, ref, shapes = OPS[op]
    first = data.draw(tensors(shape=shapes(*dims)[0], hi=1e6, lo=1e-6))
    same = data.draw(mostly(st.just(True), st.just(False)))  # one dtype, mostly
    args = [first] + [
        data.draw(tensors(shape=s, hi=1e6, lo=1e-6, dtypes=[first.dtype] if same else DTYPES))
        for s in shapes(*dims)[1:]
    ]
    y = attempt(f"U.{op}", fn, *args, names=NAMES)
    if isinstance(y, Refused):
        return
    assert all(a.is_floating_point() for a in args), "a non-float input was accepted"
    if op == "residual_add" or not all(finite(a) for a in args):
        return  # non-finite inputs: as torch (no reference factor to check)
    if any(a.dtype != torch.float64 for a in args):
        return  # low precision: rounding order differs from torch's; float64 checks the maths
    r = ref(*args)
    if not finite(r):
        return
    if op == "log_softmax" or op == "dropout(eval)" or op.endswith("norm"):
        assert torch.allclose(y, r, rtol=1e-9, atol=1e-9), op
    else:
        assert_constant_multiple(y, r, 1e-9, op)


@FUZZ
@given(
    op=st.sampled_from(["softmax", "log_softmax"]),
    dim=mostly(st.integers(-3, 2), names_st()),
    x=tensors(dtypes=[torch.float32]),
)
def test_unit_dims(op: str, dim: Any, x: torch.Tensor) -> None:
    fn = getattr(U, op)
    y = attempt(f"U.{op}(dim=)", fn, x, dim=dim, names=("dim", "x"))
    if not isinstance(y, Refused):
        assert y.shape == x.shape


NUMS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), names_st())


@FUZZ
@given(
    which=st.sampled_from(["tau", "weight", "n", "mult", "scale", "eps", "p", "weights"]),
    v=mostly(st.floats(0.01, 0.99), NUMS),
    n=st.one_of(st.integers(-2, 6), names_st()),
)
def test_unit_numbers(which: str, v: Any, n: Any) -> None:
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    calls: dict[str, Callable[[], Any]] = {
        "tau": lambda: U.residual_taus(3, "fixed", tau=v),
        "weight": lambda: U.residual_taus(3, "weighted", weight=v),
        "n": lambda: U.residual_taus(n),
        "mult": lambda: U.gelu(x, mult=v),
        "scale": lambda: U.scaled_dot_product_attention(x, x, x, scale=v),
        "eps": lambda: U.layer_norm(x, (4,), eps=v),
        "p": lambda: U.dropout(x, p=v),
        "weights": lambda: U.add(x, x, weights=(v, 1.0)),
    }
    y = attempt(f"U.*({which}=)", calls[which], names=(which, "n", "tau"))
    if isinstance(y, Refused):
        return
    if isinstance(y, list):
        assert all(0.0 < t < 1.0 for t in y), y
    else:
        assert finite(y), f"{which}={v!r} gave a non-finite result"


@FUZZ
@given(
    kind=st.sampled_from(
        [
            "Linear",
            "LinearReadout",
            "MLP",
            "MultiHeadAttention",
            "TransformerLayer",
            "TransformerDecoder",
            "LayerNorm",
            "RMSNorm",
            "Embedding",
        ]
    ),
    a=mostly(st.integers(1, 8), st.one_of(st.integers(-2, 0), names_st())),
    b=mostly(st.integers(1, 4), st.one_of(st.integers(-2, 0), names_st())),
    rows=st.integers(0, 3),
)
def test_unit_modules(kind: str, a: Any, b: Any, rows: int) -> None:
    """Modules build (or refuse their sizes by name) and their forward on a finite unit
    normal input is finite with the expected shape."""
    makers: dict[str, Callable[[], Any]] = {
        "Linear": lambda: unn.Linear(a, b),
        "LinearReadout": lambda: unn.LinearReadout(a, b),
        "MLP": lambda: unn.MLP(a),
        "MultiHeadAttention": lambda: unn.MultiHeadAttention(a * b, b),
        "TransformerLayer": lambda: unn.TransformerLayer(a * b, b),
        "TransformerDecoder": lambda: unn.TransformerDecoder(a, 2 * b, 1, b, 4),
        "LayerNorm": lambda: unn.LayerNorm(a),
        "RMSNorm": lambda: unn.RMSNorm(a),
        "Embedding": lambda: unn.Embedding(a, b),
    }
    torch.manual_seed(0)
    m = attempt(
        f"unit.nn.{kind}",
        makers[kind],
        names=(
            "in_features",
            "out_features",
            "width",
            "heads",
            "vocab_size",
            "depth",
            "normalized_shape",
            "num_embeddings",
            "embedding_dim",
            "size",
            "negative dimension",
            "divisible",
            "seq_len",
            "hidden",
        ),
    )
    if isinstance(m, Refused):
        return
    if kind == "Embedding":
        y = m(torch.randint(0, a, (rows, 3)))
    elif kind == "TransformerDecoder":
        y = m(torch.randint(0, a, (rows, 4)))[0]
    else:
        width = a * b if kind in ("MultiHeadAttention", "TransformerLayer") else a
        y = m(
            torch.randn(rows, 3, width)
            if "Attention" in kind or "Transformer" in kind
            else torch.randn(rows, width)
        )
    assert finite(y), f"{kind}: non-finite output"
