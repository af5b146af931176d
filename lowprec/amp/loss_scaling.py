"""Loss scaling: multiply the loss by ``S`` so that small gradients stay representable.

Loss scaling multiplies the loss by ``S`` before ``backward`` so that small gradients stay
above the format's smallest subnormal (FP16: ``2^-24``), then divides the gradients by ``S``
in FP32 before the update. A step whose gradients hold Inf/NaN is skipped.

The scalers are drop-ins for ``torch.amp.GradScaler``::

    scaler = DynamicLossScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)        # optional: to clip gradients first
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)            # skipped if a gradient is Inf/NaN
    scaler.update()                   # dynamic: back off on overflow, grow when stable

with GradScaler's rules: ``unscale_`` at most once per optimizer between ``update`` calls
and not after ``step``; ``step`` at most once per optimizer between ``update`` calls;
``update`` backs off if any optimizer's step since the last ``update`` was skipped, and
``update(new_scale)`` sets the scale (an optimizer unscaled and not stepped counts as
GradScaler counts it: Inf/NaN in its gradients backs off). Differences: ``step`` returns
True if the update was applied, False if skipped (GradScaler returns the optimizer's
return value or None);
:class:`NoLossScaler` is GradScaler with ``enabled=False`` (``is_enabled()`` False,
``unscale_`` does nothing, ``step`` always applies the update).

``optimizer`` may be a :class:`~lowprec.amp.master.MasterWeights`: its gradients are
copied to the FP32 masters, unscaled and checked there, and ``unscale_`` writes the
unscaled gradients back into the model's gradients, so that clipping
``model.parameters()`` clips the real update (:mod:`lowprec.amp.master`). A skipped step,
and an unscaled one that ``update`` ends without ``step``, discard the copied gradients
(:meth:`~lowprec.amp.master.MasterWeights.discard_grads`): the next step copies its own.

Under ``torch.distributed`` the Inf/NaN flag is all-reduced with MAX over
``process_group`` (default: the default group, when ``torch.distributed`` is
initialised): one all-reduce per optimizer per step, so that an overflow on any rank
(sharded gradients) makes every rank skip the step and back off identically.

Every step appends ``StepRecord(scale, skipped)`` to ``scaler.history``, which keeps the
last :data:`HISTORY_LIMIT` steps (``skipped_steps`` counts every step: the count of the
older ones is kept); the checkpointed state holds no more.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lowprec.amp._checks import check_config, check_positive, number
from lowprec.amp.master import MasterWeights
from lowprec.core.warn import warn_once

__all__ = ["DynamicLossScaler", "LossScaler", "NoLossScaler", "StaticLossScaler", "StepRecord"]

_UNSCALED, _STEPPED = "unscaled", "stepped"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """What a loss scaler did at one step: the scale used and whether it skipped."""

    scale: float
    skipped: bool


def _params(optimizer: Any) -> list[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _local(g: Tensor) -> Tensor:
    """A sharded (DTensor) gradient's local shard; any other gradient itself."""
    to_local = getattr(g, "to_local", None)
    return to_local() if callable(to_local) else g  # type: ignore[no-any-return]


