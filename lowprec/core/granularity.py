"""Granularity: which elements of a tensor share one scale, and block-wise broadcasting.

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

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["Granularity", "GranularityKind", "apply_scale", "as_granularity", "check_scale_shape"]


GranularityKind = Literal["tensor", "axis", "block", "mx"]


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
