"""Log a message once per key: the one warn-once set of the package.

A fallback that changes numerics or speed logs once at WARNING (see docs/architecture.md);
every module calls :func:`warn_once` instead of keeping its own set of warned keys.

Example:
    >>> import logging
    >>> log = logging.getLogger("lowprec.example")
    >>> warn_once(log, "example:key", "shown once")
    True
    >>> warn_once(log, "example:key", "shown once")
    False
"""

from __future__ import annotations

import logging
import threading

__all__ = ["reset_warnings", "warn_once", "warned"]

_WARNED: set[str] = set()
_LOCK = threading.Lock()


def warn_once(log: logging.Logger, key: str, msg: str, *args: object) -> bool:
    """``log.warning(msg, *args)`` the first time ``key`` is seen; return whether it logged."""
    with _LOCK:
        if key in _WARNED:
            return False
        _WARNED.add(key)
    log.warning(msg, *args)
    return True


def warned(key: str) -> bool:
    """Whether ``key`` has warned (so a caller can skip the work of checking again)."""
    with _LOCK:
        return key in _WARNED


def reset_warnings(prefix: str = "") -> None:
    """Forget the keys starting with ``prefix`` (all by default), so they warn again."""
    with _LOCK:
        for key in [k for k in _WARNED if k.startswith(prefix)]:
            _WARNED.discard(key)