class LossScaler:
    """Base class: scale ``S`` fixed at construction, skip on Inf/NaN gradients.

    ``process_group``: the group over which the Inf/NaN flag is all-reduced (None: the
    default group when ``torch.distributed`` is initialised, else no reduction)."""

    def __init__(self, scale: float = 1.0, process_group: Any = None) -> None:
        check_positive("scale", scale)
        self._scale = float(scale)
        self.history: list[StepRecord] = []  # the last HISTORY_LIMIT steps (at least)
        self._skipped_before = 0  # skipped steps among those dropped from history
        self.process_group = process_group
        self._stage: dict[int, str] = {}
        self._found: dict[int, bool] = {}
        self._masters: dict[int, MasterWeights] = {}  # unscaled since the last update()
        self._mark = 0  # len(history) at the last update()

    @property
    def loss_scale(self) -> float:
        return self._scale

    def get_scale(self) -> float:
        """The current scale ``S`` (as ``GradScaler.get_scale``)."""
        return self._scale

    def is_enabled(self) -> bool:
        """True: the loss is scaled and steps with Inf/NaN gradients are skipped."""
        return True

    @property
    def skipped_steps(self) -> int:
        """Skipped steps since the scaler started (history kept or not)."""
        return self._skipped_before + sum(r.skipped for r in self.history)

    def _record(self, rec: StepRecord) -> None:
        """Append a step to :attr:`history`, dropping the oldest beyond
        :data:`HISTORY_LIMIT` (in batches: at twice the limit, back to the limit)."""
        self.history.append(rec)
        extra = len(self.history) - HISTORY_LIMIT
        if extra >= HISTORY_LIMIT:
            self._skipped_before += sum(r.skipped for r in self.history[:extra])
            del self.history[:extra]
            self._mark = max(0, self._mark - extra)

    def scale(self, outputs: Any) -> Any:
        """``outputs · S``, computed in FP32; ``outputs`` a tensor or (nested) lists and
        tuples of tensors, as for ``GradScaler.scale``."""
        if isinstance(outputs, Tensor):
            return outputs.float() * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(
            f"outputs must be a torch.Tensor or a list/tuple of them, got {type(outputs).__name__}"
        )

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by ``S`` (in FP32 for FP32 gradients and for
        :class:`MasterWeights`) and record whether any is Inf/NaN (all-reduced across
        ranks). At most once per optimizer between ``update`` calls, and not after
        ``step`` (which calls it otherwise)."""
        stage = self._stage.get(id(optimizer))
        if stage == _UNSCALED:
            raise RuntimeError(
                "unscale_() was already called on this optimizer since the last update()"
            )
        if stage == _STEPPED:
            raise RuntimeError(
                "unscale_() was already called on this optimizer this step (by step()); "
                "call update() first"
            )
        self._unscale(optimizer, push=True)

    def _unscale(self, optimizer: Any, push: bool, force_skip: bool = False) -> None:
        master = isinstance(optimizer, MasterWeights)
        if master:
            optimizer.copy_grads()
            self._masters[id(optimizer)] = optimizer
        grads = [_local(p.grad) for p in _params(optimizer) if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        flags: list[Tensor] = [torch.tensor(force_skip, device=device)]
        if not force_skip:
            inv = 1.0 / self._scale
            for g in grads:
                if inv != 1.0:
                    g.mul_(inv)
                flags.append((~torch.isfinite(g).all()).to(device))
        found = torch.stack(flags).any().to(torch.float32)
        if self.process_group is not None or (dist.is_available() and dist.is_initialized()):
            if dist.get_world_size(self.process_group) > 1:
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group)
        self._found[id(optimizer)] = bool(found)  # one synchronisation
        self._stage[id(optimizer)] = _UNSCALED
        if master and push:
            optimizer.push_grads()

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> bool:
        """Unscale if not done, then ``optimizer.step(*args, **kwargs)`` unless a gradient
        is Inf/NaN (on any rank). Returns True if the update was applied."""
        if "closure" in kwargs:
            raise RuntimeError("step(): a closure is not supported with loss scaling")
        return self._step(optimizer, False, args, kwargs)

    def skip(self, optimizer: Any) -> None:
        """Record this step as skipped whatever the gradients hold (a loop's own
        non-finite check): no update; under ``torch.distributed`` it takes part in the
        found-inf all-reduce as ``step`` does, so that every rank skips."""
        self._step(optimizer, True, (), {})

    def _step(self, optimizer: Any, force: bool, args: Any, kwargs: Any) -> bool:
        stage = self._stage.get(id(optimizer))
        if stage == _STEPPED:
            raise RuntimeError("step() was already called on this optimizer since update()")
        if stage is None:
            self._unscale(optimizer, push=False, force_skip=force)
        skipped = force or self._found[id(optimizer)]
        self._record(StepRecord(self._scale, skipped))
        if not skipped:
            optimizer.step(*args, **kwargs)
        elif isinstance(optimizer, MasterWeights):
            optimizer.discard_grads()  # the next step's gradients are copied afresh
        self._stage[id(optimizer)] = _STEPPED
        return not skipped

    def update(self, new_scale: float | Tensor | None = None) -> None:
        """End the step: adjust the scale from the steps since the last ``update`` (a
        dynamic scaler backs off if any was skipped), or set it to ``new_scale``."""
        records = self.history[self._mark :]
        # optimizers unscaled and not stepped count as torch's do: Inf/NaN backs off
        unstepped = [self._found[k] for k, st in self._stage.items() if st == _UNSCALED]
        for opt in self._masters.values():  # the copied gradients are not reused
            opt.discard_grads()
        self._masters.clear()
        self._stage.clear()
        self._found.clear()
        self._mark = len(self.history)
        if new_scale is not None:
            s = number("new_scale", new_scale)
            self._check_scale("new_scale", s)
            self._scale = s
        elif records or unstepped:
            self._adjust(any(r.skipped for r in records) or any(unstepped))

    def _adjust(self, skipped: bool) -> None:
        """Change the scale after a step (a fixed scale does not change)."""

    def _check_scale(self, name: str, s: float) -> None:
        check_positive(name, s)

    def state_dict(self) -> dict[str, Any]:
        dropped, kept = self.history[:-HISTORY_LIMIT], self.history[-HISTORY_LIMIT:]
        return {
            "type": type(self).__name__,
            "scale": self._scale,
            "history": [(r.scale, r.skipped) for r in kept],
            "skipped_before": self._skipped_before + sum(r.skipped for r in dropped),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`: all or nothing (every entry is validated first;
        ``ValueError``/``TypeError`` naming the entry leave the scaler unchanged)."""
        self._apply(self._check_state(state_dict))
        self._masters.clear()
        self._stage.clear()
        self._found.clear()
        self._mark = len(self.history)

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
        scale = number("state['scale']", state["scale"])
        check_positive("state['scale']", scale)
        hist = state["history"]
        if not isinstance(hist, (list, tuple)):
            raise TypeError(f"state['history'] must be a list, got {type(hist).__name__}")
        history = []
        for i, rec in enumerate(hist):
            if not (isinstance(rec, (list, tuple)) and len(rec) == 2):
                raise ValueError(f"state['history'][{i}] must be a (scale, skipped) pair")
            rec_scale = number(f"state['history'][{i}]", rec[0])
            check_positive(f"state['history'][{i}]", rec_scale)
            history.append(StepRecord(rec_scale, bool(rec[1])))
        before = state.get("skipped_before", 0)  # (states saved before it: none dropped)
        if isinstance(before, bool) or not isinstance(before, int) or before < 0:
            raise ValueError(f"state['skipped_before'] must be an int >= 0, got {before!r}")
        before += sum(r.skipped for r in history[:-HISTORY_LIMIT])
        history = history[-HISTORY_LIMIT:]
        return {"_scale": scale, "history": history, "_skipped_before": before}

    def _apply(self, checked: dict[str, Any]) -> None:
        for k, v in checked.items():
            setattr(self, k, v)


