"""Loss scaling: multiply the loss by ``S`` so that small gradients stay representable.

Loss scaling multiplies the loss by ``S`` before ``backward`` so that small gradients stay
above the format's smallest subnormal (FP16: ``2^-24``), then divides the gradients by ``S``
in FP32 before the update. A step whose gradients hold Inf/NaN is skipped.

The API follows ``torch.amp.GradScaler``::

    scaler = DynamicLossScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)        # optional: to clip gradients first
    scaler.step(optimizer)            # skipped if a gradient is Inf/NaN
    scaler.update()                   # dynamic: back off on overflow, grow when stable

Every step appends ``StepRecord(scale, skipped)`` to ``scaler.history``. ``optimizer`` may be
a :class:`~lowprec.amp.master.MasterWeights`: its gradients are copied to the FP32 masters
first, and those are unscaled and checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lowprec.amp.master import MasterWeights

__all__ = ["DynamicLossScaler", "LossScaler", "NoLossScaler", "StaticLossScaler", "StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """What a loss scaler did at one step: the scale used and whether it skipped."""

    scale: float
    skipped: bool


def _params(optimizer: Any) -> list[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


class LossScaler:
    """Base class: scale ``S`` fixed at construction, skip on Inf/NaN gradients."""

    def __init__(self, scale: float = 1.0) -> None:
        _check_positive("scale", scale)
        self._scale = float(scale)
        self.history: list[StepRecord] = []
        self._unscaled: set[int] = set()
        self._found_inf: bool = False

    @property
    def loss_scale(self) -> float:
        return self._scale

    @property
    def skipped_steps(self) -> int:
        return sum(r.skipped for r in self.history)

    def scale(self, loss: Tensor) -> Tensor:
        """``loss · S``, computed in FP32."""
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        return loss.float() * self._scale

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by ``S`` (in FP32 for FP32 gradients) and record
        whether any is Inf/NaN. Call at most once per step (``step`` calls it otherwise)."""
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer this step")
        if isinstance(optimizer, MasterWeights):
            optimizer.copy_grads()
        inv = 1.0 / self._scale
        found: Tensor | None = None  # accumulated on the gradients' device: one sync
        for p in _params(optimizer):
            if p.grad is None:
                continue
            if inv != 1.0:
                p.grad.mul_(inv)
            bad = ~torch.isfinite(p.grad).all()
            found = bad if found is None else found | bad.to(found.device)
        self._found_inf = found is not None and bool(found)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Any) -> bool:
        """Unscale if not done, then ``optimizer.step()`` unless a gradient is Inf/NaN.

        Returns True if the update was applied."""
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        skipped = self._found_inf
        self.history.append(StepRecord(self._scale, skipped))
        if not skipped:
            optimizer.step()
        return not skipped

    def update(self) -> None:
        """End the step (a fixed scale does not change)."""
        self._unscaled.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "scale": self._scale,
            "history": [(r.scale, r.skipped) for r in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != type(self).__name__:
            raise ValueError(
                f"state: saved by {state.get('type')}, cannot load into {type(self).__name__}"
            )
        self._scale = float(state["scale"])
        self.history = [StepRecord(float(s), bool(k)) for s, k in state["history"]]


class NoLossScaler(LossScaler):
    """No loss scaling and no skipping: the update is applied whatever the gradients hold."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def step(self, optimizer: Any) -> bool:
        if isinstance(optimizer, MasterWeights):
            optimizer.copy_grads()
        self.history.append(StepRecord(1.0, False))
        optimizer.step()
        return True


class StaticLossScaler(LossScaler):
    """A fixed loss scale ``S``; steps with Inf/NaN gradients are skipped.

    Example:
        >>> s = StaticLossScaler(1024.0)
        >>> s.scale(torch.tensor(0.5)).item()
        512.0
    """


class DynamicLossScaler(LossScaler):
    """Loss scale that backs off on overflow and grows after a run of good steps.

    After a step with Inf/NaN gradients (skipped), ``S ← max(S · backoff_factor, min_scale)``;
    after ``growth_interval`` consecutive good steps, ``S ← min(S · growth_factor, max_scale)``.
    Defaults follow ``torch.amp.GradScaler`` (``2^16``, ×2, ×0.5, 2000), with bounds.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        super().__init__(init_scale)
        _check_positive("min_scale", min_scale)
        _check_positive("max_scale", max_scale)
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(f"growth_interval must be an int, got {type(growth_interval).__name__}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}], "
                f"got {init_scale}"
            )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self._good_steps = 0

    def update(self) -> None:
        super().update()
        if not self.history:
            return
        if self.history[-1].skipped:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._scale = min(self._scale * self.growth_factor, self.max_scale)
                self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._good_steps = int(state["good_steps"])


def _check_positive(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v}")
