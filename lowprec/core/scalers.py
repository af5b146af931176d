"""Stateful scalers: the scale of successive tensors of one role (dynamic, delayed, static).

Each scaler turns an ``amax`` into a scale with :func:`lowprec.core.scales.compute_scale`.

**State in tensors.** A scaler's state (the ``amax`` history of :class:`DelayedScaler`, the
calibration maximum of :class:`StaticScaler`, the non-finite count) is held in tensors,
updated in place, so that it can be reduced across ranks (``all_reduce(MAX)`` of an amax)
and registered as module buffers: pass the tensor to the constructor (``amax_history=``,
``calib_amax=``) and the scaler reads and writes that very tensor. A caller that threads
the state through an autograd function (so that ``torch.compile`` sees it as an input)
passes it per call with ``state=``.

**One place for "a scale from amax over time".** A caller that knows the ``amax`` already
(the ``amax`` of a whole tensor sharded over ranks, or of many tensors reduced in one
collective) passes it as ``amax=`` instead of the tensor; a scaler built with a
``reducer`` (an :data:`AmaxReducer`, e.g. an ``all_reduce(MAX)`` over a process group, as
Transformer Engine reduces amax in one place) reduces the ``amax`` of each tensor it is
called on before using it. Either way the scale is :func:`Scaler.scale_of` of that amax,
which is :func:`lowprec.core.scales.group_scale` — the one scale function of lowprec.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from lowprec.core.formats import Format, get_format
from lowprec.core.granularity import Granularity, as_granularity
from lowprec.core.scales import amax, check_margin, group_scale, nonfinite_scale

__all__ = [
    "AmaxReducer",
    "DelayedScaler",
    "DynamicScaler",
    "Scaler",
    "StaticScaler",
    "delayed_amax",
    "push_amax",
]

AmaxReducer = Callable[[Tensor], Tensor]
"""Reduces a local ``amax`` (any shape) element-wise with ``max`` across processes and
returns the result (the same on every process); it must not modify its argument."""

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Stateful scalers
# ---------------------------------------------------------------------------------------


class Scaler(ABC):
    """Chooses the scale of successive tensors (activations, weights or gradients of one role).

    Call it on a tensor to get the scale to use for that tensor; it updates its state.
    ``state_dict()`` / ``load_state_dict()`` save and restore that state exactly.
    ``reducer``: an :data:`AmaxReducer` applied to the ``amax`` of every tensor the scaler
    is called on (not to an ``amax=`` given by the caller, which is used as is).

    A non-finite ``amax`` (the tensor holds Inf/NaN) is counted in :attr:`nonfinite` and
    logged once per scaler at WARNING with :attr:`_NONFINITE_NOTE`, which states what the
    subclass does with it.
    """

    # What a non-finite amax gets (the warning's text after the scaler's name).
    _NONFINITE_NOTE = (
        "non-finite amax (Inf/NaN in the tensor); those groups get scale 1 (NaN in an MX or "
        "NV block, or a format without Inf and NaN codes)"
    )

    def __init__(
        self,
        fmt: str | Format,
        granularity: str | Granularity = "tensor",
        margin: float = 0.0,
        power_of_two: bool = False,
        reducer: AmaxReducer | None = None,
    ) -> None:
        self.fmt = get_format(fmt, arg="fmt")
        self.granularity = as_granularity(granularity)
        self.margin = check_margin(margin)
        if not isinstance(power_of_two, bool):
            raise TypeError(f"power_of_two must be a bool, got {type(power_of_two).__name__}")
        self.power_of_two = power_of_two
        if reducer is not None and not callable(reducer):
            raise TypeError(f"reducer must be callable or None, got {type(reducer).__name__}")
        self.reducer = reducer
        self.nonfinite: Tensor | None = None  # int64 count of non-finite amax (lazily made)

    @property
    def nonfinite_count(self) -> int:
        """How many calls saw a non-finite ``amax`` (reading it synchronises the device)."""
        return 0 if self.nonfinite is None else int(self.nonfinite)

    def scale_of(self, amax: Tensor) -> Tensor:
        """The scale of an ``amax`` (:func:`~lowprec.core.scales.group_scale` with this
        scaler's format, granularity, margin and power-of-two rounding); no state changes."""
        return group_scale(amax, self.fmt, self.granularity, self.margin, self.power_of_two)

    def _amax(self, x: Tensor | None, given: Tensor | None = None) -> Tensor:
        """The ``amax`` to use: ``given`` as is, else ``x``'s reduced by :attr:`reducer`;
        a non-finite one is counted."""
        if given is not None:
            if not isinstance(given, Tensor) or not given.dtype.is_floating_point:
                raise TypeError(f"amax must be a floating-point tensor, got {given!r}")
            a = given.detach().float()
        elif x is None:
            raise TypeError(f"{type(self).__name__}: give the tensor x or its amax=")
        else:
            a = amax(x, self.granularity)
            if self.reducer is not None:
                a = self.reducer(a)
        if torch.compiler.is_compiling():
            return a
        # Counted without a host sync; the warning (once) only where checking is free (CPU).
        bad = (~torch.isfinite(a)).any().to(torch.int64)
        if self.nonfinite is None:
            self.nonfinite = torch.zeros((), dtype=torch.int64, device=a.device)
        first = a.device.type == "cpu" and int(self.nonfinite) == 0 and bool(bad)
        self.nonfinite += bad.to(self.nonfinite.device)
        if first:
            log.warning("%s: %s (reported once)", type(self).__name__, self._NONFINITE_NOTE)
        return a

    @abstractmethod
    def __call__(self, x: Tensor | None = None, *, amax: Tensor | None = None) -> Tensor:
        """Return the scale for ``x`` (shape ``granularity.scale_shape(x.shape)``), or for a
        tensor whose ``amax`` is given (already reduced where it must be)."""

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "fmt": self.fmt.name,
            "granularity": self.granularity.name,
            "margin": self.margin,
            "power_of_two": self.power_of_two,
        }

    # Attributes saved by state_dict(): optional tensors (cloned) and plain ints.
    _STATE_TENSORS: tuple[str, ...] = ("nonfinite",)
    _STATE_INTS: tuple[str, ...] = ()

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
        if "nonfinite" not in state and "nonfinite_count" in state:  # states saved before 0.x
            state = {**state, "nonfinite": torch.tensor(int(state["nonfinite_count"]))}
        self._check_state(state)
        for name in self._STATE_INTS:
            setattr(self, name, int(state[name]))
        for name in self._STATE_TENSORS:
            t = state.get(name)
            old = getattr(self, name)
            if t is None:
                setattr(self, name, None)
            elif isinstance(old, Tensor) and old.shape == t.shape:
                old.copy_(t)  # in place: a tensor the scaler was given (a buffer) stays bound
            else:
                setattr(self, name, t.clone())

    def _check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state that the scaler cannot use (subclasses add their checks)."""
        for name in self._STATE_TENSORS:
            t = state.get(name)
            if t is not None and not isinstance(t, Tensor):
                raise TypeError(f"state[{name!r}] must be a tensor or None, got {type(t).__name__}")

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

    _STATE_TENSORS = ("nonfinite", "last_amax")
    last_amax: Tensor | None = None  # the amax of the latest tensor (set per call)

    def __call__(self, x: Tensor | None = None, *, amax: Tensor | None = None) -> Tensor:
        a = self._amax(x, amax)
        self.last_amax = a
        return self.scale_of(a)


class _HistoryScaler(Scaler):
    def __init__(
        self,
        fmt: str | Format,
        granularity: str | Granularity,
        margin: float,
        power_of_two: bool,
        reducer: AmaxReducer | None = None,
    ) -> None:
        super().__init__(fmt, granularity, margin, power_of_two, reducer)
        if self.granularity.kind in ("mx", "nv"):
            raise ValueError(
                f"granularity: MX scales are dynamic by definition (NV too); use DynamicScaler, "
                f"not {type(self).__name__}"
            )

    def _guard(self, scale: Tensor, cur: Tensor) -> Tensor:
        """``scale`` with NaN where the current ``amax`` ``cur`` is not finite and the format
        has no Inf and NaN codes (:func:`~lowprec.core.scales.nonfinite_scale`): a scale
        from the past must not let the cast clamp ±Inf to ``±max · scale``."""
        return nonfinite_scale(scale, cur, self.fmt, self.granularity.kind)

    @staticmethod
    def _check_shape(x: Tensor | None, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
        if expected != got:
            src = "amax" if x is None else f"x of shape {tuple(x.shape)}"
            raise ValueError(
                f"x: scale shape {got} (from {src}) differs from the recorded scale shape "
                f"{expected}"
            )


class DelayedScaler(_HistoryScaler):
    """Scale from a history of past ``amax`` values (delayed scaling, as in Transformer Engine).

    Each call returns the scale computed from the history *before* this tensor, then records
    this tensor's ``amax`` (with ``update=False``, e.g. in evaluation, it records nothing).
    ``algo="max"`` uses the largest ``amax`` of the last ``history_len`` calls,
    ``"most_recent"`` the previous call's. Warm-up: while the history holds no positive
    ``amax`` (the first call), the tensor's own ``amax`` is used (dynamic scaling); see
    :func:`delayed_amax`. Because the scale lags the data, use it with saturating casts: an
    outlier saturates for one step, then dominates the ``max`` history for ``history_len``
    steps and drops out.

    The history is a tensor of shape ``(history_len, *scale_shape)``, newest first, updated
    in place: give it as ``amax_history`` (e.g. a module buffer of zeros) or let the first
    call allocate it.

    A non-finite ``amax`` (the tensor holds Inf/NaN in that group) is not recorded: the
    history still advances one slot, which repeats its newest entry. The group's scale is
    the history's as for any tensor (scale 1 while the history holds no positive amax),
    so a saturating cast clamps its finite values to ``±max · scale`` and its ±Inf/NaN stay
    non-finite as the format allows (±Inf in E5M2, NaN in E4M3FN); in a format without
    Inf and NaN codes (E2M1, E3M2, E2M3) the scale is NaN and the group reads NaN.
    """

    _STATE_TENSORS = ("nonfinite", "amax_history")
    _NONFINITE_NOTE = (
        "non-finite amax (Inf/NaN in the tensor); those groups keep the scale of the amax "
        "history (scale 1 while it holds no positive amax), NaN in a format without Inf and "
        "NaN codes; the history records its newest amax again in their place"
    )

    def __init__(
        self,
        fmt: str | Format,
        history_len: int = 16,
        algo: Literal["max", "most_recent"] = "max",
        granularity: str | Granularity = "tensor",
        margin: float = 0.0,
        power_of_two: bool = False,
        amax_history: Tensor | None = None,
        reducer: AmaxReducer | None = None,
    ) -> None:
        super().__init__(fmt, granularity, margin, power_of_two, reducer)
        if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a positive int, got {history_len!r}")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
        self.history_len = history_len
        self.algo = algo
        if amax_history is not None:
            self._check_history(amax_history, "amax_history")
        self.amax_history: Tensor | None = amax_history  # (history_len, *scale_shape)

    def _check_history(self, h: Tensor, arg: str) -> None:
        if not isinstance(h, Tensor) or not h.dtype.is_floating_point:
            raise TypeError(f"{arg} must be a floating-point tensor, got {h!r}")
        if h.dim() < 1 or h.shape[0] != self.history_len:
            raise ValueError(
                f"{arg}: expected shape (history_len={self.history_len}, *scale_shape), got "
                f"{tuple(h.shape)}"
            )

    def config(self) -> dict[str, Any]:
        return {**super().config(), "history_len": self.history_len, "algo": self.algo}

    def _check_state(self, state: dict[str, Any]) -> None:
        super()._check_state(state)
        h = state.get("amax_history")
        if h is not None:
            self._check_history(h, "state['amax_history']")

    def __call__(
        self,
        x: Tensor | None = None,
        update: bool = True,
        *,
        state: Tensor | None = None,
        amax: Tensor | None = None,
    ) -> Tensor:
        """The scale for ``x`` (or for the tensor whose ``amax`` is given); records that
        ``amax`` when ``update``. ``state``: the history tensor to use (and update in place)
        instead of :attr:`amax_history`."""
        cur = self._amax(x, amax)
        hist = self.amax_history if state is None else state
        if hist is None:
            hist = torch.zeros((self.history_len, *cur.shape), device=cur.device)
            self.amax_history = hist
        else:
            self._check_shape(x, tuple(hist.shape[1:]), tuple(cur.shape))
        scale = self._guard(self.scale_of(delayed_amax(hist, cur, self.algo)), cur)
        if update:
            hist.copy_(push_amax(hist, cur))
        return scale


class StaticScaler(_HistoryScaler):
    """A fixed scale: given, or calibrated from the data of the first calls, then frozen.

    With ``scale`` given it is used as is (it must be positive and finite; a scalar or a
    tensor of the granularity's scale shape). Without it, calls record the running maximum
    of ``amax`` in :attr:`calib_amax` (a tensor updated in place: give it as ``calib_amax``,
    e.g. a module buffer of zeros, or let the first call allocate it) and return the scale
    for it; after ``calibration_steps`` recording calls the scale freezes at
    ``scale(calib_amax)``. ``calibration_steps=None`` calibrates until :meth:`freeze`.
    :meth:`reset` starts a new calibration.

    A non-finite ``amax`` while calibrating (the tensor holds Inf/NaN in that group)
    counts as 0: the maximum is unchanged (0 on the first call), the call still counts as a
    calibration step, and the group gets the scale of that maximum (1 where it is 0). A
    frozen scaler computes no ``amax`` and counts nothing. Either way, in a format
    without Inf and NaN codes (E2M1, E3M2, E2M3) the group's scale is NaN and it reads
    NaN (the frozen scaler takes the tensor's ``amax`` for that, in those formats only).
    """

    _STATE_TENSORS = ("nonfinite", "calib_amax", "scale")
    _NONFINITE_NOTE = (
        "non-finite amax (Inf/NaN in the tensor) while calibrating; those groups get the "
        "scale of the calibration maximum so far (scale 1 where it is 0), NaN in a format "
        "without Inf and NaN codes; the maximum records 0 for them and the call counts as a "
        "calibration step"
    )
    _STATE_INTS = ("steps",)

    def __init__(
        self,
        fmt: str | Format,
        scale: float | Tensor | None = None,
        calibration_steps: int | None = 1,
        granularity: str | Granularity = "tensor",
        margin: float = 0.0,
        power_of_two: bool = False,
        calib_amax: Tensor | None = None,
        reducer: AmaxReducer | None = None,
    ) -> None:
        super().__init__(fmt, granularity, margin, power_of_two, reducer)
        if calibration_steps is not None and (
            isinstance(calibration_steps, bool)
            or not isinstance(calibration_steps, int)
            or calibration_steps < 1
        ):
            raise ValueError(
                f"calibration_steps must be a positive int or None, got {calibration_steps!r}"
            )
        if calib_amax is not None and (
            not isinstance(calib_amax, Tensor) or not calib_amax.dtype.is_floating_point
        ):
            raise TypeError(f"calib_amax must be a floating-point tensor, got {calib_amax!r}")
        self.calibration_steps = calibration_steps
        self.steps = 0
        self.calib_amax: Tensor | None = calib_amax
        self.scale: Tensor | None = None
        self.given = scale is not None  # a user-given scale: never calibrated
        if scale is not None:
            self.scale = _check_scale_value(scale, "scale")

    @property
    def frozen(self) -> bool:
        return self.scale is not None

    def freeze(self) -> None:
        """Stop calibrating: the scale becomes ``scale(calib_amax)`` (recomputed, so a
        scaler whose ``calib_amax`` was loaded in place freezes at the loaded value).
        ``ValueError`` if nothing was seen yet; a given scale stays as it is."""
        if self.given:
            return
        if self.calib_amax is None:
            raise ValueError("StaticScaler.freeze(): no tensor seen yet; call it on data first")
        self.scale = self.scale_of(self.calib_amax)

    def unfreeze(self) -> None:
        """Go on calibrating from the maximum held (:attr:`calib_amax`), as if the scale had
        not frozen: a calibration restored from a checkpoint taken before it ended.
        ``ValueError`` for a given scale."""
        if self.given:
            raise ValueError(
                "StaticScaler.unfreeze(): the scale was given, there is nothing to calibrate"
            )
        self.scale = None

    def reset(self) -> None:
        """Start calibrating again from scratch (zeroes :attr:`calib_amax` in place)."""
        if self.given:
            raise ValueError(
                "StaticScaler.reset(): the scale was given, there is nothing to calibrate"
            )
        self.scale = None
        self.steps = 0
        if self.calib_amax is not None:
            self.calib_amax.zero_()

    def config(self) -> dict[str, Any]:
        return {**super().config(), "calibration_steps": self.calibration_steps}

    def _check_state(self, state: dict[str, Any]) -> None:
        super()._check_state(state)
        if state.get("scale") is not None:
            _check_scale_value(state["scale"], "state['scale']")
        a = state.get("calib_amax")
        if a is not None and not bool((torch.isfinite(a) & (a >= 0)).all()):
            raise ValueError(f"state['calib_amax'] must be finite and >= 0, got {a!r}")

    def __call__(
        self,
        x: Tensor | None = None,
        update: bool = True,
        *,
        state: Tensor | None = None,
        amax: Tensor | None = None,
    ) -> Tensor:
        """The scale for ``x`` (or for the tensor whose ``amax`` is given). While not
        frozen, ``update`` records that ``amax`` in the calibration maximum (``state``: that
        tensor, instead of :attr:`calib_amax`); with ``update=False`` the scale of the
        maximum so far (or of ``x``) is returned unrecorded."""
        if self.scale is not None:
            dev = x.device if x is not None else amax.device if amax is not None else None
            s = self.scale if dev is None else self.scale.to(dev)
            a = None if self.fmt.special != "finite" else _local_amax(x, amax, self)
            return s if a is None else self._guard(s, a)
        raw = self._amax(x, amax)
        cur = torch.where(torch.isfinite(raw), raw, 0.0)
        calib = self.calib_amax if state is None else state
        if calib is not None:
            self._check_shape(x, tuple(calib.shape), tuple(cur.shape))
            cur = torch.maximum(calib, cur)
        if not update:
            return self._guard(self.scale_of(cur), raw)
        if calib is None:
            self.calib_amax = cur
        else:
            calib.copy_(cur)
        if not torch.compiler.is_compiling():
            self.steps += 1
        scale = self.scale_of(cur)
        if self.calibration_steps is not None and self.steps >= self.calibration_steps:
            self.scale = scale
        return self._guard(scale, raw)


def _local_amax(x: Tensor | None, given: Tensor | None, sc: Scaler) -> Tensor | None:
    """``given`` (as float32), else the ``amax`` of ``x`` at ``sc``'s granularity on this
    process only (no reducer: it only tells which groups hold Inf/NaN here); ``None``
    without either."""
    if given is not None:
        return given.detach().float()
    return None if x is None else amax(x, sc.granularity)


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
