"""Checks of a public function's plain arguments, shared by the techniques: each returns
the value as the function uses it, or raises ``TypeError``/``ValueError`` naming the
argument (an accepted value the function would misread is a silent wrong number)."""

from __future__ import annotations

import math

__all__ = ["check_flag", "check_number"]


def check_flag(name: str, v: object) -> bool:
    """``v`` if it is a bool; ``TypeError`` naming ``name`` otherwise (a string such as
    ``"no"`` is truthy: taken as ``True`` it would switch the option on)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return v


def check_number(name: str, v: object, low: float = -math.inf, *, open_low: bool = False) -> float:
    """``v`` as a finite float ``>= low`` (``> low`` with ``open_low``); ``TypeError`` /
    ``ValueError`` naming ``name`` otherwise (NaN and ±inf included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or f < low or (open_low and f == low):
        rel = ">" if open_low else ">="
        bound = "" if low == -math.inf else f" and {rel} {low:g}"
        raise ValueError(f"{name} must be finite{bound}, got {v!r}")
    return f
