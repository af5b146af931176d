"""Configuration of scaled arithmetic: data format, scale rounding, add rule, rescaling.

One :class:`ScalifyConfig` is active at a time (:func:`current_config`). A scalify'd
module makes its own config active when it runs forward, and it stays active for the
backward pass that follows; ``with config(pow2="down"): ...`` changes it for a block.

Coverage: every op on a scalify tensor either has a rule or falls back to
``dequantize -> op -> wrap at scale 1``. :func:`coverage` reports both counts per op; the
first fallback of each op logs a WARNING.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

__all__ = [
    "Coverage",
    "ScalifyConfig",
    "config",
    "coverage",
    "current_config",
    "reset_coverage",
    "set_config",
]

log = logging.getLogger("lowprec.scalify")

Pow2 = Literal["none", "down", "up"]
AddRule = Literal["max", "unit"]
Rescale = Literal["none", "max", "l1", "l2"]
_FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": None}
_PRESETS: dict[str, dict[str, Any]] = {
    "fp16": {"data_format": "fp16"},
    "bf16": {"data_format": "bf16"},
    "fp8": {"data_format": "fp8"},
    "fp16-dynamic": {"data_format": "fp16", "rescale": "max", "pow2": "up"},
    "fp8-dynamic": {"data_format": "fp8", "rescale": "max", "pow2": "up"},
}


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
    """

    data_format: str = "fp16"
    pow2: Pow2 = "none"
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
    def from_name(cls, name: str) -> ScalifyConfig:
        """A preset: ``fp16``, ``bf16``, ``fp8`` (static), ``fp16-dynamic``, ``fp8-dynamic``."""
        if name not in _PRESETS:
            raise ValueError(f"unknown scalify preset {name!r}; valid: {sorted(_PRESETS)}")
        return cls(**_PRESETS[name])

    @property
    def storage_dtype(self) -> torch.dtype:
        """The torch dtype ScaledTensor data is stored in."""
        return _FORMATS[self.data_format] or torch.float16

    @property
    def fp8_matmul(self) -> bool:
        return self.data_format == "fp8"


_CURRENT = [ScalifyConfig()]


def current_config() -> ScalifyConfig:
    """The active configuration."""
    return _CURRENT[0]


def set_config(cfg: ScalifyConfig) -> None:
    """Make ``cfg`` the active configuration."""
    if not isinstance(cfg, ScalifyConfig):
        raise TypeError(f"cfg must be a ScalifyConfig, got {type(cfg).__name__}")
    _CURRENT[0] = cfg


@contextlib.contextmanager
def config(cfg: ScalifyConfig | None = None, **changes: Any) -> Iterator[ScalifyConfig]:
    """Within the block, ``cfg`` (default: the active one) with ``changes`` is active.

    Example:
        >>> with config(pow2="down") as c:
        ...     c.pow2
        'down'
    """
    old = _CURRENT[0]
    new = replace(cfg or old, **changes)
    _CURRENT[0] = new
    try:
        yield new
    finally:
        _CURRENT[0] = old


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


_WARNED: set[str] = set()


def count_rule(name: str) -> None:
    _RULED[name] += 1


def count_fallback(name: str) -> None:
    _FALLBACK[name] += 1
    if name not in _WARNED:
        _WARNED.add(name)
        log.warning(
            "scalify: no rule for %s; falling back to dequantize -> op -> scale 1 "
            "(slower; the output's scale no longer tracks its range)",
            name,
        )
