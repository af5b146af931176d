"""Shared machinery of the fuzz suite: settings, input strategies, the call contract.

The contract every fuzzed call must meet (issue 14): it returns a correct result (checked
against a reference where one exists) or raises ``ValueError``/``TypeError`` whose message
names the argument at fault. Any other exception fails the test. Where a function's
documented contract is to return non-finite values for non-finite input, the test checks
that contract instead.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Examples per test function; CI runs the default. LOWPREC_FUZZ_EXAMPLES raises it locally.
EXAMPLES = int(os.environ.get("LOWPREC_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # deterministic in CI: the same examples on every run
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

CALLS: Counter[str] = Counter()  # entry point -> calls made (reported after the run)
REFUSED: Counter[str] = Counter()  # entry point -> calls refused with ValueError/TypeError


class Refused:
    """The result of a call that raised ValueError/TypeError naming its argument."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def __repr__(self) -> str:
        return f"Refused({type(self.exc).__name__}: {self.exc})"


def attempt(
    entry: str, fn: Callable[..., Any], *args: Any, names: Sequence[str], **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)``, or :class:`Refused` if it raised ValueError/TypeError
    naming one of ``names`` (the arguments it may blame). Any other exception, or an error
    naming none of them, propagates / fails."""
    CALLS[entry] += 1
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert any(n in msg for n in names), (
            f"{entry}: {type(e).__name__} names none of {list(names)}: {msg}"
        )
        REFUSED[entry] += 1
        return Refused(e)


# ---- inputs -----------------------------------------------------------------------------

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
BAD_DTYPES = [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8]
DTYPES = FLOAT_DTYPES + BAD_DTYPES
SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-300, -1e300, 1e300, 5e-324, 1e-45]


def magnitudes(lo: float = 1e-300, hi: float = 1e300) -> st.SearchStrategy[float]:
    """Signed floats log-uniform over ``[lo, hi]`` (so 1e-300 and 1e300 are as likely as 1)."""
    return st.builds(
        lambda e, s: s * 10.0**e,
        st.floats(math.log10(lo), math.log10(hi)),
        st.sampled_from([1.0, -1.0]),
    )


def values(special: bool = True, lo: float = 1e-300, hi: float = 1e300) -> st.SearchStrategy[float]:
    base = st.one_of(magnitudes(lo, hi), st.floats(-4, 4, allow_nan=False))
    return st.one_of(base, st.sampled_from(SPECIAL)) if special else base


def shapes(
    min_dims: int = 0, max_dims: int = 3, max_side: int = 5
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes with 0-dim and zero-size dims included."""
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def tensors(
    draw: st.DrawFn,
    shape: tuple[int, ...] | None = None,
    dtypes: Sequence[torch.dtype] = DTYPES,
    special: bool = True,
    lo: float = 1e-300,
    hi: float = 1e300,
) -> torch.Tensor:
    """A tensor of a drawn (or given) shape and dtype; values drawn in float64 and cast
    (so 1e300 becomes inf in float32, as it would for a user)."""
    shp = draw(shapes()) if shape is None else shape
    good = [d for d in dtypes if d in FLOAT_DTYPES]
    bad = [d for d in dtypes if d not in FLOAT_DTYPES]
    if good and bad:
        dtype = draw(mostly(st.sampled_from(good), st.sampled_from(bad)))
    else:
        dtype = draw(st.sampled_from(list(dtypes)))
    n = math.prod(shp)
    vals = draw(st.lists(values(special, lo, hi), min_size=n, max_size=n))
    a = np.array(vals, dtype=np.float64).reshape(shp)
    t = torch.from_numpy(a)
    if dtype in (torch.int32, torch.int64, torch.uint8):
        t = torch.nan_to_num(t, 0.0, 100.0, -100.0).clamp(-100, 100).to(dtype)
    else:
        with np.errstate(all="ignore"):
            t = t.to(dtype)
    return t


def mostly(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` seven times in eight, ``bad`` otherwise: most calls get past validation."""
    # (st.one_of of repeated strategies draws branches ~uniformly: flag with sampled_from)
    return st.sampled_from([False] * 7 + [True]).flatmap(lambda b: bad if b else good)


def names_st() -> st.SearchStrategy[Any]:
    """Bad names and types: random strings, near-misses, None, numbers, lists."""
    return st.one_of(
        st.text(max_size=8),
        st.sampled_from(
            [
                "",
                "fp8",
                "E4M3FN",
                "e4m3fn ",
                "row:2",
                "block:0x0",
                "mx:0",
                "axis:7",
                "tensorwise2",
                "nv:3",
                "block:1x-1",
                "fp16-unit2",
            ]
        ),
        st.none(),
        st.integers(-3, 3),
        st.floats(allow_nan=True),
        st.just([1, 2]),
    )


# ---- references -------------------------------------------------------------------------


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.numel() else True


def assert_close_normwise(y: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> None:
    """``max |y - ref| <= rtol · max |ref|`` (normwise: robust to cancellation), finite."""
    assert y.shape == ref.shape, f"{what}: shape {tuple(y.shape)} != {tuple(ref.shape)}"
    if not y.numel():
        return
    y64, r64 = f64(y), f64(ref)
    assert finite(y64), f"{what}: non-finite result for finite reference"
    err = float((y64 - r64).abs().max())
    scale = float(r64.abs().max())
    assert err <= rtol * scale + 1e-300, f"{what}: error {err:.3g} > {rtol:.3g} · {scale:.3g}"


def assert_constant_multiple(y: torch.Tensor, ref: torch.Tensor, rtol: float, what: str) -> float:
    """``y = c · ref`` for one finite constant ``c > 0`` (normwise ``rtol``); returns c."""
    assert y.shape == ref.shape, f"{what}: shape {tuple(y.shape)} != {tuple(ref.shape)}"
    y64, r64 = f64(y), f64(ref)
    if not y.numel() or float(r64.abs().max()) == 0.0:
        assert float(y64.abs().max()) == 0.0 if y.numel() else True, f"{what}: ref is 0, y not"
        return 1.0
    k = int(r64.abs().flatten().argmax())
    c = float(y64.flatten()[k] / r64.flatten()[k])
    assert math.isfinite(c) and c > 0, f"{what}: factor {c}"
    assert_close_normwise(y64, c * r64, rtol, what)
    return c
