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
        """Load a :meth:`state_dict`: all or nothing (every entry is validated first;
        ``ValueError``/``TypeError`` naming the entry leave the scaler unchanged)."""
        self._apply(self._check_state(state))

    def _check_state(self, state: Any) -> dict[str, Any]:
        """The validated entries of ``state``, ready to assign (nothing assigned here)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        if state.get("type") != type(self).__name__:
            raise ValueError(
                f"state: saved by {state.get('type')}, cannot load into {type(self).__name__}"
            )
        for key in ("scale", "history"):
            if key not in state:
                raise ValueError(f"state: no {key!r} entry")
        scale = _number("state['scale']", state["scale"])
        _check_positive("state['scale']", scale)
        hist = state["history"]
        if not isinstance(hist, (list, tuple)):
            raise TypeError(f"state['history'] must be a list, got {type(hist).__name__}")
        history = []
        for i, rec in enumerate(hist):
            if not (isinstance(rec, (list, tuple)) and len(rec) == 2):
                raise ValueError(f"state['history'][{i}] must be a (scale, skipped) pair")
            rec_scale = _number(f"state['history'][{i}]", rec[0])
            _check_positive(f"state['history'][{i}]", rec_scale)
            history.append(StepRecord(rec_scale, bool(rec[1])))
        return {"_scale": scale, "history": history}

    def _apply(self, checked: dict[str, Any]) -> None:
        for k, v in checked.items():
            setattr(self, k, v)


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
        cfg = _check_config(
            {
                "init_scale": init_scale,
                "growth_factor": growth_factor,
                "backoff_factor": backoff_factor,
                "growth_interval": growth_interval,
                "min_scale": min_scale,
                "max_scale": max_scale,
            },
            "",
        )
        super().__init__(init_scale)
        self.growth_factor = cfg["growth_factor"]
        self.backoff_factor = cfg["backoff_factor"]
        self.growth_interval = cfg["growth_interval"]
        self.min_scale, self.max_scale = cfg["min_scale"], cfg["max_scale"]
        self._good_steps = 0

    def config(self) -> dict[str, Any]:
        """The constructor's arguments (``init_scale`` as given at construction is not
        kept: the current scale is the state's ``scale``)."""
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }

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
        """Scale, history, the count of good steps since the last change, and the
        configuration (``config``: growth/backoff factors, interval, bounds)."""
        return {**super().state_dict(), "good_steps": self._good_steps, "config": self.config()}

    def _check_state(self, state: Any) -> dict[str, Any]:
        """As the base class, plus ``good_steps`` (an int in ``[0, growth_interval)``) and
        the saved ``config`` (validated as the constructor does; states saved before it
        was recorded keep this scaler's configuration). The scale must lie in
        ``[min_scale, max_scale]`` of the configuration being loaded."""
        checked = super()._check_state(state)
        cfg = self.config()
        if "config" in state:
            saved = state["config"]
            if not isinstance(saved, dict):
                raise TypeError(f"state['config'] must be a dict, got {type(saved).__name__}")
            unknown = sorted(set(saved) - set(cfg))
            if unknown:
                raise ValueError(f"state['config']: unknown entries {unknown}")
            cfg = _check_config({**cfg, **saved}, "state['config']")
        lo, hi = cfg["min_scale"], cfg["max_scale"]
        if not lo <= checked["_scale"] <= hi:
            raise ValueError(
                f"state['scale'] must lie in [min_scale, max_scale] = [{lo}, {hi}], "
                f"got {checked['_scale']}"
            )
        good = state.get("good_steps")
        if isinstance(good, bool) or not isinstance(good, int):
            raise TypeError(f"state['good_steps'] must be an int, got {type(good).__name__}")
        if not 0 <= good < cfg["growth_interval"]:
            raise ValueError(
                f"state['good_steps'] must lie in [0, growth_interval={cfg['growth_interval']})"
                f", got {good}"
            )
        return {**checked, **cfg, "_good_steps": good}


def _number(name: str, v: Any) -> float:
    """``v`` as a float; ``TypeError`` naming ``name`` for a non-number (bool included)."""
    if isinstance(v, Tensor) and v.numel() == 1 and v.dtype.is_floating_point:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    return float(v)


def _check_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate a dynamic scaler's configuration (every entry finite, factors and bounds
    consistent); ``ValueError``/``TypeError`` name the entry. Returns it normalised."""

    def name(k: str) -> str:
        return f"{where}[{k!r}]" if where else k

    out: dict[str, Any] = {}
    for k in ("growth_factor", "backoff_factor", "min_scale", "max_scale", "init_scale"):
        if k in cfg:
            out[k] = _number(name(k), cfg[k])
            if not math.isfinite(out[k]):
                raise ValueError(f"{name(k)} must be finite, got {out[k]}")
    for k in ("min_scale", "max_scale", "init_scale"):
        if k in out:
            _check_positive(name(k), out[k])
    if not out["growth_factor"] > 1.0:
        raise ValueError(
            f"{name('growth_factor')} must be finite and > 1, got {cfg['growth_factor']}"
        )
    if not 0.0 < out["backoff_factor"] < 1.0:
        raise ValueError(f"{name('backoff_factor')} must be in (0, 1), got {cfg['backoff_factor']}")
    gi = cfg["growth_interval"]
    if isinstance(gi, bool) or not isinstance(gi, int):
        raise TypeError(f"{name('growth_interval')} must be an int, got {type(gi).__name__}")
    if gi < 1:
        raise ValueError(f"{name('growth_interval')} must be >= 1, got {gi}")
    out["growth_interval"] = gi
    if out["min_scale"] > out["max_scale"]:
        raise ValueError(
            f"{name('min_scale')} must be <= max_scale, got {out['min_scale']} > {out['max_scale']}"
        )
    if "init_scale" in out:
        if not out["min_scale"] <= out["init_scale"] <= out["max_scale"]:
            raise ValueError(
                f"init_scale must lie in [min_scale, max_scale] = "
                f"[{out['min_scale']}, {out['max_scale']}], got {cfg['init_scale']}"
            )
        del out["init_scale"]
    return out


def _check_positive(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v}")
