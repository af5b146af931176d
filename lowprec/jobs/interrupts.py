"""Interrupts at a step boundary: SIGINT (Ctrl-C) and SIGTERM only set a flag.

A training loop runs inside ``with StopSignals() as signals:`` and looks at
``signals.received`` between steps: a signal never cuts a step in half (the optimizer
update, the write-back to low-precision weights, the amax-history update, the evaluation
and the metrics line all finish), so the checkpoint written after it is consistent. A
second signal while the first is being handled raises ``KeyboardInterrupt`` at once (an
abort; the run directory stays intact because its writes are atomic).

Handlers are installed only in the main thread, and never for a signal the process
ignores (``nohup``, a background job of a non-interactive shell); the previous handlers
come back on exit.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["Interrupted", "StopSignals", "exit_code"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's exit status for a process ended by signal ``signum``: ``128 + signum``
    (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


class Interrupted(KeyboardInterrupt):
    """A run stopped at a step boundary after SIGINT/SIGTERM, its checkpoint written.

    ``step``: the steps done (the checkpoint's step); ``signum``: the signal; ``out``: the
    run directory."""

    def __init__(self, step: int, signum: int, out: str) -> None:
        super().__init__(step, signum, out)
        self.step, self.signum, self.out = step, signum, out

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return (
            f"interrupted ({self.signal_name}) after step {self.step}: checkpoint written to "
            f"{self.out}; continue with --resume"
        )


class StopSignals:
    """Context manager: SIGINT/SIGTERM set :attr:`received` (the first signal's number);
    a second one raises ``KeyboardInterrupt``."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}
        self._protected = self._abort = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if self._protected:
                self._abort = True  # raised when the protected write ends
                return
            raise KeyboardInterrupt  # the second signal: abort now
        self.received = signum

    @contextlib.contextmanager
    def protect(self) -> Iterator[None]:
        """A write that a second signal must not cut (a ``KeyboardInterrupt`` raised inside
        ``torch.save`` surfaces as a ``RuntimeError``): the abort waits for its end."""
        self._protected = True
        try:
            yield
        finally:
            self._protected = False
        if self._abort:
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in _SIGNALS:
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
