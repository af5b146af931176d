"""How an optimizer state tensor is stored: FP32, BF16, or 8 bits with block scales.

A :class:`StateCodec` encodes an FP32 state tensor ``x`` (a first moment, a second moment,
a momentum buffer) into what the optimizer keeps between steps, and decodes it back:

* ``"fp32"``: ``x`` itself (decode returns the stored tensor, updated in place: the
  optimizer's arithmetic is then exactly the FP32 one);
* ``"bf16"``: ``x`` rounded to BF16 (same range as FP32, 8 significant bits);
* ``"e4m3"`` / ``"int8"``: 8 bits per value in blocks along the rows, each block with an
  FP32 scale ``s = amax(|block|) / q_max`` over the block's finite elements (``q_max`` =
  448 for E4M3, 127 for int8; ``s = 1`` for a block with no finite nonzero element, and
  never below FP32's smallest subnormal ``2^-149``). A tensor of shape ``(d₀, d₁, …)`` with
  two or more dimensions is read as ``d₀`` rows of ``M = d₁·d₂·…`` elements (its row-major
  layout); each row is cut into ``⌈M / block_size⌉`` blocks of ``block_size`` consecutive
  elements (the last one of each row may be short). A tensor of fewer dimensions is one
  row. No block crosses a row, so a tensor sharded on dim 0 (FSDP2's ``Shard(0)``: whole
  rows per rank) has on each rank exactly the blocks, scales and codes of those rows in the
  whole tensor: the 8-bit state does not depend on the number of ranks. The codes have
  ``x``'s shape, one byte per element (E4M3 codes as their bits in ``uint8``, which no
  state-dict loader or finiteness check mistakes for a float tensor); the scales have shape
  ``(d₀, ⌈M / block_size⌉)`` (``(⌈numel / block_size⌉,)`` for one row), so both shard on
  dim 0 as the tensor does. The codes are ``round(x / s)`` in E4M3 (``float8_e4m3fn``) or
  in the integers ``[-127, 127]`` (``int8``); ``decode`` returns ``codes · s``.

Non-finite elements (8-bit formats) are coded one by one and stay where they are: they
take no part in their block's scale, so their finite neighbours keep the codes and the
error bounds below as if they were not there, and each decodes as itself as far as the
codes can say it:

* NaN is stored as a NaN code (E4M3's ``0x7F``; int8's ``-128``, outside the codes
  ``[-127, 127]``) and decodes as NaN;
* with ``sqrt``, ``+inf`` (a second moment ``v = β₂v + (1-β₂)g²`` whose ``(1-β₂)g²``
  overflowed FP32: ``|g| ≳ 5.8·10^20`` for ``β₂ = 0.999``) is stored as the code of
  ``+inf``, free because ``√x ≥ 0``: E4M3's ``0xFF`` (the bits of −NaN), int8's ``-1``; it
  decodes as ``+inf``, so AdamW's update of that element is ``m / ∞ = 0``, as in FP32
  (torch keeps ``v = ∞`` for good);
* without ``sqrt`` (first moments, momentum buffers), ``±inf`` decodes as NaN: there are
  not enough spare codes, and such a moment comes only from a gradient that is infinite
  (or within 2× of FP32's largest value), which makes the element non-finite in FP32
  too (AdamW's ``m / √v = ∞/∞``: NaN, as torch's; SGD's weight is ``∓inf`` in torch and
  NaN here).

So one bad gradient element no longer spreads to its block: formerly an ``inf`` in a
block made its scale ``inf`` (every weight of the block NaN after the next step), and a
NaN made it 1 (the finite neighbours rounded on an absolute grid, their updates 6× too
small). Encoding stays free of host synchronisation (masks, no branches on the data).

``sqrt=True`` stores ``√x`` instead of ``x`` (for second moments, ``x ≥ 0``) and decodes
``(codes · s)²``: the square root halves the binades a block has to cover, so small
second moments (whose reciprocal square roots scale the largest updates) keep their
digits rather than rounding to zero. Where the format's step is absolute (E4M3's
subnormals, ``√x < 2^-6·s``; int8's first step, ``√x < s``), ``√x`` rounds *up* to the
next code, with either rounding: a stored second moment is never below its value there,
and never 0 for a positive one. Rounded down (to 0 at worst), ``m / (√v̂ + ε)`` of a
small second moment in a block with a large one grew without bound (an 8-bit AdamW step
of 372× the learning rate where the block's gradients differed by 10^6, rounded
stochastically); rounded up, such a step is at most the first moment's own rounding
above FP32's, and the smallest moments' updates are smaller than FP32's, never larger.

Error bounds, per element, with ``s`` the block's scale (``rounding="nearest"``; twice
each for ``"stochastic"``, which rounds to one of the two neighbours, unbiased), up to the
FP32 rounding of ``x / s`` and ``codes · s`` (relative ``2^-23`` each):

* E4M3 (3 mantissa bits, smallest subnormal ``2^-9``): ``|x̂ - x| ≤ 2^-4·|x| + 2^-10·s``;
* int8: ``|x̂ - x| ≤ s / 2 = amax / 254``;
* BF16 (8 significant bits): ``|x̂ - x| ≤ 2^-9·|x|``.

With ``sqrt``, the bound holds for ``√x`` above the absolute-step range, and there
``0 ≤ √x̂ - √x ≤ 2^-9·s`` (E4M3) or ``≤ s`` (int8); then ``|x̂ - x| ≤ (2ε + ε²)·x`` for a
relative bound ``ε`` on ``√x``.

Example:
    >>> import torch
    >>> c = StateCodec("e4m3", block_size=4)
    >>> codes, scales = c.encode(torch.tensor([1.0, -0.5, 0.3, 0.0, 2.0]))
    >>> codes.dtype, tuple(codes.shape), [round(448 * s, 4) for s in scales.tolist()]
    (torch.uint8, (5,), [1.0, 2.0])
    >>> [round(v, 4) for v in c.decode(codes, scales, (5,)).tolist()]  # 0.3·448 = 134.4 → 128
    [1.0, -0.5, 0.2857, 0.0, 2.0]
    >>> codes, scales = c.encode(torch.ones(3, 6))  # 3 rows of 6: blocks of 4 and 2 per row
    >>> tuple(codes.shape), tuple(scales.shape)
    ((3, 6), (3, 2))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lowprec.core.rounding import quantize, to_format

__all__ = ["StateCodec", "StateFormat", "scale_shape", "state_codecs"]

StateFormat = Literal["fp32", "bf16", "e4m3", "int8"]
_FORMATS = ("fp32", "bf16", "e4m3", "int8")
_QMAX = {"e4m3": 448.0, "int8": 127.0}
# Each 8-bit format's smallest positive code, in units of the block scale
_FIRST_CODE = {"e4m3": 2.0**-9, "int8": 1.0}
# The codes of non-finite elements: NaN (E4M3's own NaN; int8's -128, outside [-127, 127]),
# and +inf for ``sqrt`` codecs, whose finite codes are >= 0 (E4M3's -NaN; int8's -1)
_NAN_CODE = {"e4m3": 0x7F, "int8": -128}
_STORED = {"fp32": torch.float32, "bf16": torch.bfloat16, "e4m3": torch.uint8, "int8": torch.int8}
_INF_CODE = {"e4m3": 0xFF, "int8": -1}


@dataclass(frozen=True)
class StateCodec:
    """Storage of one optimizer state tensor (module docstring).

    Attributes:
        format: ``"fp32"``, ``"bf16"``, ``"e4m3"`` or ``"int8"``.
        block_size: elements per scale block of the 8-bit formats (>= 1).
        sqrt: store the square root (second moments; values must be ``>= 0``).
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased; draws from
            the generator given to :meth:`encode`).
    """

    format: StateFormat = "fp32"
    block_size: int = 256
    sqrt: bool = False
    rounding: Literal["nearest", "stochastic"] = "nearest"

    def __post_init__(self) -> None:
        if self.format not in _FORMATS:
            raise ValueError(f"format must be one of {list(_FORMATS)}, got {self.format!r}")
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block_size must be an int >= 1, got {b!r}")
        if not isinstance(self.sqrt, bool):
            raise TypeError(f"sqrt must be a bool, got {self.sqrt!r}")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {self.rounding!r}")

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype :meth:`encode`'s codes are kept in: ``float32``, ``bfloat16``, and
        ``uint8`` (E4M3 bits) or ``int8`` for the 8-bit formats."""
        return _STORED[self.format]

    @property
    def blocked(self) -> bool:
        """True for the 8-bit formats, which keep one FP32 scale per block."""
        return self.format in _QMAX

    def zeros(self, shape: torch.Size, device: torch.device) -> tuple[Tensor, Tensor | None]:
        """The encoding of an all-zero state of ``shape``."""
        return self.encode(torch.zeros(shape, device=device))

    def encode(
        self, x: Tensor, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``(codes, scales)`` of the FP32 tensor ``x`` (``scales`` is ``None`` for FP32 and
        BF16). For ``"fp32"`` without ``sqrt`` the codes are ``x`` itself."""
        if self.sqrt:
            x = x.sqrt()
        if self.format == "fp32":
            return x, None
        if self.format == "bf16":
            if self.rounding == "nearest":
                return x.to(torch.bfloat16), None
            return quantize(x, "bf16", "stochastic", generator=generator).bfloat16(), None
        shape = x.shape
        blocks = _blocks(x, self.block_size)  # (rows, blocks per row, block_size)
        finite = blocks.isfinite()
        amax = blocks.abs().nan_to_num_(0.0, 0.0, 0.0).amax(dim=2)  # of the finite elements
        # 2^-149 (FP32's smallest subnormal): amax / q_max of a tiny block must not be 0
        scales = torch.where(amax > 0, (amax / _QMAX[self.format]).clamp_min(2.0**-149), 1.0)
        q = blocks / scales[..., None]
        if self.sqrt:  # a positive √x below the first code rounds up to it (docstring)
            step = _FIRST_CODE[self.format]
            q = torch.where((q > 0) & (q < step), step, q)
        if self.format == "e4m3":
            codes = to_format(q, "e4m3fn", self.rounding, saturate=True, generator=generator)
            codes = codes.view(torch.uint8)
        else:
            if self.rounding == "nearest":
                q = q.round()
            else:
                q = (q + torch.rand(q.shape, generator=generator, device=q.device)).floor()
            codes = q.clamp_(-127, 127).to(torch.int8)
        # Non-finite elements: their own codes, outside their block's scale (docstring)
        codes = codes.masked_fill(~finite, _NAN_CODE[self.format])
        if self.sqrt:
            codes = codes.masked_fill(blocks == math.inf, _INF_CODE[self.format])
        return _unblock(codes, shape).clone(), scales.reshape(scale_shape(shape, self.block_size))

    def decode(self, codes: Tensor, scales: Tensor | None, shape: tuple[int, ...]) -> Tensor:
        """The FP32 state of ``shape`` from :meth:`encode`'s ``(codes, scales)``."""
        if self.format == "fp32":
            x = codes
        elif self.format == "bf16":
            x = codes.float()
        else:
            if scales is None:
                raise ValueError(f"scales: the {self.format} codes need their block scales")
            shape = torch.Size(shape)
            want = scale_shape(shape, self.block_size)
            if tuple(scales.shape) != want or codes.numel() != shape.numel():
                raise ValueError(
                    f"scales: shape {tuple(scales.shape)} and {codes.numel()} codes do not "
                    f"fit a state of shape {tuple(shape)} (scales {want}: blocks of "
                    f"{self.block_size} along each row; a flat layout of an older lowprec?)"
                )
            codes = codes.reshape(shape)
            if self.format == "e4m3":  # its NaN codes (0x7F, 0xFF) decode as NaN
                vals = codes.view(torch.float8_e4m3fn).float()
            else:
                vals = codes.float().masked_fill_(codes == _NAN_CODE["int8"], math.nan)
            if self.sqrt:
                vals.masked_fill_(codes == _INF_CODE[self.format], math.inf)
            blocks = _blocks(vals, self.block_size)
            x = _unblock(blocks * scales.reshape(blocks.shape[:2])[..., None], shape)
        return x.square() if self.sqrt else x


def _rows(shape: torch.Size) -> tuple[int, int]:
    """``(rows, M)`` of the block layout: ``(d₀, d₁·d₂·…)`` for two or more dimensions,
    else one row of every element."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def scale_shape(shape: torch.Size | tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """The shape of the block scales of a state of ``shape``: ``(d₀, ⌈M / block_size⌉)``,
    or ``(⌈numel / block_size⌉,)`` for fewer than two dimensions (module docstring)."""
    rows, m = _rows(torch.Size(shape))
    nb = -(-m // block_size)
    return (rows, nb) if len(shape) >= 2 else (nb,)


def _blocks(x: Tensor, b: int) -> Tensor:
    """``x`` as ``(rows, ⌈M / b⌉, b)``: each row zero-padded to whole blocks of ``b``."""
    rows, m = _rows(x.shape)
    flat = x.reshape(rows, m)
    pad = -m % b
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(rows, (m + pad) // b, b)


def _unblock(blocks: Tensor, shape: torch.Size) -> Tensor:
    """The inverse of :func:`_blocks`: the padding dropped, ``shape`` restored."""
    rows, m = _rows(shape)
    return blocks.reshape(rows, blocks.shape[1] * blocks.shape[2])[:, :m].reshape(shape)


def state_codecs(
    precision: str, block_size: int = 256, rounding: Literal["nearest", "stochastic"] = "nearest"
) -> tuple[StateCodec, StateCodec]:
    """The codecs of a first and a second moment for an optimizer-state ``precision``:
    ``"fp32"``, ``"bf16"`` or ``"8bit"`` (first moment in E4M3, second moment as its square
    root in E4M3, both in blocks of ``block_size`` with FP32 scales; the choice and its
    measurements: docs/mixed-precision.md)."""
    if precision == "fp32":
        return StateCodec("fp32"), StateCodec("fp32")
    if precision == "bf16":
        return StateCodec("bf16", rounding=rounding), StateCodec("bf16", rounding=rounding)
    if precision == "8bit":
        return (
            StateCodec("e4m3", block_size, rounding=rounding),
            StateCodec("e4m3", block_size, sqrt=True, rounding=rounding),
        )
    raise ValueError(f"precision must be 'fp32', 'bf16' or '8bit', got {precision!r}")
