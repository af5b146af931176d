"""Ctrl-C (or SIGTERM) while the ``lowprec`` command starts: one line, never a traceback.

Importing torch and the package takes seconds, and a SIGINT then would raise
``KeyboardInterrupt`` somewhere inside an import. In a ``lowprec`` command process (the
console script, ``python -m lowprec``, or a ``torchrun -m lowprec`` worker) the package's
``__init__`` installs :func:`_quit` for SIGINT first thing; :func:`lowprec.cli.main`
puts Python's own handler back once its error handling is in place, and
:func:`guard_shutdown` takes SIGINT again once the command has its exit code, so a late
Ctrl-C (the second of a double Ctrl-C, say) cannot raise ``KeyboardInterrupt`` inside the
interpreter's shutdown. That handler is Python code, and Python's finalisation resets a
Python-level SIGINT handler to the default action, after which a Ctrl-C would kill the
process by the signal instead of exiting with the command's status; so the last ``atexit``
callback (registered at start-up, hence run after any registered later) ignores SIGINT for
the rest of the teardown. A library import (``import lowprec`` in a user's program) changes
no handler. Standard library only.

SIGTERM gets SIGINT's treatment at each of these points, unless the process inherited it
ignored (``nohup``): the start-up line with 128 + 15; during the command,
:func:`end_startup_guard` makes it raise :class:`Terminated` (a ``KeyboardInterrupt``
carrying the signal, which the command reports as it reports a Ctrl-C, with 143), where
Python's default would kill the process silently; after the command, the quiet exit; in the
last teardown, ignored.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

__all__ = [
    "Terminated",
    "end_startup_guard",
    "guard_shutdown",
    "guard_startup",
    "raise_terminated",
    "run_then_guard",
    "signal_of",
]

_guarded = False
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM in a ``lowprec`` command process, raised as a Ctrl-C is
    (:func:`end_startup_guard`); ``signum`` is ``signal.SIGTERM``."""

    signum: int = signal.SIGTERM


def signal_of(e: BaseException) -> int:
    """The signal a ``KeyboardInterrupt`` stands for: its ``signum`` (:class:`Terminated`,
    :class:`lowprec.jobs.interrupts.Interrupted`), else SIGINT."""
    signum = getattr(e, "signum", None)
    return int(signum) if isinstance(signum, int) else int(signal.SIGINT)


def raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _is_cli() -> bool:
    argv = list(getattr(sys, "orig_argv", sys.argv))
    if Path(sys.argv[0]).name == "lowprec":
        return True
    return any(a == "-m" and b == "lowprec" for a, b in itertools.pairwise(argv))


def _quit(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write("lowprec: interrupted while starting; nothing was written\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def guard_startup() -> None:
    """In a ``lowprec`` command process, make SIGINT, and SIGTERM unless it is ignored, end
    it quietly until :func:`end_startup_guard`; elsewhere do nothing."""
    global _guarded
    if not _is_cli() or threading.current_thread() is not threading.main_thread():
        return
    # each on its own: a background job of a shell inherits SIGINT ignored, not SIGTERM
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _quit)
        _guarded = True
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _quit)
        _guarded = True
    if _guarded:
        atexit.register(_ignore_late_sigint)


def _ignore_late_sigint() -> None:
    """After the command's shutdown guard, ignore SIGINT and SIGTERM for the rest of the
    teardown (see the module docstring): the process then exits with the command's own
    status."""
    for s in _SIGNALS:
        if signal.getsignal(s) is _exit_quietly:
            signal.signal(s, signal.SIG_IGN)


def end_startup_guard() -> None:
    """Give SIGINT back to Python (``KeyboardInterrupt``) if :func:`guard_startup` took it,
    and make SIGTERM raise :class:`Terminated` if it took that too."""
    global _guarded
    if _guarded and signal.getsignal(signal.SIGINT) is _quit:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _guarded and signal.getsignal(signal.SIGTERM) is _quit:
        signal.signal(signal.SIGTERM, raise_terminated)
    _guarded = False


def _exit_quietly(signum: int, frame: FrameType | None) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(128 + signum)


def guard_shutdown() -> None:
    """In a ``lowprec`` command process whose command has finished (its output written, its
    exit code known), make SIGINT (and SIGTERM, unless it is ignored) end it at once with
    ``128 + signal``: the job is over, so nothing is left to save, and Python's shutdown
    (``atexit`` callbacks, finalizers) must not print a ``KeyboardInterrupt`` traceback.
    Elsewhere (a library call of :func:`lowprec.cli.main`) do nothing."""
    if _is_cli() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_quietly)
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            signal.signal(signal.SIGTERM, _exit_quietly)


def run_then_guard(command: Callable[[], int]) -> int:
    """``command()`` (a command with its own Ctrl-C handling, returning its exit code), then
    :func:`guard_shutdown`, with no window for a traceback in between: in a ``lowprec``
    command process a Ctrl-C that lands after the command's handlers and before the guard
    is installed (the second of a double Ctrl-C, say) ends the command with
    ``128 + signal`` (:func:`signal_of`; a SIGTERM: 143), quietly. In a library call such a
    ``KeyboardInterrupt`` propagates."""
    code = 128 + signal.SIGINT
    try:
        try:
            code = command()
        finally:  # installed even while a late KeyboardInterrupt (or SystemExit) unwinds
            while True:
                try:
                    guard_shutdown()
                    break
                except KeyboardInterrupt:
                    if not _is_cli():
                        raise
    except KeyboardInterrupt as e:
        if not _is_cli():
            raise
        code = 128 + signal_of(e)
    return code
