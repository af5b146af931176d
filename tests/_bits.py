"""Helpers for exact comparisons, shared by the test folders (core, float8): bit patterns,
the input cases of the fast-path tests and fast-versus-reference runs.

(Test modules import shared helpers from ``_``-prefixed modules like this one, never from
another ``test_*.py`` module or from a ``conftest.py``: ``tests/test_layers.py`` checks it.)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from lowprec.core import layout

SPECIALS = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-42, 1e30, -1e30,
            448.0, 449.0, 464.0, 465.0, 57344.0, 61440.0, 1e-8, 6.0, 7.0, 2.0**-126]  # fmt: skip


def bits(t: Tensor) -> Tensor:
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_values(a: Tensor, b: Tensor) -> bool:
    """Equal bits, except that NaN payloads may differ (a NaN times a NaN scale keeps one
    operand's payload or the other's, depending on the machine code)."""
    nan = torch.isnan(a)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(nan, torch.isnan(b))
        and torch.equal(bits(a)[~nan], bits(b)[~nan])
    )


def cases(rows: int = 40, cols: int = 72) -> Iterator[tuple[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(rows, cols, generator=g) * 3
    sp = base.clone()
    sp.view(-1)[: len(SPECIALS) * 7 : 7] = torch.tensor(SPECIALS)
    for name, x in [("randn", base), ("big", base * 1e4), ("tiny", base * 1e-6),
                    ("zeros", torch.zeros(rows, cols)), ("specials", sp)]:  # fmt: skip
        yield name, x
        yield name + "_T", x.t()
    for dt in (torch.bfloat16, torch.float16):
        yield f"randn_{dt}", base.to(dt)
        yield f"specials_{dt}", sp.to(dt)


def both(fn: object, *args: object, **kw: object) -> tuple[object, object]:
    """``fn(*args)`` with the fast paths, then with the reference paths."""
    assert callable(fn)
    fast = fn(*args, **kw)
    with layout.reference_paths():
        ref = fn(*args, **kw)
    return fast, ref
