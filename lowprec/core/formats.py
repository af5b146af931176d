"""Number formats: what an ExMy floating-point format can hold.

A :class:`Format` describes a binary floating-point format with ``exponent_bits`` (E),
``mantissa_bits`` (M) and an exponent ``bias``. A finite non-zero code with exponent
field ``e`` and mantissa field ``m`` has the value

* normal (``e > 0``):    ``(-1)^s · 2^(e - bias) · (1 + m / 2^M)``
* subnormal (``e = 0``): ``(-1)^s · 2^(1 - bias) · (m / 2^M)``

The *special-value convention* (``special``) decides what the top codes mean:

============ ============================== =============================== ==================
convention   infinities                     NaN                             examples
============ ============================== =============================== ==================
``ieee``     ``e = 2^E-1, m = 0``           ``e = 2^E-1, m != 0``           fp32, fp16, e5m2
``fn``       none                           all-ones exponent and mantissa  e4m3fn, e8m0fnu
``fnuz``     none                           the negative-zero code ``0x80``  e4m3fnuz, e5m2fnuz
``finite``   none                           none                            e2m1, e2m3, e3m2
============ ============================== =============================== ==================

An unsigned format (only E8M0-style, ``mantissa_bits == 0``) is a pure power of two:
its code ``e`` means ``2^(e - bias)``; it has no zero, no sign and no subnormals.

Rounding into a format lives in :mod:`lowprec.core.rounding`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = [
    "Format",
    "Rounding",
    "Special",
    "format_names",
    "get_format",
]

Special = Literal["ieee", "fn", "fnuz", "finite"]
Rounding = Literal["nearest", "stochastic"]
_SPECIALS: tuple[str, ...] = ("ieee", "fn", "fnuz", "finite")


@dataclass(frozen=True)
class Format:
    """A binary floating-point number format (see the module docstring for the encoding).

    Example:
        >>> from lowprec.core.formats import get_format
        >>> f = get_format("e4m3fn")
        >>> f.max, f.min_normal, f.min_subnormal, f.epsilon
        (448.0, 0.015625, 0.001953125, 0.125)
    """

    exponent_bits: int
    mantissa_bits: int
    bias: int | None = None
    special: Special = "ieee"
    signed: bool = True
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        e, m = self.exponent_bits, self.mantissa_bits
        for arg, val in (("exponent_bits", e), ("mantissa_bits", m)):
            if isinstance(val, bool) or not isinstance(val, int):
                raise TypeError(f"{arg} must be an int, got {type(val).__name__}")
        if self.special not in _SPECIALS:
            raise ValueError(f"special must be one of {_SPECIALS}, got {self.special!r}")
        if not 1 <= e <= 8:
            raise ValueError(
                f"exponent_bits must be in 1..8 (formats must fit in float32), got {e}"
            )
        if not 0 <= m <= 23:
            raise ValueError(
                f"mantissa_bits must be in 0..23 (formats must fit in float32), got {m}"
            )
        if self.special == "ieee" and e < 2:
            raise ValueError("an 'ieee' format needs exponent_bits >= 2 (one code is Inf/NaN)")
        if self.special == "fn" and e == 1 and m == 0:
            raise ValueError("an 'fn' format with e1m0 has no finite value")
        if not self.signed and (m != 0 or self.special != "fn"):
            raise ValueError(
                "unsigned formats must be exponent-only with an all-ones NaN "
                f"(E8M0 style: mantissa_bits=0, special='fn'), got mantissa_bits={m}, "
                f"special={self.special!r}"
            )
        if self.special == "fnuz" and not self.signed:
            raise ValueError("an 'fnuz' format must be signed (its NaN is the -0 code)")
        if self.bias is None:
            default = 2 ** (e - 1) - (0 if self.special == "fnuz" else 1)
            object.__setattr__(self, "bias", default)
        elif isinstance(self.bias, bool) or not isinstance(self.bias, int):
            raise TypeError(f"bias must be an int or None, got {type(self.bias).__name__}")
        if not self.name:
            object.__setattr__(self, "name", _canonical_name(self))
        # Every value must be an exact float32 number.
        if self.max > torch.finfo(torch.float32).max or self.min_subnormal < 2.0**-149:
            raise ValueError(
                f"bias={self.bias} puts format {self.name} outside float32's range "
                f"(max {self.max:g}, min subnormal {self.min_subnormal:g})"
            )

    # ---- derived properties -------------------------------------------------------
    @property
    def _bias(self) -> int:
        assert self.bias is not None
        return self.bias

    @property
    def total_bits(self) -> int:
        """Bits per code: sign (if signed) + exponent + mantissa."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def num_codes(self) -> int:
        """Number of distinct codes, ``2^total_bits`` (including NaN/Inf codes)."""
        return 1 << self.total_bits

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        # An 'ieee' format without mantissa bits has only Inf in its top exponent.
        return self.special != "finite" and not (self.special == "ieee" and self.mantissa_bits == 0)

    @property
    def has_zero(self) -> bool:
        return self.signed

    @property
    def has_subnormals(self) -> bool:
        return self.signed and self.mantissa_bits > 0

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of the largest finite value."""
        top = (1 << self.exponent_bits) - 1
        if self.special == "ieee" or (self.special == "fn" and self.mantissa_bits == 0):
            top -= 1
        return top - self._bias

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal value (``1 - bias``; ``-bias`` for E8M0)."""
        return (1 if self.signed else 0) - self._bias

    @property
    def max(self) -> float:
        """Largest finite value: ``2^emax · (2 - k·2^-M)`` with ``k = 2`` for ``fn``, else 1."""
        m = self.mantissa_bits
        if m == 0:
            return 2.0**self.max_exponent
        k = 2 if self.special == "fn" else 1
        return 2.0**self.max_exponent * (2.0 - k * 2.0**-m)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, ``2^(1 - bias)``."""
        return 2.0**self.min_exponent

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value, ``2^(1 - bias - M)`` (``min_normal`` without subnormals)."""
        if not self.has_subnormals:
            return self.min_normal
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def epsilon(self) -> float:
        """Distance from 1 to the next larger value, ``2^-M``."""
        return 2.0**-self.mantissa_bits

    @property
    def binades(self) -> float:
        """Dynamic range in binades, ``log2(max / min_subnormal)``."""
        return math.log2(self.max / self.min_subnormal)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype that stores this format exactly, if any."""
        return _NATIVE.get(self, _STORAGE_ONLY.get(self))

    def __str__(self) -> str:
        return self.name


def _canonical_name(f: Format) -> str:
    for name, g in _REGISTRY.items():
        if g == f:
            return name
    default_bias = 2 ** (f.exponent_bits - 1) - (0 if f.special == "fnuz" else 1)
    name = f"e{f.exponent_bits}m{f.mantissa_bits}"
    if f.bias != default_bias:
        name += f"b{f.bias}"
    if f.special != "ieee":
        name += f.special  # "fn", "fnuz" or "finite" (e3m2/e2m3/e2m1 have built-in names)
    if not f.signed:
        name += "u"
    return name


_REGISTRY: dict[str, Format] = {}


def _register(name: str, *aliases: str, **kw: object) -> Format:
    f = Format(name=name, **kw)  # type: ignore[arg-type]
    for n in (name, *aliases):
        _REGISTRY[n] = f
    return f


FP32 = _register("fp32", "float32", exponent_bits=8, mantissa_bits=23)
TF32 = _register("tf32", exponent_bits=8, mantissa_bits=10)
BF16 = _register("bf16", "bfloat16", exponent_bits=8, mantissa_bits=7)
FP16 = _register("fp16", "float16", "half", exponent_bits=5, mantissa_bits=10)
E4M3FN = _register("e4m3fn", "fp8_e4m3", exponent_bits=4, mantissa_bits=3, special="fn")
E5M2 = _register("e5m2", "fp8_e5m2", exponent_bits=5, mantissa_bits=2)
E4M3FNUZ = _register("e4m3fnuz", exponent_bits=4, mantissa_bits=3, special="fnuz")
E5M2FNUZ = _register("e5m2fnuz", exponent_bits=5, mantissa_bits=2, special="fnuz")
E4M3 = _register("e4m3", exponent_bits=4, mantissa_bits=3)
E3M4 = _register("e3m4", exponent_bits=3, mantissa_bits=4)
E4M3B11FNUZ = _register("e4m3b11fnuz", exponent_bits=4, mantissa_bits=3, bias=11, special="fnuz")
E3M2 = _register("e3m2", "e3m2fn", "fp6_e3m2", exponent_bits=3, mantissa_bits=2, special="finite")
E2M3 = _register("e2m3", "e2m3fn", "fp6_e2m3", exponent_bits=2, mantissa_bits=3, special="finite")
E2M1 = _register("e2m1", "e2m1fn", "fp4_e2m1", exponent_bits=2, mantissa_bits=1, special="finite")
E8M0 = _register("e8m0", "e8m0fnu", exponent_bits=8, mantissa_bits=0, special="fn", signed=False)

_NATIVE: dict[Format, torch.dtype] = {
    FP32: torch.float32,
    BF16: torch.bfloat16,
    FP16: torch.float16,
    E4M3FN: torch.float8_e4m3fn,
    E5M2: torch.float8_e5m2,
    E4M3FNUZ: torch.float8_e4m3fnuz,
    E5M2FNUZ: torch.float8_e5m2fnuz,
}
# Torch dtypes that store a format exactly but whose casts round differently from
# ml_dtypes (torch casts 0 and negatives to E8M0's 2^-127 code): storage only.
_STORAGE_ONLY: dict[Format, torch.dtype] = (
    {E8M0: torch.float8_e8m0fnu} if hasattr(torch, "float8_e8m0fnu") else {}
)
# Casts that inductor may drop in a round trip (it computes these dtypes in fp32).
_ELIDED = (torch.float16, torch.bfloat16)
_DTYPE_TO_FORMAT: dict[torch.dtype, Format] = {v: k for k, v in (_NATIVE | _STORAGE_ONLY).items()}

_PATTERN = re.compile(r"^e(\d+)m(\d+)(?:b(\d+))?(fnuz|fnu|fn|finite)?$")


def format_names() -> list[str]:
    """Canonical names of the built-in formats (aliases and any ``eXmY[bB][fn|fnuz]`` work too)."""
    return sorted({f.name for f in _REGISTRY.values()}, key=lambda n: list(_REGISTRY).index(n))


def get_format(name: str | Format | torch.dtype, *, arg: str = "name") -> Format:
    """Return the :class:`Format` called ``name``.

    Accepts a built-in name (``fp32, tf32, bf16, fp16, e4m3fn, e5m2, e4m3fnuz, e5m2fnuz,
    e4m3, e3m4, e4m3b11fnuz, e3m2, e2m3, e2m1, e8m0``), a torch floating dtype, a ``Format``
    (returned as is), or any ``eXmY`` spelling: ``e6m9`` (IEEE-like), ``e4m3fn``,
    ``e5m2fnuz``, ``e4m3b11fnuz`` (explicit bias).

    ``arg`` is the argument name the errors blame (functions taking a format as ``fmt``
    pass ``arg="fmt"``).

    Raises:
        ValueError: unknown name, listing the valid ones.
        TypeError: ``name`` is neither a string, a dtype nor a Format.
    """
    if isinstance(name, Format):
        return name
    if isinstance(name, torch.dtype):
        if name in _DTYPE_TO_FORMAT:
            return _DTYPE_TO_FORMAT[name]
        raise ValueError(
            f"{arg}: torch dtype {name} has no lowprec format; "
            f"supported dtypes: {sorted(str(d) for d in _DTYPE_TO_FORMAT)}"
        )
    if not isinstance(name, str):
        raise TypeError(f"{arg} must be a str, torch.dtype or Format, got {type(name).__name__}")
    key = name.strip().lower()
    if key in _REGISTRY:
        return _REGISTRY[key]
    m = _PATTERN.match(key)
    if m is None:
        raise ValueError(
            f"{arg}: unknown format {name!r}; valid names are {', '.join(format_names())} "
            "or any 'eXmY' spelling such as 'e6m9', 'e4m3fn', 'e5m2fnuz', 'e4m3b11fnuz', "
            "'e3m3finite'"
        )
    e, mb, bias, suffix = int(m[1]), int(m[2]), m[3], m[4]
    special: Special = "ieee"
    signed = True
    if suffix == "fnuz":
        special = "fnuz"
    elif suffix == "fnu":
        special, signed = "fn", False
    elif suffix == "fn":
        special = "fn"
    elif suffix == "finite":
        special = "finite"
    f = Format(e, mb, None if bias is None else int(bias), special, signed)
    for g in _REGISTRY.values():  # reuse the canonical name of a built-in twin
        if g == f:
            return g
    return f
