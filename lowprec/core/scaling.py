"""Scaling: turning statistics of a tensor into the scale that fits it into a format.

Convention (shared by every technique): a tensor ``x`` is stored as ``data × scale`` with
``data = x / scale`` in a narrow format. For a block whose largest magnitude is ``amax``,
the format's largest finite value ``fmt.max`` and a margin of ``m`` binades of headroom,

    scale = amax · 2^m / fmt.max        so that  |data| <= fmt.max · 2^-m.

With ``power_of_two=True`` the scale is rounded *up* to a power of two, which keeps
``|data| <= fmt.max · 2^-m`` and makes the division exact. The scale is clamped to
``[2^-126, 2^127]`` so it is always a normal float32 number.

Special statistics (no division by zero, never a NaN scale):

* ``amax == 0`` (an all-zero block): scale ``1``;
* ``amax`` is Inf or NaN (the block holds Inf/NaN): scale ``1`` — finite values are rounded
  as if unscaled and the Inf/NaN values themselves stay visible in the data. Stateful
  scalers do not record such an ``amax`` in their history and count it in
  ``nonfinite_count``.

Granularity (which elements share one scale; see :class:`Granularity`):

* ``tensor``: one scale, shape ``()``;
* ``axis``: one scale per slice, ``amax`` reduced over ``axis`` (``row`` = ``axis=-1``,
  ``column`` = ``axis=-2``); the scale keeps the reduced dim with size 1;
* ``block``: ``(r, c)`` blocks over the last two dims, e.g. ``1x128`` and ``128x128``; the
  scale has shape ``(..., R/r, C/c)``. A shape the block does not divide is *refused* with
  a ``ValueError`` (pad the tensor yourself: silent padding would change ``amax``);
* ``mx``: OCP Microscaling: blocks of 32 along ``axis`` share an E8M0 scale
  ``2^(floor(log2 amax) - emax)``, ``emax`` the exponent of ``fmt.max`` (OCP MX v1.0 §6.3).
  Elements are then rounded with saturation, as the specification prescribes.

A scale of shape ``(s_0, …, s_n)`` applies to data of shape ``(d_0, …, d_n)`` *block-wise*:
each ``s_i`` is 1 (broadcast), ``d_i`` (one per element) or a divisor of ``d_i`` (each
entry covers ``d_i / s_i`` consecutive elements). :func:`apply_scale` implements it.
"""

from __future__ import annotations

import logging
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lowprec.core.formats import E8M0, Format, get_format

__all__ = [
    "DelayedScaler",
    "DynamicScaler",
    "Granularity",
    "Scaler",
    "StaticScaler",
    "amax",
    "apply_scale",
    "as_granularity",
    "compute_scale",
    "delayed_amax",
    "mx_scale",
    "push_amax",
]

log = logging.getLogger(__name__)

GranularityKind = Literal["tensor", "axis", "block", "mx"]
_MIN_SCALE = 2.0**-126
_MAX_SCALE = 2.0**127


