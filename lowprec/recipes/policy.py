"""The precision policy of a recipe: which dtypes hold and compute, how the update is kept.

A :class:`Policy` is independent of any technique: parameter dtype, compute dtype (the
parameter dtype, or ``autocast``'s), FP32 master weights with optional stochastic
rounding of the write-back, and loss scaling (none, static, dynamic). The techniques
(float8, unit scaling, scalify) are added on top by :class:`~lowprec.recipes.Recipe`.

Example:
    >>> p = Policy("fp16", master_weights=True, loss_scaling="dynamic", growth_interval=200)
    >>> p.compute_dtype, type(p.make_scaler()).__name__
    ('fp16', 'DynamicLossScaler')
    >>> Policy("bf16", autocast="bf16")
    Traceback (most recent call last):
    ...
    ValueError: autocast needs fp32 parameters (param_dtype='fp32'), got param_dtype='bf16'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from lowprec.amp import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler

__all__ = ["DTYPES", "DType", "LossScaling", "Policy"]

DType = Literal["fp32", "bf16", "fp16"]
LossScaling = Literal["none", "static", "dynamic"]
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_LOSS_SCALING = ("none", "static", "dynamic")


@dataclass(frozen=True)
class Policy:
    """Dtypes, master weights and loss scaling of a training run.

    Attributes:
        param_dtype: dtype of the model's parameters (and of its compute without autocast).
        master_weights: keep FP32 copies that the optimizer updates; the model's
            ``param_dtype`` parameters receive the rounded result (bf16/fp16 only).
        loss_scaling: ``"none"``, ``"static"`` (the loss times ``loss_scale``, fixed) or
            ``"dynamic"`` (starts at ``loss_scale``, halves on overflow, doubles after
            ``growth_interval`` clean steps).
        loss_scale: the static scale, or the dynamic scaler's initial one (finite, > 0).
        growth_interval: clean steps between doublings of the dynamic scale (>= 1).
        autocast: ``torch.autocast`` to this dtype for forward and backward (``None``: no
            autocast); needs FP32 parameters.
        stochastic_rounding: round the master-weight write-back stochastically (needs
            ``master_weights``).
    """

    param_dtype: DType = "fp32"
    master_weights: bool = False
    loss_scaling: LossScaling = "none"
    loss_scale: float = 2.0**16
    growth_interval: int = 2000
    autocast: DType | None = None
    stochastic_rounding: bool = False

    def __post_init__(self) -> None:
        if self.param_dtype not in DTYPES:
            raise ValueError(f"param_dtype must be one of {list(DTYPES)}, got {self.param_dtype!r}")
        if self.autocast is not None and self.autocast not in DTYPES:
            raise ValueError(
                f"autocast must be None or one of {list(DTYPES)}, got {self.autocast!r}"
            )
        if self.autocast is not None and self.param_dtype != "fp32":
            raise ValueError(
                "autocast needs fp32 parameters (param_dtype='fp32'), got "
                f"param_dtype={self.param_dtype!r}"
            )
        if self.loss_scaling not in _LOSS_SCALING:
            raise ValueError(
                f"loss_scaling must be 'none', 'static' or 'dynamic', got {self.loss_scaling!r}"
            )
        s = self.loss_scale
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < math.inf:
            raise ValueError(f"loss_scale must be a finite number > 0, got {s!r}")
        object.__setattr__(self, "loss_scale", float(s))
        g = self.growth_interval
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {g!r}")
        for flag in ("master_weights", "stochastic_rounding"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.master_weights and self.param_dtype == "fp32":
            raise ValueError(
                "master_weights only makes sense with bf16/fp16 parameters, got param_dtype='fp32'"
            )
        if self.stochastic_rounding and not self.master_weights:
            raise ValueError(
                "stochastic_rounding rounds the master-weight write-back: it needs "
                "master_weights=True"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the parameters."""
        return DTYPES[self.param_dtype]

    @property
    def compute_dtype(self) -> DType:
        """The dtype activations and gradients are computed in: ``autocast`` or ``param_dtype``."""
        return self.autocast or self.param_dtype

    def make_scaler(self) -> LossScaler:
        """A fresh loss scaler for this policy."""
        if self.loss_scaling == "static":
            return StaticLossScaler(self.loss_scale)
        if self.loss_scaling == "dynamic":
            return DynamicLossScaler(self.loss_scale, growth_interval=self.growth_interval)
        return NoLossScaler()
