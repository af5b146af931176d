"""Scalify domains: which rules apply to a ScaledTensor, and under which config.

A scalify ``ScaledTensor``'s domain is ``"scalify"`` (values) or ``"scalify.grad"``
(gradients), optionally followed by ``"@" + key``, the key naming the
:class:`~lowprec.scalify.config.ScalifyConfig` it was made under (:func:`record` registers
every rule for a config's two domains and returns its key). A rule's output inherits its
operands' key, and the rule runs with that config pushed on the calling thread's stack
(:func:`scoped`); operands without a key use the thread's active config. The domain is part
of a ``ScaledTensor``'s metadata, so ``torch.compile`` traces and guards on it as on the dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from lowprec.core.tensor import ScaledTensor, register_fallback, register_rule
from lowprec.scalify.config import ScalifyConfig, count_rule, current_config, pop, push

__all__ = [
    "DOMAINS",
    "FWD",
    "GRAD",
    "config_of",
    "fallback",
    "is_grad",
    "lookup",
    "out_domain",
    "record",
    "rule",
    "tag",
]

FWD, GRAD = "scalify", "scalify.grad"
DOMAINS = (FWD, GRAD)
Rule = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]

_TAGGED: dict[str, ScalifyConfig] = {}  # key -> config, for the domains "<base>@<key>"
_TABLE: list[tuple[tuple[Any, ...], Rule]] = []  # every rule, to register on new domains
_FALLBACKS: list[Rule] = []
_LOCK = threading.Lock()


def _domains() -> tuple[str, ...]:
    return DOMAINS + tuple(f"{b}@{k}" for k in _TAGGED for b in DOMAINS)


def key_of(cfg: ScalifyConfig) -> str:
    """The domain key of ``cfg``: its field values (stable across processes)."""
    c = cfg
    return f"{c.data_format},{c.pow2},{c.add_rule},{c.rescale},{int(c.check_scales)}"


def record(cfg: ScalifyConfig) -> str:
    """Register the rules for the domains of ``cfg`` (once) and return its key."""
    key = key_of(cfg)
    if key in _TAGGED:
        return key
    with _LOCK:
        if key in _TAGGED:  # another thread was first
            return key
        doms = (f"{FWD}@{key}", f"{GRAD}@{key}")
        for ops, fn in _TABLE:
            register_rule(*ops, domain=doms)(fn)
        for fb in _FALLBACKS:
            for d in doms:
                register_fallback(d, fb)
        _TAGGED[key] = cfg  # last: a key is visible only once its rules are
    return key


def domain(base: str, key: str) -> str:
    """``base`` (FWD or GRAD) tagged with a config key (none: untagged)."""
    return f"{base}@{key}" if key else base


def sts(args: Any) -> Iterator[ScaledTensor]:
    """The ScaledTensors in ``args`` (lists and tuples one level deep included)."""
    for a in args:
        if isinstance(a, ScaledTensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (b for b in a if isinstance(b, ScaledTensor))


def tag(args: Any) -> str:
    """The config key of the first tagged ScaledTensor in ``args`` ("" if none)."""
    for a in sts(args):
        if a.domain and "@" in a.domain:
            return a.domain.partition("@")[2]
    return ""


def lookup(key: str) -> ScalifyConfig:
    """The config recorded under ``key``; the calling thread's active one for ``""``."""
    return _TAGGED[key] if key else current_config()


def config_of(args: Any) -> ScalifyConfig:
    """The config an op on ``args`` runs under: their recorded one, else the active one."""
    return lookup(tag(args))


def is_grad(x: object) -> bool:
    """A scalify gradient (domain ``scalify.grad``, tagged or not)."""
    return isinstance(x, ScaledTensor) and (x.domain or "").partition("@")[0] == GRAD


def scoped(fn: Rule) -> Rule:
    """``fn`` run with its operands' recorded config pushed (see the module docstring)."""

    def run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = tag(args)
        if not key:
            return fn(func, args, kwargs)
        push(_TAGGED[key])
        try:
            return fn(func, args, kwargs)
        finally:
            pop()

    run.__doc__ = fn.__doc__
    return run


def rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Register a scalify rule for ``ops`` (every scalify domain), counted by ``coverage()``."""

    def deco(fn: Rule) -> Rule:
        def counted(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            count_rule(str(func))
            return fn(func, args, kwargs)

        counted.__doc__ = fn.__doc__
        run = scoped(counted)
        with _LOCK:
            _TABLE.append((ops, run))
            register_rule(*ops, domain=_domains())(run)
        return fn

    return deco


def fallback(fn: Rule) -> Rule:
    """Register ``fn`` as the fallback of every scalify domain."""
    run = scoped(fn)
    with _LOCK:
        _FALLBACKS.append(run)
        for d in _domains():
            register_fallback(d, run)
    return fn


def out_domain(args: Any) -> str:
    """``GRAD`` if any ScaledTensor argument is a gradient (its descendants are too), else
    ``FWD``; tagged with the operands' config key."""
    grad = any(is_grad(a) for a in sts(args))
    return domain(GRAD if grad else FWD, tag(args))
