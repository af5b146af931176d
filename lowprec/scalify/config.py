"""Configuration of scaled arithmetic: data format, scale rounding, add rule, rescaling.

Scope. The active :class:`ScalifyConfig` is the top of a *thread-local* stack
(:func:`current_config`); ``with config(pow2="down"): ...`` pushes one for a block and pops
it on exit, in the calling thread only. Nothing a scalify'd module or function does outlives
its call:

* its forward runs with its config pushed (and popped when the forward returns);
* every ``ScaledTensor`` it creates records that config in its domain name (see
  :mod:`lowprec.scalify.core`), and each op on such tensors, in forward and in backward,
  runs with the recorded config pushed for the op. So the backward of a region uses the
  config of its own forward, whichever thread runs it and whatever ran in between.

Tensors made by hand (:func:`~lowprec.scalify.scaled`, :func:`~lowprec.scalify.as_scaled`
without ``config=``) record nothing: their ops use the calling thread's active config.

Coverage: every op on a scalify tensor either has a rule or falls back to
``dequantize -> op -> wrap at scale 1``. :func:`coverage` reports both counts per op; the
first fallback of each op logs a WARNING.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from lowprec.core.registry import Registry
from lowprec.core.scales import Pow2Mode
from lowprec.core.warn import warn_once

__all__ = [
    "PRESETS",
    "Coverage",
    "ScalifyConfig",
    "config",
    "coverage",
    "current_config",
    "reset_coverage",
    "set_config",
]

log = logging.getLogger("lowprec.scalify")

AddRule = Literal["max", "unit"]
Rescale = Literal["none", "max", "l1", "l2"]
_FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": None}


@dataclass(frozen=True)
class ScalifyConfig:
    """How scaled arithmetic stores data and picks scales.

    Attributes:
        data_format: storage of every ScaledTensor's data: ``"fp16"``, ``"bf16"``,
            ``"fp32"``, or ``"fp8"`` (FP16 storage; each matmul casts its inputs to E4M3,
            and gradient inputs to E5M2, with a per-tensor power-of-two scale).
        pow2: rounding of every scale a rule *chooses* (√K of a matmul, the unit add rule,
            a rescale, a scalar factor): ``"none"`` (exact), ``"down"``
            (``2^⌊log2 s⌋``) or ``"up"`` (``2^⌈log2 s⌉``).
        add_rule: ``"max"`` (``s = max(s_a, s_b)``) or ``"unit"`` (``s = √(s_a² + s_b²)``).
        rescale: automatic rescale of each op's output before its cast to ``data_format``:
            ``"none"`` (scales only propagate), or the new scale is the ``max`` / mean
            absolute (``l1``) / RMS (``l2``) value of the output.
        check_scales: raise ``ValueError`` where a non-finite scale is created (one host
            sync per op; skipped while compiling).

    Example:
        >>> ScalifyConfig.from_name("fp16-dynamic").rescale
        'max'
        >>> c = ScalifyConfig.from_name("fp8", pow2="up")
        >>> c.data_format, c.pow2, c.rescale
        ('fp8', 'up', 'none')
    """

    data_format: str = "fp16"
    pow2: Pow2Mode = "none"
    add_rule: AddRule = "max"
    rescale: Rescale = "none"
    check_scales: bool = True

    def __post_init__(self) -> None:
        if self.data_format not in _FORMATS:
            raise ValueError(
                f"data_format must be one of {list(_FORMATS)}, got {self.data_format!r}"
            )
        for name, ok in (
            ("pow2", ("none", "down", "up")),
            ("add_rule", ("max", "unit")),
            ("rescale", ("none", "max", "l1", "l2")),
        ):
            if getattr(self, name) not in ok:
                raise ValueError(f"{name} must be one of {list(ok)}, got {getattr(self, name)!r}")
        if not isinstance(self.check_scales, bool):
            raise TypeError(f"check_scales must be a bool, got {self.check_scales!r}")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ScalifyConfig:
        """A preset of :data:`PRESETS` (``fp16``, ``bf16``, ``fp8`` (static),
        ``fp16-dynamic``, ``fp8-dynamic``), with ``overrides`` replacing its fields."""
        return PRESETS.get(name, **overrides)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The torch dtype ScaledTensor data is stored in."""
        return _FORMATS[self.data_format] or torch.float16

    @property
    def fp8_matmul(self) -> bool:
        return self.data_format == "fp8"


