"""What a converted layer takes over from the module it replaces: its hooks, and whatever
else it holds (child modules, other parameters and buffers)."""

from __future__ import annotations

from torch import nn

__all__: list[str] = []


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """The replacement runs the hooks registered on the replaced module (the same dicts,
    so their handles still remove them)."""
    for name in _HOOK_DICTS:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))


def _carry_extras(old: nn.Module, new: nn.Module, own: set[str]) -> None:
    """``new`` (the replacement of ``old``) keeps what ``old`` holds besides the names in
    ``own``: child modules (a LoRA-style adapter), other parameters and buffers, the same
    objects under the same names (buffer persistence kept), so that an optimizer built
    afterwards and ``state_dict()`` see every one. ``ValueError`` if a name is taken."""
    for kind, src in (("child module", old._modules), ("parameter", old._parameters)):
        for name, v in src.items():
            if name in own:
                continue
            if hasattr(new, name) and name not in new._modules and name not in new._parameters:
                raise ValueError(
                    f"{type(old).__name__}: its {kind} {name!r} clashes with an attribute of "
                    f"{type(new).__name__}; rename it before converting"
                )
            (new._modules if kind == "child module" else new._parameters)[name] = v  # type: ignore[index,assignment]
    for name, b in old._buffers.items():
        if name in own:
            continue
        if hasattr(new, name):
            raise ValueError(
                f"{type(old).__name__}: its buffer {name!r} clashes with an attribute of "
                f"{type(new).__name__}; rename it before converting"
            )
        new._buffers[name] = b
        if name in old._non_persistent_buffers_set:
            new._non_persistent_buffers_set.add(name)