class NoLossScaler(LossScaler):
    """No loss scaling and no skipping: ``torch.amp.GradScaler(enabled=False)``.
    ``unscale_`` does nothing and ``step`` always applies the update."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def is_enabled(self) -> bool:
        return False

    def unscale_(self, optimizer: Any) -> None:
        """Nothing to undo (the scale is 1)."""

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> bool:
        self._record(StepRecord(1.0, False))
        optimizer.step(*args, **kwargs)
        return True

    def skip(self, optimizer: Any) -> None:
        self._record(StepRecord(1.0, True))


class StaticLossScaler(LossScaler):
    """A fixed loss scale ``S``; steps with Inf/NaN gradients are skipped. After
    :data:`STATIC_SKIP_WARNING` skipped steps in a row a WARNING says that the scale
    overflows every step (it never backs off; :class:`DynamicLossScaler` does).

    Example:
        >>> s = StaticLossScaler(1024.0)
        >>> s.scale(torch.tensor(0.5)).item()
        512.0
    """

    def _adjust(self, skipped: bool) -> None:
        records = self.history[-STATIC_SKIP_WARNING:]
        if skipped and len(records) == STATIC_SKIP_WARNING and all(r.skipped for r in records):
            warn_once(
                _log, f"static-loss-scale:{self._scale}",
                "the static loss scale %g skipped the last %d steps (Inf/NaN gradients): "
                "the scaled gradients overflow every step; lower the scale or use "
                "DynamicLossScaler", self._scale, STATIC_SKIP_WARNING,
            )  # fmt: skip


STATIC_SKIP_WARNING = 10  # skipped steps in a row before StaticLossScaler warns
HISTORY_LIMIT = 10_000  # steps a scaler's history keeps (and its state saves)


_GRADSCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval"}


class DynamicLossScaler(LossScaler):
    """Loss scale that backs off on overflow and grows after a run of good steps.

    After a step with Inf/NaN gradients (skipped), ``S ← max(S · backoff_factor, min_scale)``;
    after ``growth_interval`` consecutive good steps, ``S ← min(S · growth_factor, max_scale)``.
    Defaults follow ``torch.amp.GradScaler`` (``2^16``, ×2, ×0.5, 2000), with bounds.
    ``load_state_dict`` also takes a ``torch.amp.GradScaler`` state dict.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        process_group: Any = None,
    ) -> None:
        cfg = check_config(
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
        super().__init__(init_scale, process_group)
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

    def _adjust(self, skipped: bool) -> None:
        if skipped:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._scale = min(self._scale * self.growth_factor, self.max_scale)
                self._good_steps = 0

    def _check_scale(self, name: str, s: float) -> None:
        check_positive(name, s)
        if not self.min_scale <= s <= self.max_scale:
            raise ValueError(
                f"{name} must lie in [min_scale, max_scale] = [{self.min_scale}, "
                f"{self.max_scale}], got {s}"
            )

    def state_dict(self) -> dict[str, Any]:
        """Scale, history, the count of good steps since the last change, and the
        configuration (``config``: growth/backoff factors, interval, bounds)."""
        return {**super().state_dict(), "good_steps": self._good_steps, "config": self.config()}

    def _check_state(self, state: Any) -> dict[str, Any]:
        """As the base class, plus ``good_steps`` (an int in ``[0, growth_interval)``) and
        the saved ``config`` (validated as the constructor does; states saved before it
        was recorded keep this scaler's configuration). The scale must lie in
        ``[min_scale, max_scale]`` of the configuration being loaded. A
        ``torch.amp.GradScaler`` state (``scale``, factors, interval, ``_growth_tracker``)
        is read as one with an empty history and this scaler's bounds."""
        if isinstance(state, dict) and "type" not in state and "_growth_tracker" in state:
            tracker = state["_growth_tracker"]
            if isinstance(tracker, Tensor) and tracker.numel() == 1:
                tracker = tracker.item()
            state = {
                "type": type(self).__name__,
                "scale": state.get("scale"),
                "history": [],
                "good_steps": tracker,
                "config": {k: state[k] for k in _GRADSCALER_KEYS - {"scale"} if k in state},
            }
        checked = super()._check_state(state)
        cfg = self.config()
        if "config" in state:
            saved = state["config"]
            if not isinstance(saved, dict):
                raise TypeError(f"state['config'] must be a dict, got {type(saved).__name__}")
            unknown = sorted(set(saved) - set(cfg))
            if unknown:
                raise ValueError(f"state['config']: unknown entries {unknown}")
            cfg = check_config({**cfg, **saved}, "state['config']")
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
