"""Named presets: one registry type for recipes, float8 configs and scalify configs/policies.

A :class:`Registry` maps a name to a factory of keyword arguments (a preset), so a preset is
data, never a subclass. ``get(name, **overrides)`` builds the object; an unknown name raises
``ValueError`` listing the valid ones.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Cfg:
    ...     fmt: str = "fp16"
    ...     margin: int = 0
    >>> presets = Registry("demo preset", Cfg)
    >>> presets.add("fp8", fmt="e4m3fn")
    >>> presets.get("fp8", margin=1)
    Cfg(fmt='e4m3fn', margin=1)
    >>> presets.get("fp4")
    Traceback (most recent call last):
    ...
    ValueError: unknown demo preset 'fp4'; valid: fp8
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Presets of ``build(**kwargs)`` by name, in insertion order.

    Args:
        what: how errors name an entry, e.g. ``"recipe"`` or ``"float8 preset"``.
        build: called with a preset's keyword arguments (plus overrides) to make the object.
    """

    def __init__(self, what: str, build: Callable[..., T]) -> None:
        self.what = what
        self._build = build
        self._presets: dict[str, tuple[dict[str, Any], str]] = {}

    def add(self, name: str, *, description: str = "", **kwargs: Any) -> None:
        """Register ``name`` as ``build(**kwargs)``. ``ValueError`` if the name is taken."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} name must be a non-empty string, got {name!r}")
        if name in self._presets:
            raise ValueError(f"a {self.what} named {name!r} is already registered")
        self._presets[name] = (dict(kwargs), description)

    def kwargs(self, name: str) -> dict[str, Any]:
        """A copy of the keyword arguments of preset ``name``."""
        return dict(self._entry(name)[0])

    def description(self, name: str) -> str:
        return self._entry(name)[1]

    def get(self, name: str, **overrides: Any) -> T:
        """Build preset ``name``, with ``overrides`` replacing its keyword arguments."""
        return self._build(**{**self._entry(name)[0], **overrides})

    def names(self) -> list[str]:
        return list(self._presets)

    def __contains__(self, name: object) -> bool:
        return name in self._presets

    def __iter__(self) -> Iterator[str]:
        return iter(self._presets)

    def _entry(self, name: str) -> tuple[dict[str, Any], str]:
        if not isinstance(name, str):
            raise TypeError(f"{self.what} name must be a string, got {type(name).__name__}")
        if name not in self._presets:
            raise ValueError(f"unknown {self.what} {name!r}; valid: {', '.join(self._presets)}")
        return self._presets[name]