@dataclass(frozen=True)
class Granularity:
    """Which elements share a scale. Build with the class methods or :meth:`from_name`.

    Example:
        >>> Granularity.from_name("block:1x128")
        Granularity(kind='block', axis=-1, block=(1, 128))
        >>> Granularity.from_name("row").scale_shape((4, 256))
        (4, 1)
    """

    kind: GranularityKind = "tensor"
    axis: int = -1
    block: tuple[int, int] = (1, 128)

    def __post_init__(self) -> None:
        if self.kind not in ("tensor", "axis", "block", "mx"):
            raise ValueError(
                f"granularity kind must be 'tensor', 'axis', 'block' or 'mx', got {self.kind!r}"
            )
        if isinstance(self.axis, bool) or not isinstance(self.axis, int):
            raise TypeError(f"axis must be an int, got {type(self.axis).__name__}")
        b = self.block
        if (
            not isinstance(b, tuple)
            or len(b) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in b)
        ):
            raise ValueError(f"block must be a pair of positive ints, got {b!r}")

    @classmethod
    def tensor(cls) -> Granularity:
        return cls("tensor")

    @classmethod
    def along(cls, axis: int) -> Granularity:
        """One scale per slice; ``amax`` is reduced over ``axis``."""
        return cls("axis", axis=axis)

    @classmethod
    def blocks(cls, rows: int, cols: int) -> Granularity:
        """``rows × cols`` blocks over the last two dims."""
        return cls("block", block=(rows, cols))

    @classmethod
    def mx(cls, size: int = 32, axis: int = -1) -> Granularity:
        """OCP MX: ``size`` consecutive elements along ``axis`` share an E8M0 scale."""
        return cls("mx", axis=axis, block=(1, size))

    @classmethod
    def from_name(cls, name: str) -> Granularity:
        """Parse ``tensor``, ``row``, ``column``, ``axis:N``, ``block:RxC`` (or ``RxC``),
        ``mx`` or ``mx:N``. An unknown name raises ``ValueError`` listing the valid ones."""
        if not isinstance(name, str):
            raise TypeError(f"granularity name must be a str, got {type(name).__name__}")
        key = name.strip().lower()
        if key == "tensor":
            return cls.tensor()
        if key in ("row", "rowwise"):
            return cls.along(-1)
        if key in ("column", "col", "columnwise"):
            return cls.along(-2)
        if key in ("mx", "mx32"):
            return cls.mx()
        m = re.fullmatch(r"axis:(-?\d+)", key)
        if m:
            return cls.along(int(m[1]))
        m = re.fullmatch(r"(?:block:)?(\d+)x(\d+)", key)
        if m:
            return cls.blocks(int(m[1]), int(m[2]))
        m = re.fullmatch(r"mx:(\d+)", key)
        if m:
            return cls.mx(int(m[1]))
        raise ValueError(
            f"granularity: unknown name {name!r}; valid: 'tensor', 'row', 'column', "
            "'axis:N', 'block:RxC' (e.g. 'block:1x128', 'block:128x128'), 'mx', 'mx:N'"
        )

    @property
    def name(self) -> str:
        if self.kind == "tensor":
            return "tensor"
        if self.kind == "axis":
            return f"axis:{self.axis}"
        if self.kind == "block":
            return f"block:{self.block[0]}x{self.block[1]}"
        return f"mx:{self.block[1]}" + ("" if self.axis == -1 else f"@{self.axis}")

    def scale_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """Shape of the scale for data of ``shape``; ``ValueError`` if blocks do not divide it."""
        shape = tuple(shape)
        if self.kind == "tensor":
            return ()
        nd = len(shape)
        if self.kind == "block":
            if nd < 2:
                raise ValueError(f"x: block granularity needs >= 2 dims, got shape {shape}")
            r, c = self.block
            if shape[-2] % r or shape[-1] % c:
                raise ValueError(
                    f"x: shape {shape} is not divisible into {r}x{c} blocks over its last two "
                    "dims; pad it to a multiple of the block (lowprec refuses to pad silently)"
                )
            return (*shape[:-2], shape[-2] // r, shape[-1] // c)
        if nd == 0:
            raise ValueError(f"x: {self.kind} granularity needs >= 1 dim, got a scalar")
        if not -nd <= self.axis < nd:
            raise ValueError(f"axis {self.axis} is out of range for a tensor of shape {shape}")
        ax = self.axis % nd
        out = list(shape)
        if self.kind == "axis":
            out[ax] = 1
        else:
            size = self.block[1]
            if shape[ax] % size:
                raise ValueError(
                    f"x: dim {ax} of shape {shape} is not a multiple of the MX block size {size}; "
                    "pad it (lowprec refuses to pad silently)"
                )
            out[ax] = shape[ax] // size
        return tuple(out)


def as_granularity(g: str | Granularity) -> Granularity:
    """Accept a :class:`Granularity` or its name."""
    if isinstance(g, Granularity):
        return g
    return Granularity.from_name(g)


# ---------------------------------------------------------------------------------------
# Block-wise broadcasting
# ---------------------------------------------------------------------------------------


def _block_views(
    data_shape: tuple[int, ...], scale_shape: tuple[int, ...]
) -> tuple[list[int], list[int], bool]:
    """Views that turn block-wise broadcasting into ordinary broadcasting.

    Returns ``(data_view, scale_view, blocked)``: a dim where the scale divides the data
    becomes the pair ``(s_i, d_i/s_i)`` in the data view and ``(s_i, 1)`` in the scale view.
    ``blocked`` is False when no dim needed splitting. Raises ``ValueError`` otherwise.
    """
    if len(scale_shape) > len(data_shape):
        raise ValueError(f"scale of shape {scale_shape} has more dims than data {data_shape}")
    sshape = (1,) * (len(data_shape) - len(scale_shape)) + tuple(scale_shape)
    dview: list[int] = []
    sview: list[int] = []
    for d, s in zip(data_shape, sshape, strict=True):
        if s == 1 or s == d:
            dview.append(d)
            sview.append(s)
        elif s == 0 or d % s:
            raise ValueError(
                f"scale of shape {tuple(scale_shape)} is not block-broadcastable to data of "
                f"shape {tuple(data_shape)}: each scale dim must be 1, equal, or divide the "
                "data dim"
            )
        else:
            dview += [s, d // s]
            sview += [s, 1]
    return dview, sview, len(dview) != len(data_shape)


def check_scale_shape(scale_shape: tuple[int, ...], data_shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless a scale of ``scale_shape`` applies to ``data_shape``."""
    _block_views(tuple(data_shape), tuple(scale_shape))


def apply_scale(x: Tensor, scale: Tensor, op: Literal["mul", "div"] = "mul") -> Tensor:
    """``x * scale`` (or ``x / scale``) with block-wise broadcasting of ``scale``."""
    dview, sview, blocked = _block_views(tuple(x.shape), tuple(scale.shape))
    if not blocked:
        return x * scale if op == "mul" else x / scale
    xs, ss = x.reshape(dview), scale.reshape(sview)
    return (xs * ss if op == "mul" else xs / ss).reshape(x.shape)


# ---------------------------------------------------------------------------------------
# Statistics -> scale
# ---------------------------------------------------------------------------------------


def amax(x: Tensor, granularity: str | Granularity = "tensor") -> Tensor:
    """Largest magnitude per scaling group, as float32 of shape ``granularity.scale_shape``.

    NaN propagates (a group holding a NaN has amax NaN); Inf gives Inf.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    g = as_granularity(granularity)
    shape = g.scale_shape(x.shape)
    if g.kind == "tensor":
        if not x.numel():
            return torch.zeros((), device=x.device)
        # aminmax reads x once without an |x| temporary (10x faster eager on CPU than
        # x.abs().amax()); maximum() propagates NaN.
        lo, hi = torch.aminmax(x.detach())
        return torch.maximum(hi, -lo).float()
    a = x.detach().abs()
    dview, sview, _ = _block_views(tuple(x.shape), shape)
    red = tuple(i for i, s in enumerate(sview) if s == 1)
    return a.reshape(dview).amax(dim=red, keepdim=True).reshape(shape).float()


def _check_margin(margin: float) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be a number of binades, got {type(margin).__name__}")
    if not math.isfinite(margin):
        raise ValueError(f"margin must be finite, got {margin}")
    return float(margin)


def _pow2_up(s: Tensor) -> Tensor:
    """Smallest power of two >= ``s`` (positive finite float32), on the bit pattern."""
    bits = s.view(torch.int32)
    return ((bits + ((1 << 23) - 1)) & -(1 << 23)).view(torch.float32)


def compute_scale(
    amax: Tensor, fmt: str | Format, margin: float = 0.0, power_of_two: bool = False
) -> Tensor:
    """``scale = amax · 2^margin / fmt.max`` (float32), optionally rounded up to a power of 2.

    Zero, Inf and NaN ``amax`` give scale 1 (see the module docstring).

    Example:
        >>> import torch
        >>> compute_scale(torch.tensor(896.0), "e4m3fn").item()
        2.0
        >>> compute_scale(torch.tensor([0.0, float("nan"), 3.0]), "e4m3fn", power_of_two=True)
        tensor([1.0000, 1.0000, 0.0078])
    """
    fmt = get_format(fmt)
    margin = _check_margin(margin)
    if not isinstance(amax, Tensor):
        raise TypeError(f"amax must be a torch.Tensor, got {type(amax).__name__}")
    a = amax.float()
    ok = torch.isfinite(a) & (a > 0)
    # One correctly rounded division (fmt.max · 2^-margin is exact: a power-of-two multiple).
    s = (torch.where(ok, a, 1.0) / (fmt.max * 2.0**-margin)).clamp(_MIN_SCALE, _MAX_SCALE)
    if power_of_two:
        s = _pow2_up(s).clamp(max=_MAX_SCALE)
    return torch.where(ok, s, 1.0)


def mx_scale(amax: Tensor, fmt: str | Format) -> Tensor:
    """OCP MX shared scale ``2^(floor(log2 amax) - emax_elem)``, clamped to E8M0's range.

    ``emax_elem`` is the exponent of ``fmt.max`` (e4m3fn: 8, e5m2: 15, e2m1: 2). Returned as
    float32 values that are exactly representable in E8M0. Zero/Inf/NaN amax give 1.
    """
    fmt = get_format(fmt)
    a = amax.float()
    ok = torch.isfinite(a) & (a > 0)
    e = ((torch.where(ok, a, 1.0).view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2 a)
    x = (e - fmt.max_exponent).clamp(E8M0.min_exponent, E8M0.max_exponent)
    s = torch.ldexp(torch.ones_like(a), x.float()) if a.numel() else a.clone()
    return torch.where(ok, s, 1.0)


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
        if self.granularity.kind == "mx":
            return mx_scale(a, self.fmt)
        return compute_scale(a, self.fmt, self.margin, self.power_of_two)

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
        if self.granularity.kind == "mx":
            raise ValueError(
                f"granularity: MX scales are dynamic by definition; use DynamicScaler, "
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
