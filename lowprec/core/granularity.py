"""Granularity: which elements of a tensor share one scale — the one grammar of lowprec.

A :class:`Granularity` names a *kind* of scaling group and the *axis* the groups run along:

* ``tensor``: one scale, shape ``()``;
* ``axis``: one scale per slice, ``amax`` reduced over ``axis`` (``row`` = ``axis:-1``,
  ``column`` = ``axis:-2``); the scale keeps the reduced dim with size 1;
* ``block:RxC``: ``R × C`` blocks over the last two dims, ``C`` consecutive elements along
  ``axis`` (default the last dim) and ``R`` along the other of the last two, e.g. ``1x128``
  and ``128x128``; the scale has one entry per block;
* ``mx:B``: OCP Microscaling: ``B`` (default 32) consecutive elements along ``axis`` share
  an E8M0 scale ``2^(floor(log2 amax) - emax)``, ``emax`` the exponent of ``fmt.max`` (OCP
  MX v1.0 §6.3); elements are rounded with saturation, as the specification prescribes;
* ``nv:B``: NVFP4-style two-level scales: ``B`` (default 16) elements along ``axis`` share
  an E4M3 scale, and one float32 scale per tensor maps the block scales into E4M3's range
  (:func:`lowprec.core.scales.nv_scale`);
* ``mx:RxC``, ``nv:RxC``: the same scales on 2-D ``R × C`` blocks over the last two dims
  (``C`` along ``axis``, as ``block:RxC``), e.g. NVFP4's ``nv:16x16`` weight scales. A
  square block tiles a matrix and its transpose alike, so a weight quantized with one is
  the same values in the forward GEMM (``Wᵀ``) and the input-gradient GEMM (``W``).

**Absolute and relative forms.** The axis is either a dimension index (absolute: ``axis:0``,
``block:1x128@0``) or ``K``, *the contracted dimension of the GEMM the tensor is an operand
of* (relative: ``axis:K``, ``block:1x128@K``, ``mx:32@K``). A GEMM kernel needs its scales
laid out along K whichever side K is on, so float8 states every operand's granularity in
the relative form and :meth:`Granularity.bind` fixes it for one GEMM: ``block:1x128@K``
bound to an ``M×K`` operand is ``block:1x128`` (1 row × 128 columns); bound to a ``K×N``
operand it is ``block:1x128@0`` (128 rows × 1 column). Names without an axis (``axis``,
``rowwise``, ``block:RxC``, ``mx:B``, ``nv:B``) take the axis the caller gives
:meth:`Granularity.from_name` (``-1`` by default; ``"K"`` for float8's cast configs).

**Padding policy (one rule).** A block must divide the dimensions it tiles: nothing pads
silently. :meth:`Granularity.scale_shape` (and so ``amax``, ``quantize_scaled`` and the
scalers) refuses other shapes with a ``ValueError`` naming ``x``. A caller that accepts any
shape pads *explicitly* with zeros via :func:`pad_to_blocks` and records the unpadded shape
(``ScaledTensor(..., unpadded_shape=...)``, which ``dequantize`` crops back to): float8's GEMM
operands do this. Zeros change neither a block's ``amax`` nor any dot product, so a padded
GEMM equals the unpadded one computed with partial blocks.

A scale of shape ``(s_0, …, s_n)`` applies to data of shape ``(d_0, …, d_n)`` *block-wise*:
each ``s_i`` is 1 (broadcast), ``d_i`` (one per element) or a divisor of ``d_i`` (each
entry covers ``d_i / s_i`` consecutive elements). :func:`apply_scale` implements it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Granularity",
    "GranularityKind",
    "K",
    "apply_scale",
    "as_granularity",
    "check_scale_shape",
    "pad_to_blocks",
]


GranularityKind = Literal["tensor", "axis", "block", "mx", "nv"]
Axis = int | Literal["K"]
K: Literal["K"] = "K"
"""The relative axis: the contracted dimension of the GEMM an operand enters."""

_KINDS = ("tensor", "axis", "block", "mx", "nv")
_VALID = (
    "'tensor', 'row', 'column', 'axis' / 'axis:N' / 'axis:K', 'block:RxC' (e.g. 'block:1x128', "
    "'block:128x128'), 'mx' / 'mx:B' / 'mx:RxC', 'nv' / 'nv:B' / 'nv:RxC' (e.g. 'nv:16x16'); "
    "block, mx and nv take '@N' or '@K'"
)


@dataclass(frozen=True)
class Granularity:
    """Which elements share a scale. Build with the class methods or :meth:`from_name`.

    ``axis`` is a dimension index or :data:`K` (see the module docstring); ``block`` is
    ``(R, C)`` for ``block`` (``C`` along ``axis``) and ``(1, B)`` for ``mx`` and ``nv``
    (``(R, C)`` for their 2-D blocks ``mx:RxC``, ``nv:RxC``).

    Example:
        >>> Granularity.from_name("block:1x128")
        Granularity(kind='block', axis=-1, block=(1, 128))
        >>> Granularity.from_name("row").scale_shape((4, 256))
        (4, 1)
        >>> Granularity.from_name("block:1x128", axis="K").bind(0).scale_shape((256, 8))
        (2, 8)
    """

    kind: GranularityKind = "tensor"
    axis: Axis = -1
    block: tuple[int, int] = (1, 128)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(
                f"granularity kind must be one of {', '.join(map(repr, _KINDS))}, got {self.kind!r}"
            )
        if self.axis != K and (isinstance(self.axis, bool) or not isinstance(self.axis, int)):
            raise TypeError(f"axis must be an int or 'K', got {type(self.axis).__name__}")
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
    def along(cls, axis: Axis) -> Granularity:
        """One scale per slice; ``amax`` is reduced over ``axis``."""
        return cls("axis", axis=axis)

    @classmethod
    def blocks(cls, rows: int, cols: int, axis: Axis = -1) -> Granularity:
        """``rows × cols`` blocks over the last two dims, ``cols`` along ``axis``."""
        return cls("block", axis=axis, block=(rows, cols))

    @classmethod
    def mx(cls, size: int = 32, axis: Axis = -1, rows: int = 1) -> Granularity:
        """OCP MX: ``size`` consecutive elements along ``axis`` share an E8M0 scale
        (``rows > 1``: ``rows × size`` 2-D blocks over the last two dims)."""
        return cls("mx", axis=axis, block=(rows, size))

    @classmethod
    def nv(cls, size: int = 16, axis: Axis = -1, rows: int = 1) -> Granularity:
        """NVFP4-style: ``size`` elements along ``axis`` share an E4M3 scale (two-level;
        ``rows > 1``: ``rows × size`` 2-D blocks over the last two dims)."""
        return cls("nv", axis=axis, block=(rows, size))

    @classmethod
    def from_name(cls, name: str, axis: Axis = -1) -> Granularity:
        """Parse a name of the grammar (module docstring). ``axis`` is the axis of names
        that state none. An unknown name raises ``ValueError`` listing the valid ones."""
        if not isinstance(name, str):
            raise TypeError(f"granularity name must be a str, got {type(name).__name__}")
        if axis != K and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise TypeError(f"axis must be an int or 'K', got {axis!r}")
        key = name.strip().lower()
        if key in ("tensor", "tensorwise"):
            return cls.tensor()
        if key == "row":
            return cls.along(-1)
        if key in ("column", "col", "columnwise"):
            return cls.along(-2)
        if key in ("axis", "rowwise", "axiswise"):
            return cls.along(axis)
        m = re.fullmatch(r"axis:(-?\d+|k)", key)
        if m:
            return cls.along(_axis(m[1]))
        m = re.fullmatch(r"(?:block:)?(\d+)x(\d+)(?:@(-?\d+|k))?", key)
        if m and int(m[1]) >= 1 and int(m[2]) >= 1:
            return cls.blocks(int(m[1]), int(m[2]), _axis(m[3]) if m[3] else axis)
        m = re.fullmatch(r"(mx|nv)(?:32)?(?::(\d+)(?:x(\d+))?)?(?:@(-?\d+|k))?", key)
        if m and (m[1] == "mx" or not key.startswith("nv32")):
            rows, size = (int(m[2]), int(m[3])) if m[3] else (1, 0)
            if not m[3]:
                size = int(m[2]) if m[2] else (32 if m[1] == "mx" else 16)
            if size >= 1 and rows >= 1:
                ax = _axis(m[4]) if m[4] else axis
                return (cls.mx if m[1] == "mx" else cls.nv)(size, ax, rows)
        raise ValueError(f"granularity: unknown name {name!r}; valid: {_VALID}")

    @property
    def name(self) -> str:
        """The canonical name (``from_name(g.name) == g``)."""
        if self.kind == "tensor":
            return "tensor"
        ax = "K" if self.axis == K else str(self.axis)
        if self.kind == "axis":
            return f"axis:{ax}"
        at = "" if self.axis == -1 else f"@{ax}"
        if self.kind == "block":
            return f"block:{self.block[0]}x{self.block[1]}{at}"
        if self.block[0] > 1:  # 2-D MX / NVFP4 blocks
            return f"{self.kind}:{self.block[0]}x{self.block[1]}{at}"
        return f"{self.kind}:{self.block[1]}{at}"

    @property
    def relative(self) -> bool:
        """True when the axis is :data:`K`, to be fixed by :meth:`bind`."""
        return self.axis == K

    def bind(self, contracted_dim: int) -> Granularity:
        """The absolute granularity for an operand whose contracted dim is ``contracted_dim``
        (a relative granularity's ``K`` becomes it; an absolute one is returned as is)."""
        if isinstance(contracted_dim, bool) or not isinstance(contracted_dim, int):
            raise TypeError(f"contracted_dim must be an int, got {contracted_dim!r}")
        if not self.relative:
            return self
        return Granularity(self.kind, contracted_dim, self.block)

    def _tiles(self, nd: int) -> dict[int, int]:
        """``{dim: group size}`` for the dims the groups tile (tensor: none)."""
        if self.kind == "tensor":
            return {}
        if self.relative:
            raise ValueError(
                f"granularity {self.name} is relative to a GEMM's contracted dim; "
                "bind it first (Granularity.bind)"
            )
        assert isinstance(self.axis, int)
        two_d = self.kind == "block" or self.block[0] > 1  # block:RxC, mx:RxC, nv:RxC
        need = 2 if two_d else 1
        if nd < need:
            raise ValueError(f"x: {self.kind} granularity needs >= {need} dims, got {nd}")
        if not -nd <= self.axis < nd:
            raise ValueError(f"axis {self.axis} is out of range for a tensor of {nd} dims")
        ax = self.axis % nd
        if self.kind == "axis":
            return {ax: 0}  # 0: the whole dim
        if not two_d:
            return {ax: self.block[1]}
        if ax < nd - 2:
            raise ValueError(f"axis {self.axis}: block granularity tiles the last two dims")
        other = nd - 1 if ax == nd - 2 else nd - 2
        return {other: self.block[0], ax: self.block[1]}

    def scale_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """Shape of the scale for data of ``shape``; ``ValueError`` if blocks do not divide it
        (see the padding policy in the module docstring)."""
        shape = tuple(shape)
        out = list(shape)
        for d, size in self._tiles(len(shape)).items():
            if size == 0:
                out[d] = 1
            elif shape[d] % size:
                raise ValueError(
                    f"x: dim {d} of shape {shape} is not a multiple of the {self.name} group "
                    f"size {size}; pad it with pad_to_blocks (lowprec refuses to pad silently)"
                )
            else:
                out[d] = shape[d] // size
        return tuple(out) if self.kind != "tensor" else ()

    def padded_shape(self, shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        """``shape`` with each tiled dim rounded up to a multiple of its group size."""
        out = list(shape)
        for d, size in self._tiles(len(out)).items():
            if size > 1:
                out[d] += -out[d] % size
        return tuple(out)


def _axis(text: str) -> Axis:
    return K if text == "k" else int(text)


def as_granularity(g: str | Granularity) -> Granularity:
    """Accept a :class:`Granularity` or its name."""
    if isinstance(g, Granularity):
        return g
    return Granularity.from_name(g)


def pad_to_blocks(x: Tensor, g: Granularity) -> Tensor:
    """``x`` zero-padded at the end of each tiled dim to a multiple of ``g``'s group size
    (``x`` itself when nothing is needed): the one way lowprec pads (module docstring).

    Example:
        >>> pad_to_blocks(torch.ones(2, 3), Granularity.mx(4)).tolist()
        [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    """
    target = g.padded_shape(x.shape)
    if target == tuple(x.shape):
        return x
    pads: list[int] = []
    for d in reversed(range(x.dim())):
        pads += [0, target[d] - x.shape[d]]
    return F.pad(x, pads)


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


# torch.compile: a Granularity is hashable, immutable metadata (e.g. of a ScaledTensor built
# inside a compiled region); let Dynamo treat it as a constant.
torch.utils._pytree.register_constant(Granularity)
