"""``UnitConfig``: the unit technique's settings (u-μP's hyperparameter ``mult``\\ s included).

A frozen dataclass of plain values (bools and floats), validated at construction, so that
``UnitConfig(**dataclasses.asdict(c)) == c`` and a bad value fails where it is written.

Example:
    >>> from dataclasses import asdict
    >>> c = UnitConfig(float8=True, act_mult=2.0)
    >>> UnitConfig(**asdict(c)) == c
    True
    >>> UnitConfig(softmax_mult=0.0)
    Traceback (most recent call last):
    ...
    ValueError: softmax_mult must be a finite float > 0, got 0.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["UnitConfig"]


@dataclass(frozen=True)
class UnitConfig:
    """Run-time settings of a unit-scaled model (u-μP's hyperparameter ``mult``\\ s included).

    ``float8``: every matmul but the readout's rounds its operands to E4M3 and the gradient
    into its output to E5M2, saturating, with no scales. ``float8_readout``: with
    ``float8``, round the readout's matmul to FP8 too (default: it runs in the model's
    dtype); it needs ``float8``. ``strict``: an op or module with no unit-scaling rule
    raises ``NotImplementedError`` instead of running unchanged with a warning.
    ``act_mult`` multiplies the input of gelu/silu; ``softmax_mult`` the softmax logits;
    ``output_mult`` the readout's forward. Each ``mult`` is a finite float ``> 0``.
    """

    float8: bool = False
    float8_readout: bool = False
    strict: bool = False
    act_mult: float = 1.0
    softmax_mult: float = 1.0
    output_mult: float = 1.0

    def __post_init__(self) -> None:
        for name in ("float8", "float8_readout", "strict"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {type(v).__name__} {v!r}")
        for name in ("act_mult", "softmax_mult", "output_mult"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a float, got {type(v).__name__} {v!r}")
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite float > 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.float8_readout and not self.float8:
            raise ValueError(
                "float8_readout=True needs float8=True (it adds the readout to the matmuls "
                "that float8 rounds to FP8)"
            )
