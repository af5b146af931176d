"""The precision policy of a recipe: which dtypes hold and compute, how the update is kept.

A :class:`Policy` is independent of any technique: parameter dtype, compute dtype (the
parameter dtype, or ``autocast``'s), where the master weights live (nowhere, FP32 copies,
or 16-bit remainders beside BF16 parameters) with optional stochastic rounding of the
update into the parameters, the optimizer states' precision, and loss scaling (none,
static, dynamic). The techniques (float8, unit scaling, scalify) are added on top by
:class:`~lowprec.recipes.Recipe`; every policy composes with every technique (the
policy only decides how :func:`~lowprec.recipes.prepare` builds the optimizer).

Example:
    >>> p = Policy("fp16", master_weights=True, loss_scaling="dynamic", growth_interval=200)
    >>> p.compute_dtype, type(p.make_scaler()).__name__
    ('fp16', 'DynamicLossScaler')
    >>> Policy("bf16", autocast="bf16")
    Traceback (most recent call last):
    ...
    ValueError: autocast needs fp32 parameters (param_dtype='fp32'), got param_dtype='bf16'
    >>> Policy("bf16", master_weights=True).master_kind
    'fp32'
    >>> Policy("bf16", master="remainder").master_weights
    True
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Literal

import torch

from lowprec.amp import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler

_DYNAMIC = inspect.signature(DynamicLossScaler.__init__)

__all__ = ["DTYPES", "DType", "LossScaling", "Master", "OptimizerState", "Policy"]

DType = Literal["fp32", "bf16", "fp16"]
LossScaling = Literal["none", "static", "dynamic"]
Master = Literal["none", "fp32", "remainder"]
OptimizerState = Literal["auto", "fp32", "bf16", "8bit"]
_MASTERS = ("none", "fp32", "remainder")
_STATES = ("auto", "fp32", "bf16", "8bit")
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
        master_weights: the optimizer updates an exact FP32 master (``master`` is
            ``"fp32"`` or ``"remainder"``); the model's ``param_dtype`` parameters receive
            the rounded result (bf16/fp16 only). Given alone, it sets ``master``
            (``True``: ``"fp32"``, ``False``: ``"none"``); after construction it is always
            ``master != "none"``.
        loss_scaling: ``"none"``, ``"static"`` (the loss times ``loss_scale``, fixed) or
            ``"dynamic"`` (starts at ``loss_scale``, halves on overflow, doubles after
            ``growth_interval`` clean steps).
        loss_scale: the static scale, or the dynamic scaler's initial one (finite, > 0).
        growth_interval: clean steps between doublings of the dynamic scale (>= 1).
        autocast: ``torch.autocast`` to this dtype for forward and backward (``None``: no
            autocast); needs FP32 parameters.
        stochastic_rounding: round the update into the bf16/fp16 parameters stochastically
            (unbiased): the write-back of the FP32 masters, or with ``master="none"`` the
            FP32 update of the parameters themselves (the ``bf16-sr`` recipe).
        master: where the master weights live: ``"none"`` (the parameters are the
            weights; the optimizer updates them in FP32 and rounds the result back),
            ``"fp32"`` (FP32 copies: :class:`~lowprec.amp.MasterWeights`) or
            ``"remainder"`` (bf16 only: a 16-bit remainder per parameter that makes BF16
            parameter + remainder the exact FP32 master, :mod:`lowprec.amp.remainder`).
            ``None`` (the default, and every policy saved before the field existed): from
            ``master_weights`` (:attr:`master_kind` reads the result).
        optimizer_state: the precision of the optimizer's states (Adam's moments, SGD's
            momentum): ``"fp32"``, ``"bf16"``, ``"8bit"`` (block-scaled E4M3,
            :mod:`lowprec.amp.state_codec`) in a :mod:`lowprec.amp.lean` optimizer built
            from the factory's AdamW / Adam / SGD; ``"auto"``: the factory's optimizer as
            it is (states in the dtype of what it updates), except that ``master="none"``
            with stochastic rounding and ``master="remainder"`` need a lean optimizer,
            which then keeps FP32 states.
    """

    param_dtype: DType = "fp32"
    master_weights: bool = False
    loss_scaling: LossScaling = "none"
    loss_scale: float = 2.0**16
    growth_interval: int = 2000
    autocast: DType | None = None
    stochastic_rounding: bool = False
    master: Master | None = None
    optimizer_state: OptimizerState = "auto"

    def __post_init__(self) -> None:
        self._resolve_master()
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
        if self.loss_scaling == "dynamic":  # the scaler's own range (DynamicLossScaler)
            lo, hi = (
                _DYNAMIC.parameters["min_scale"].default,
                _DYNAMIC.parameters["max_scale"].default,
            )
            if not lo <= s <= hi:
                raise ValueError(
                    f"loss_scale must be in [{lo}, {hi}] for dynamic loss scaling (the scaler "
                    f"moves within that range), got {s!r}"
                )
        g = self.growth_interval
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {g!r}")
        if self.master_weights and self.param_dtype == "fp32":
            raise ValueError(
                "master_weights only makes sense with bf16/fp16 parameters, got param_dtype='fp32'"
            )
        if self.master_kind == "remainder" and self.param_dtype != "bf16":
            raise ValueError(
                "master='remainder' needs param_dtype='bf16' (BF16 + 16 bits = FP32), got "
                f"param_dtype={self.param_dtype!r}"
            )
        if self.stochastic_rounding and self.master_kind == "remainder":
            raise ValueError(
                "stochastic_rounding: master='remainder' keeps the exact FP32 master, there "
                "is nothing to round stochastically"
            )
        if self.stochastic_rounding and self.param_dtype == "fp32":
            raise ValueError(
                "stochastic_rounding rounds the update into bf16/fp16 parameters, got "
                "param_dtype='fp32'"
            )
        if self.optimizer_state not in _STATES:
            raise ValueError(
                f"optimizer_state must be one of {list(_STATES)}, got {self.optimizer_state!r}"
            )

    def _resolve_master(self) -> None:
        """Check ``master`` against ``master_weights`` (see the attributes). A policy
        without ``master`` (every one saved before it existed) reads as before:
        stochastic rounding then still needs ``master_weights``."""
        mw, master = self.master_weights, self.master
        for flag in ("master_weights", "stochastic_rounding"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if master is None:
            if self.stochastic_rounding and not mw:
                raise ValueError(
                    "stochastic_rounding rounds the master-weight write-back: it needs "
                    "master_weights=True (or master='none' explicitly: the FP32 update "
                    "rounded stochastically into the parameters, as the bf16-sr recipe does)"
                )
            return
        if master not in _MASTERS:
            raise ValueError(f"master must be None or one of {list(_MASTERS)}, got {master!r}")
        if mw and master == "none":
            raise ValueError("master_weights=True contradicts master='none'")
        object.__setattr__(self, "master_weights", master != "none")

    @property
    def master_kind(self) -> Master:
        """Where the master weights live: ``master``, or from ``master_weights``."""
        if self.master is not None:
            return self.master
        return "fp32" if self.master_weights else "none"

    @property
    def lean(self) -> bool:
        """True if the optimizer is a :mod:`lowprec.amp.lean` one (``optimizer_state``)."""
        return self.optimizer_state != "auto" or (
            self.master_kind == "remainder"
            or (self.master_kind == "none" and self.stochastic_rounding)
        )

    @property
    def state_precision(self) -> str:
        """The lean optimizer's state precision: ``optimizer_state``, FP32 for ``"auto"``."""
        return "fp32" if self.optimizer_state == "auto" else self.optimizer_state

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
