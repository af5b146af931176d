"""Stateful scalers: the scale of successive tensors of one role (dynamic, delayed, static).

Each scaler turns an ``amax`` into a scale with :func:`lowprec.core.scales.compute_scale`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch
from torch import Tensor

from lowprec.core.formats import Format, get_format
from lowprec.core.granularity import Granularity, as_granularity
from lowprec.core.scales import _check_margin, amax, group_scale

__all__ = ["DelayedScaler", "DynamicScaler", "Scaler", "StaticScaler", "delayed_amax", "push_amax"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Stateful scalers
# ---------------------------------------------------------------------------------------


class Scaler(ABC):
    """Chooses the scale of successive tensors (activations, weights or gradients of one role).

    Call it on a tensor to get the scale to use for that tensor; it updates its state.
    ``state_dict()`` / ``load_state_dict()`` save and restore that state exactly.
    """

    def __init__(
        self,
        fmt: str | Format,
        granularity: str | Granularity = "tensor",
        margin: float = 0.0,
        power_of_two: bool = False,
    ) -> None:
        self.fmt = get_format(fmt)
        self.granularity = as_granularity(granularity)
        self.margin = _check_margin(margin)
        if not isinstance(power_of_two, bool):
            raise TypeError(f"power_of_two must be a bool, got {type(power_of_two).__name__}")
        self.power_of_two = power_of_two
        self.nonfinite_count = 0

    def _scale(self, a: Tensor) -> Tensor:
        return group_scale(a, self.fmt, self.granularity, self.margin, self.power_of_two)

    def _amax(self, x: Tensor) -> Tensor:
        a = amax(x, self.granularity)
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(a).all()):
            self.nonfinite_count += 1
            if self.nonfinite_count == 1:
                log.warning(
                    "%s: non-finite amax (Inf/NaN in the tensor); using scale 1 for those "
                    "groups and not recording them (reported once)",
                    type(self).__name__,
                )
        return a

    @abstractmethod
    def __call__(self, x: Tensor) -> Tensor:
        """Return the scale for ``x`` (shape ``granularity.scale_shape(x.shape)``)."""

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "fmt": self.fmt.name,
            "granularity": self.granularity.name,
            "margin": self.margin,
            "power_of_two": self.power_of_two,
        }

    # Attributes saved by state_dict(): optional tensors (cloned) and plain ints.
    _STATE_TENSORS: tuple[str, ...] = ()
    _STATE_INTS: tuple[str, ...] = ("nonfinite_count",)

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"config": self.config()}
        for name in self._STATE_INTS:
            sd[name] = getattr(self, name)
        for name in self._STATE_TENSORS:
            t = getattr(self, name)
            sd[name] = None if t is None else t.clone()
        return sd

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "config" not in state:
            raise TypeError("state must be a dict produced by state_dict()")
        if state["config"] != self.config():
            raise ValueError(
                f"state: saved scaler config {state['config']} does not match {self.config()}"
            )
        for name in self._STATE_INTS:
            setattr(self, name, int(state[name]))
        for name in self._STATE_TENSORS:
            t = state.get(name)
            setattr(self, name, None if t is None else t.clone())

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "type")
        return f"{type(self).__name__}({args})"


class DynamicScaler(Scaler):
    """Scale from the current tensor's own ``amax`` (just-in-time scaling).

    Example:
        >>> import torch
        >>> DynamicScaler("e4m3fn")(torch.tensor([1.0, -896.0])).item()
        2.0
    """

    _STATE_TENSORS = ("last_amax",)
    last_amax: Tensor | None = None  # the amax of the latest tensor (set per call)

    def __call__(self, x: Tensor) -> Tensor:
        a = self._amax(x)
        self.last_amax = a
        return self._scale(a)


class _HistoryScaler(Scaler):
    def __init__(
        self,
        fmt: str | Format,
        granularity: str | Granularity,
        margin: float,
        power_of_two: bool,
    ) -> None:
        super().__init__(fmt, granularity, margin, power_of_two)
        if self.granularity.kind in ("mx", "nv"):
            raise ValueError(
                f"granularity: MX scales are dynamic by definition (NV too); use DynamicScaler, "
                f"not {type(self).__name__}"
            )

    @staticmethod
    def _check_shape(x: Tensor, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
        if expected != got:
            raise ValueError(
                f"x: scale shape {got} (from x of shape {tuple(x.shape)}) differs from the "
                f"recorded scale shape {expected}"
            )


class DelayedScaler(_HistoryScaler):
    """Scale from a history of past ``amax`` values (delayed scaling, as in Transformer Engine).

    Each call returns the scale computed from the history *before* this tensor, then records
    this tensor's ``amax``. ``algo="max"`` uses the largest ``amax`` of the last
    ``history_len`` calls, ``"most_recent"`` the previous call's. Warm-up: while the history
    holds no positive ``amax`` (the first call), the tensor's own ``amax`` is used (dynamic
    scaling); see :func:`delayed_amax`. Because the
    scale lags the data, use it with saturating casts: an outlier saturates for one step,
    then dominates the ``max`` history for ``history_len`` steps and drops out.

    A non-finite ``amax`` is not recorded: the slot repeats the previous value.
    """

    _STATE_TENSORS = ("amax_history",)

    def __init__(
        self,
        fmt: str | Format,
        history_len: int = 16,
        algo: Literal["max", "most_recent"] = "max",
        granularity: str | Granularity = "tensor",
        margin: float = 0.0,
        power_of_two: bool = False,
    ) -> None:
        super().__init__(fmt, granularity, margin, power_of_two)
        if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a positive int, got {history_len!r}")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
        self.history_len = history_len
        self.algo = algo
        self.amax_history: Tensor | None = None  # (history_len, *scale_shape); row 0 newest

    def config(self) -> dict[str, Any]:
        return {**super().config(), "history_len": self.history_len, "algo": self.algo}

    def __call__(self, x: Tensor) -> Tensor:
        cur = self._amax(x)
        hist = self.amax_history
        if hist is None:
            hist = torch.zeros((self.history_len, *cur.shape), device=cur.device)
        else:
            self._check_shape(x, tuple(hist.shape[1:]), tuple(cur.shape))
        scale = self._scale(delayed_amax(hist, cur, self.algo))
        self.amax_history = push_amax(hist, cur)
        return scale


class StaticScaler(_HistoryScaler):
    """A fixed scale: given, or calibrated from the data of the first calls, then frozen.

    With ``scale`` given it is used as is (it must be positive and finite; a scalar or a
    tensor of the granularity's scale shape). Without it, the first ``calibration_steps``
    calls track the running maximum of ``amax`` and return the scale for it; then the scale
    freezes. :meth:`freeze` ends calibration early.
    """

    _STATE_TENSORS = ("calib_amax", "scale")
    _STATE_INTS = ("nonfinite_count", "steps")

    def __init__(
        self,
        fmt: str | Format,
        scale: float | Tensor | None = None,
        calibration_steps: int = 1,
        granularity: str | Granularity = "tensor",
        margin: float = 0.0,
        power_of_two: bool = False,
    ) -> None:
        super().__init__(fmt, granularity, margin, power_of_two)
        if (
            isinstance(calibration_steps, bool)
            or not isinstance(calibration_steps, int)
            or calibration_steps < 1
        ):
            raise ValueError(f"calibration_steps must be a positive int, got {calibration_steps!r}")
        self.calibration_steps = calibration_steps
        self.steps = 0
        self.calib_amax: Tensor | None = None
        self.scale: Tensor | None = None
        if scale is not None:
            self.scale = _check_scale_value(scale, "scale")

    @property
    def frozen(self) -> bool:
        return self.scale is not None

    def freeze(self) -> None:
        """Stop calibrating; ``ValueError`` if nothing was seen yet."""
        if self.scale is not None:
            return
        if self.calib_amax is None:
            raise ValueError("StaticScaler.freeze(): no tensor seen yet; call it on data first")
        self.scale = self._scale(self.calib_amax)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "calibration_steps": self.calibration_steps}

    def __call__(self, x: Tensor) -> Tensor:
        if self.scale is not None:
            return self.scale.to(x.device)
        cur = self._amax(x)
        cur = torch.where(torch.isfinite(cur), cur, 0.0)
        if self.calib_amax is not None:
            self._check_shape(x, tuple(self.calib_amax.shape), tuple(cur.shape))
            cur = torch.maximum(self.calib_amax, cur)
        self.calib_amax = cur
        self.steps += 1
        scale = self._scale(cur)
        if self.steps >= self.calibration_steps:
            self.scale = scale
        return scale


def delayed_amax(history: Tensor, current: Tensor, algo: str = "max") -> Tensor:
    """The ``amax`` a delayed scaler uses: the max (``algo="max"``) or the newest
    (``"most_recent"``) entry of ``history`` (newest first, shape ``(L, *scale_shape)``).

    Where that is not positive (an empty, all-zero history: warm-up) the ``current`` amax
    is used instead, so the first step is scaled dynamically.
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    ref = history.amax(dim=0) if algo == "max" else history[0]
    return torch.where(ref > 0, ref, current)


def push_amax(history: Tensor, current: Tensor) -> Tensor:
    """``history`` with ``current`` prepended and the oldest entry dropped. A non-finite
    ``current`` is not recorded: the newest entry is repeated in its place."""
    new = torch.where(torch.isfinite(current), current, history[0])
    return torch.cat([new.unsqueeze(0), history[:-1]], dim=0)


def _check_scale_value(scale: float | Tensor, arg: str) -> Tensor:
    """A user-given scale as float32; ``ValueError`` unless every entry is finite and > 0."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, Tensor)):
        raise TypeError(f"{arg} must be a positive number or tensor, got {type(scale).__name__}")
    t = scale if isinstance(scale, Tensor) else torch.tensor(float(scale))
    if not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"{arg} must be a real tensor, got dtype {t.dtype}")
    t = t.detach().float()
    if not torch.compiler.is_compiling() and not bool(((t > 0) & torch.isfinite(t)).all()):
        raise ValueError(f"{arg} must be finite and > 0 everywhere, got {scale!r}")
    return t
