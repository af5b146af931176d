"""Strict JSON for every file lowprec writes: non-finite numbers as strings.

JSON has no NaN or Infinity. Python's ``json`` writes them as the bare tokens ``NaN`` and
``Infinity`` by default, which strict parsers (``JSON.parse``, ``jq``, most languages'
libraries) reject. :func:`dumps` is ``json.dumps(..., allow_nan=False)`` after replacing,
anywhere in the value, a float NaN by the string ``"NaN"``, +Inf by ``"Infinity"`` and
-Inf by ``"-Infinity"`` (the spellings that JavaScript's ``Number()`` and Python's
``float()`` read back). :func:`loads` turns those three strings back into floats, and
still accepts the bare tokens of files written before. The one cost: a string value that
is exactly one of the three spellings reads back as a float.

Standard library only, so that every layer may use it (as ``_startup`` and ``_faults``).

Example:
    >>> dumps({"loss": float("nan"), "steps": [1, float("-inf")]})
    '{"loss": "NaN", "steps": [1, "-Infinity"]}'
    >>> loads('{"loss": "NaN"}')["loss"] != loads('{"loss": "NaN"}')["loss"]  # NaN
    True
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["NONFINITE", "dumps", "loads"]

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    return v


def _decode(v: Any) -> Any:
    if isinstance(v, str):
        return NONFINITE.get(v, v)
    if isinstance(v, dict):
        return {k: _decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def dumps(obj: Any, indent: int | None = None) -> str:
    """``obj`` as strict JSON text, non-finite floats as strings (see the module
    docstring). ``TypeError`` for a value JSON cannot hold (as ``json.dumps``)."""
    return json.dumps(_encode(obj), indent=indent, allow_nan=False)


def loads(text: str | bytes) -> Any:
    """Parse JSON text written by :func:`dumps` (or by ``json.dumps``): the strings
    ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` become floats. ``json.JSONDecodeError``
    (a ``ValueError``) for text that is not JSON."""
    return _decode(json.loads(text))
