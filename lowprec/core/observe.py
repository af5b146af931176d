"""Observing what the casts of a GEMM did: the hook techniques call, the analysis implements.

A technique that multiplies cast operands (a float8 linear's three GEMMs, unit scaling's FP8
matmuls) asks :func:`gemm_sink` for a sink when it builds the GEMM, and, if it gets one,
calls it with each GEMM's two operands just before multiplying them::

    sink(gemm, a, b)        # the GEMM computes  cast(a) @ cast(b)

``gemm`` names the GEMM of the three of a linear ``y = x Wᵀ``: ``"forward"`` (``x · Wᵀ``),
``"input_grad"`` (``g · W``) or ``"weight_grad"`` (``gᵀ · x``). Each operand is a
:class:`CastOperand`: its high-precision value, the value the GEMM multiplies (the cast
value, dequantized: ``data × scale``), the format and the scale, oriented so that the GEMM is
``a @ b`` (``a``: ``(..., M, K)``, ``b``: ``(..., K, N)``). What is recorded from it (flushed
and saturated shares, SQNR, the GEMM's error) is :mod:`lowprec.analysis.gemms`' business.

A sink is captured when the forward runs and kept for the backward (autograd may run the
backward on another thread). :func:`observing` installs an observer for the block, on this
thread (a stack: the innermost one is asked). Without an observer :func:`gemm_sink` costs
one attribute read; while ``torch.compile`` traces, it returns ``None`` (compiled GEMMs are
not observed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["GEMMS", "CastOperand", "GemmObserver", "GemmSink", "gemm_sink", "observing"]

GEMMS = ("forward", "input_grad", "weight_grad")  # the three GEMMs of a linear, in order


@dataclass(frozen=True)
class CastOperand:
    """One operand of an observed GEMM.

    Attributes:
        role: what the operand is (``"input"``, ``"weight"``, ``"grad_output"`` for a
            linear's operands).
        hp: the value before the cast, oriented as the GEMM multiplies it.
        cast: the value the GEMM multiplies (``data × scale``), the shape of ``hp``; ``hp``
            itself for a high-precision GEMM.
        fmt: the format name of the cast (``"e4m3fn"``, ``"e2m1"``, ...), or the dtype
            name (``"bf16"``, ``"fp32"``) of a high-precision operand.
        scale: the scale of each element, broadcastable to ``hp`` (``None``: scale 1 or
            no cast).
        scales: the distinct scales (one per tensor, row or block; ``None`` as ``scale``).
        granularity: the cast's granularity name (``"tensor"``, ``"axis"``, ``"mx:32"``...).
    """

    role: str
    hp: Tensor
    cast: Tensor
    fmt: str
    scale: Tensor | None = None
    scales: Tensor | None = None
    granularity: str = "tensor"

    @property
    def high_precision(self) -> bool:
        """True where nothing was cast (the GEMM multiplies ``hp``)."""
        return self.cast is self.hp


GemmSink = Callable[[str, CastOperand, CastOperand], None]
"""``sink(gemm, a, b)``: one GEMM ``cast(a) @ cast(b)`` about to run."""


class GemmObserver(Protocol):
    """What :func:`observing` installs."""

    def capture(self) -> GemmSink | None:
        """The sink for the GEMMs being built now (bound to the layer that builds them), or
        ``None`` when this call is not observed (e.g. a step that is not sampled)."""
        ...


_local = threading.local()


def _stack() -> list[GemmObserver]:
    s: list[GemmObserver] | None = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


@contextmanager
def observing(observer: GemmObserver) -> Iterator[GemmObserver]:
    """Ask ``observer`` for a sink at every observed GEMM built in the block (this thread)."""
    if not callable(getattr(observer, "capture", None)):
        raise TypeError(f"observer must have a capture() method, got {type(observer).__name__}")
    s = _stack()
    s.append(observer)
    try:
        yield observer
    finally:
        s.remove(observer)


def gemm_sink() -> GemmSink | None:
    """The innermost observer's sink for a GEMM built now, or ``None`` (no observer, not
    sampled, or traced by ``torch.compile``)."""
    s: list[GemmObserver] | None = getattr(_local, "stack", None)
    if not s or torch.compiler.is_compiling():
        return None
    return s[-1].capture()


def as_cast_operand(role: str, hp: Tensor, cast: Tensor | None, fmt: str) -> CastOperand:
    """A :class:`CastOperand` of a scale-free cast (``cast`` rounded at scale 1), or of a
    high-precision operand (``cast=None``: the GEMM multiplies ``hp`` in its dtype ``fmt``)."""
    return CastOperand(role, hp, hp if cast is None else cast, fmt)
