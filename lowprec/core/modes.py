"""Torch function modes under ``torch.compile``: never a compiled frame of their own.

lowprec converts ops at run time with ``TorchFunctionMode`` subclasses (the unit mode, the
CPU FP16/BF16 matmul mode, the MoE router modes). When ``torch.compile`` traces a frame,
Dynamo inlines the active mode's ``__torch_function__`` into the graph; that is intended.
But where a mode's ``__torch_function__`` is entered from code that runs eagerly inside a
compiled call (a frame Dynamo skipped, e.g. after a graph break inside a loop over
layers, or an op that a graph break left to run eagerly), Dynamo compiles
``__torch_function__`` as a frame of its own. For a tensor property (``x.shape``,
``x.device``, ``x.dtype``: ``func`` is a fresh ``method-wrapper`` each time) torch 2.13
installs no guard on ``func`` for that frame, so every later property read of a like
tensor returns the first one's value (``x.shape`` gives ``x.device``): a user's model
fails with a ``TypeError`` far from the cause, or computes with wrong values.

:func:`eager_frames` marks a mode class's ``__torch_function__`` so that Dynamo never
compiles it as a frame of its own (its code object is skipped by Dynamo's frame hook;
Python functions it calls are still compiled, and Dynamo still inlines it when tracing a
caller's frame). ``tests/core/test_modes.py`` reproduces the failure with a pass-through
mode.
"""

from __future__ import annotations

from typing import TypeVar

from torch import Tensor, nn
from torch._dynamo import eval_frame
from torch.nn import Parameter
from torch.overrides import TorchFunctionMode

__all__ = ["checkpointed_layer", "eager_frames", "is_plain"]

M = TypeVar("M", bound=type[TorchFunctionMode])


def eager_frames(cls: M) -> M:
    """Class decorator for a ``TorchFunctionMode`` subclass: its ``__torch_function__``
    runs eagerly whenever it is entered as a frame (module doc), and is inlined as before
    where Dynamo traces a caller. Returns ``cls``; ``TypeError`` for a class that is not
    a ``TorchFunctionMode`` subclass or that does not define ``__torch_function__``."""
    if not (isinstance(cls, type) and issubclass(cls, TorchFunctionMode)):
        raise TypeError(f"cls must be a TorchFunctionMode subclass, got {cls!r}")
    fn = cls.__dict__.get("__torch_function__")
    if fn is None:
        raise TypeError(f"cls: {cls.__name__} does not define __torch_function__")
    skip = getattr(eval_frame, "skip_code", None)
    if skip is not None:  # (torch without it: nothing to mark)
        skip(getattr(fn, "__func__", fn).__code__)
    return cls


_PLAIN = (Tensor, Parameter)


def is_plain(t: object) -> bool:
    """Whether ``t`` is a plain ``torch.Tensor`` or ``nn.Parameter``: not a tensor subclass
    (``ScaledTensor``, ``DTensor``, a float8 wrapper), whose own ``__torch_function__`` or
    ``__torch_dispatch__`` rules a mode must leave to it."""
    return type(t) in _PLAIN


def checkpointed_layer(model: nn.Module) -> str | None:
    """The name of the first module of ``model`` with HF's activation checkpointing on
    (``gradient_checkpointing_enable()`` marks the layers it recomputes with
    ``gradient_checkpointing = True``; ``"<root>"`` for ``model`` itself), else ``None``.
    Such a layer's forward runs again in backward, outside the torch function modes the
    forward was called in (``torch.utils.checkpoint`` restores autocast and the RNG, not
    modes): its recomputed ops are not the converted ones."""
    for name, m in model.named_modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            return name or "<root>"
    return None
