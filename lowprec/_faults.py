"""Placed faults for the interrupt stress tests: a signal at a named point of a step.

Training code calls :func:`point` at the moments where an interrupt could land: start-up
(``"startup"``), after the forward (``"forward"``) and the backward (``"backward"``),
around the optimizer step (``"optimizer"``), before the loss scaler's update
(``"scaler"``), between the master weights' update and their write-back into the model
(``"writeback"``), inside the checkpoint write before its rename (``"checkpoint"``) and
before the metrics append (``"metrics"``). Nothing happens unless a fault is armed, by
:func:`arm` or by the environment variable ``LOWPREC_FAULT="<point>:<k>:<how>"`` read at
import: the ``k``-th call (1-based) of ``point`` then delivers ``how`` to this process:
``int`` (SIGINT) or ``term`` (SIGTERM), handled by the program as a real signal, or
``kill`` (SIGKILL: the process dies at once). Standard library only; unarmed, a point is
one global lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "arm", "point"]

POINTS = (
    "startup",
    "forward",
    "backward",
    "optimizer",
    "scaler",
    "writeback",
    "checkpoint",
    "metrics",
)
_HOW = {"int": signal.SIGINT, "term": signal.SIGTERM, "kill": signal.SIGKILL}

_armed: tuple[str, int, str] | None = None
_count = 0


def arm(spec: str | None) -> None:
    """Arm ``"<point>:<k>:<how>"`` (``None``: disarm); ``ValueError`` on a bad spec."""
    global _armed, _count
    _count = 0
    if spec is None:
        _armed = None
        return
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in POINTS or parts[2] not in _HOW:
        raise ValueError(
            f"LOWPREC_FAULT must be '<point>:<k>:<how>' with point in {POINTS} and how in "
            f"{tuple(_HOW)}, got {spec!r}"
        )
    try:
        k = int(parts[1])
    except ValueError:
        raise ValueError(f"LOWPREC_FAULT: k must be a positive int, got {parts[1]!r}") from None
    if k < 1:
        raise ValueError(f"LOWPREC_FAULT: k must be a positive int, got {k}")
    _armed = (parts[0], k, parts[2])


def point(name: str) -> None:
    """A place an interrupt could land (see the module docstring)."""
    global _count
    if _armed is None or _armed[0] != name:
        return
    _count += 1
    if _count == _armed[1]:
        os.kill(os.getpid(), _HOW[_armed[2]])


arm(os.environ.get("LOWPREC_FAULT") or None)
