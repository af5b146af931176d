"""JSON-ready dicts of technique configs, written from the dataclass fields, not by hand.

:func:`encode` turns a frozen config dataclass into plain JSON values: each field by
``dataclasses.fields``; a nested dataclass becomes a dict tagged ``"__class__":
"module:QualName"``; tuples and lists become lists; a ``torch.dtype`` becomes
``{"__dtype__": "float32"}``. :func:`decode` rebuilds the object: lists become tuples (the
configs are frozen, hashable), tagged dicts become their dataclass. Only dataclasses
defined under ``lowprec.`` and frozen (the configs) are rebuilt from a tag: decoding imports
no other module and calls no other class, so a recipe file never runs code. A config whose
fields change keeps round-tripping without a change here.

Example:
    >>> from lowprec.float8 import Float8Config
    >>> r = Float8Config.from_name("rowwise")
    >>> d = encode(r)
    >>> d["input"]["granularity"], d["input"]["__class__"].split(":")[1]
    ('axis', 'CastConfig')
    >>> decode(Float8Config, d) == r
    True
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, TypeVar

import torch

__all__ = ["decode", "encode"]

T = TypeVar("T")
_CLASS = "__class__"
_DTYPE = "__dtype__"


def _value(v: Any, where: str) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return {_DTYPE: str(v).removeprefix("torch.")}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        cls = type(v)
        return {_CLASS: f"{cls.__module__}:{cls.__qualname__}", **_fields(v, where)}
    if isinstance(v, (tuple, list)):
        return [_value(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _value(x, f"{where}.{k}") for k, x in v.items()}
    raise TypeError(f"{where}: cannot serialise a {type(v).__name__} ({v!r})")


def _fields(obj: Any, where: str) -> dict[str, Any]:
    return {
        f.name: _value(getattr(obj, f.name), f"{where}.{f.name}")
        for f in dataclasses.fields(obj)
        if f.init
    }


def encode(config: Any) -> dict[str, Any]:
    """The init fields of dataclass ``config`` as JSON values (see the module docstring)."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"config must be a dataclass instance, got {type(config).__name__}")
    return _fields(config, type(config).__name__)


# Modules that moved: a recipe saved before names the old path (config.json, checkpoints).
_MOVED = {"lowprec.float8.recipe": "lowprec.float8.config"}


def _class(tag: str) -> type:
    module, _, qualname = tag.partition(":")
    dotted = f"{module}.{qualname}".split(".")
    if (
        not module.startswith("lowprec.")
        or not qualname
        or not all(p.isidentifier() for p in dotted)
    ):
        raise ValueError(f"{_CLASS}: only lowprec dataclasses are rebuilt, got {tag!r}")
    module = _MOVED.get(module, module)  # saved before a module moved: its new home
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, type) or not dataclasses.is_dataclass(obj):
        raise ValueError(f"{_CLASS}: {tag!r} names no dataclass")
    if not obj.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise ValueError(f"{_CLASS}: {tag!r} is not a frozen config dataclass")
    return obj


def _unvalue(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_unvalue(x) for x in v)
    if isinstance(v, dict):
        if _DTYPE in v:
            dt = getattr(torch, str(v[_DTYPE]), None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"{_DTYPE}: unknown torch dtype {v[_DTYPE]!r}")
            return dt
        if _CLASS in v:
            rest = {k: x for k, x in v.items() if k != _CLASS}
            return decode(_class(str(v[_CLASS])), rest)
        return {k: _unvalue(x) for k, x in v.items()}
    return v


def decode(cls: type[T], d: dict[str, Any]) -> T:
    """Rebuild ``cls`` from :func:`encode`'s dict; unknown keys raise ``ValueError``."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}: expected a dict, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; valid: {sorted(known)}")
    return cls(**{k: _unvalue(v) for k, v in d.items()})