PRESETS: Registry[ScalifyConfig] = Registry("scalify preset", ScalifyConfig)
PRESETS.add("fp16", data_format="fp16", description="FP16 data, scales only propagate")
PRESETS.add("bf16", data_format="bf16", description="BF16 data, scales only propagate")
PRESETS.add("fp8", data_format="fp8", description="FP8 matmul inputs, FP16 data elsewhere")
PRESETS.add("fp16-dynamic", data_format="fp16", rescale="max", pow2="up",
            description="FP16, each op's output rescaled by its max (power of two up)")  # fmt: skip
PRESETS.add("fp8-dynamic", data_format="fp8", rescale="max", pow2="up",
            description="FP8 matmuls, each op's output rescaled by its max")  # fmt: skip


# ---- the thread-local stack -----------------------------------------------------------------


class _Stack(threading.local):
    def __init__(self) -> None:
        self.configs = [ScalifyConfig()]


_STACK = _Stack()


def current_config() -> ScalifyConfig:
    """The calling thread's active configuration (the top of its stack)."""
    return _STACK.configs[-1]


def push(cfg: ScalifyConfig) -> None:
    """Make ``cfg`` active in the calling thread until the matching :func:`pop`."""
    _STACK.configs.append(cfg)


def pop() -> None:
    """Undo the calling thread's last :func:`push`."""
    configs = _STACK.configs
    if len(configs) < 2:
        raise RuntimeError("scalify: pop() without a matching push()")
    configs.pop()


def set_config(cfg: ScalifyConfig) -> None:
    """Make ``cfg`` the calling thread's *default* config (the bottom of its stack).

    The default applies, in this thread only, to tensors made by hand outside any
    :func:`config` block; scalify'd modules and functions never read it (they carry their
    own config) and never change it. Prefer ``with config(cfg): ...``, which ends with
    its block.
    """
    if not isinstance(cfg, ScalifyConfig):
        raise TypeError(f"cfg must be a ScalifyConfig, got {type(cfg).__name__}")
    _STACK.configs[0] = cfg


@contextlib.contextmanager
def config(cfg: ScalifyConfig | None = None, **changes: Any) -> Iterator[ScalifyConfig]:
    """Within the block, in the calling thread, ``cfg`` (default: the active one) with
    ``changes`` is active.

    Example:
        >>> with config(pow2="down") as c:
        ...     c.pow2, current_config().pow2
        ('down', 'down')
        >>> current_config().pow2
        'none'
    """
    if cfg is not None and not isinstance(cfg, ScalifyConfig):
        raise TypeError(f"cfg must be a ScalifyConfig or None, got {type(cfg).__name__}")
    new = replace(cfg or current_config(), **changes)
    push(new)
    try:
        yield new
    finally:
        pop()


# ---- coverage ------------------------------------------------------------------------------

_RULED: Counter[str] = Counter()
_FALLBACK: Counter[str] = Counter()


@dataclass(frozen=True)
class Coverage:
    """Calls per aten op since the last :func:`reset_coverage`: by a rule, by the fallback."""

    ruled: dict[str, int]
    fallbacks: dict[str, int]

    def __str__(self) -> str:
        lines = [f"scalify coverage: {sum(self.ruled.values())} op calls by rules, "
                 f"{sum(self.fallbacks.values())} by the dequantize fallback"]  # fmt: skip
        lines += [f"  fallback {op}: {n}" for op, n in sorted(self.fallbacks.items())]
        return "\n".join(lines)


def coverage() -> Coverage:
    """Counts of ruled and fallback op calls (fallbacks also log once per op at WARNING).

    Example:
        >>> reset_coverage(); coverage().fallbacks
        {}
    """
    return Coverage(dict(_RULED), dict(_FALLBACK))


def reset_coverage() -> None:
    """Zero the counts of :func:`coverage` (the once-per-op warnings are not repeated)."""
    _RULED.clear()
    _FALLBACK.clear()


def count_rule(name: str) -> None:
    _RULED[name] += 1


def count_fallback(name: str) -> None:
    _FALLBACK[name] += 1
    warn_once(
        log,
        f"scalify:fallback:{name}",
        "scalify: no rule for %s; falling back to dequantize -> op -> scale 1 "
        "(slower; the output's scale no longer tracks its range)",
        name,
    )
