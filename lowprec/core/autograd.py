"""Applying lowprec's autograd Functions, eagerly and under ``torch.compile``.

Every custom ``torch.autograd.Function`` of lowprec (the casts, scaled quantization, the
float8 GEMMs and attention, unit scaling's scale ops and fused products, scalify's entry
and exit) is applied through :func:`apply_fn`, never through ``Fn.apply`` directly.

Why: torch 2.13's Dynamo mishandles a Function applied to a tensor that was filled in
place through views of it, e.g. ``k = x.new_empty(...)`` written by ``k[..., :d].copy_(a)``
and ``k[..., d:].copy_(b)`` (how DeepSeek-V3's attention builds its keys). Eagerly ``k``
requires grad from the first ``copy_`` of a tensor that does; Dynamo's record of ``k``
keeps ``requires_grad=False`` from ``new_empty``, so it treats the Function as having no
input that needs a gradient and traces its forward as plain ops: the Function's own
backward is lost, autograd differentiates the forward instead (a straight-through cast's
gradient becomes the rounding's, ``scale_bwd``'s arrives unscaled), or no gradient reaches
the slices' sources, or the compiled call fails. A view of ``k`` (``k.view_as(k)``, no
copy) is recorded afresh with the right ``requires_grad``. Under ``torch.compile``
:func:`apply_fn` passes every plain tensor argument as such a view (not only those that
report ``requires_grad``: that report is the stale one), and passes everything unchanged
otherwise. ``tests/models/test_compiled_functions.py`` applies every lowprec Function to
such a tensor under compile and compares the loss and all gradients with eager's, bit for
bit.

Some Functions cannot be traced at all (inductor fails on their forward, or torch's
fake-tensor rule for an op they call refuses their operands): :func:`apply_outside_graph`
runs them eagerly under ``torch.compile`` (a graph break at the call), their forward and
backward both, each caller stating why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["apply_fn", "apply_outside_graph"]


def _fresh_input(x: Tensor) -> Tensor:
    """``x`` itself, or under ``torch.compile`` a view of it (no copy) when ``x`` is a
    plain tensor (not a subclass such as a Parameter or a ``ScaledTensor``): the form in
    which Dynamo knows whether ``x`` requires grad (module doc)."""
    if torch.compiler.is_compiling() and type(x) is Tensor:
        return x.view_as(x)
    return x


def _check_fn(fn: object) -> None:
    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        raise TypeError(f"fn must be a torch.autograd.Function subclass, got {fn!r}")


@torch.compiler.disable  # type: ignore[untyped-decorator]
def apply_outside_graph(fn: type[torch.autograd.Function], *args: Any) -> Any:
    """``fn.apply(*args)`` run eagerly, forward and backward, also inside a compiled region
    (a graph break at the call; module doc). Call it from the function that decides, not
    through a wrapper of its own: Dynamo would compile such a wrapper's frame on its own,
    once per argument shape. ``TypeError`` when ``fn`` is not an autograd Function class."""
    _check_fn(fn)
    return fn.apply(*args)  # type: ignore[no-untyped-call]


def apply_fn(
    fn: type[torch.autograd.Function], *args: Any, inputs: tuple[int, ...] | None = None
) -> Any:
    """``fn.apply(*args)``, under ``torch.compile`` with the tensor arguments at positions
    ``inputs`` (default: every argument) passed through :func:`_fresh_input`; eagerly it is
    exactly ``fn.apply(*args)``. Give ``inputs`` where other tensor arguments are state
    that the Function updates in place (a delayed scaler's history): a view of such a
    buffer would be saved for the compiled backward. ``TypeError`` when ``fn`` is not an
    autograd Function class or ``inputs`` not a tuple of argument positions."""
    if torch.compiler.is_compiling():  # (Dynamo cannot trace issubclass of a Function)
        args = tuple(
            _fresh_input(a) if isinstance(a, Tensor) and (inputs is None or i in inputs) else a
            for i, a in enumerate(args)
        )
    else:
        _check_fn(fn)
        if inputs is not None and not (
            isinstance(inputs, tuple)
            and all(isinstance(i, int) and 0 <= i < len(args) for i in inputs)
        ):
            raise TypeError(
                f"inputs must be a tuple of argument positions below {len(args)}, got {inputs!r}"
            )
    return fn.apply(*args)  # type: ignore[no-untyped-call]
