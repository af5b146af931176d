"""Tensor layouts of the eager fast paths, and the switch that turns those paths off.

Eager CPU kernels read a contiguous tensor several times faster than a strided one, and
inductor vectorises a loop only where a block-wise scale broadcasts plainly. The fast
paths of :mod:`lowprec.core.rounding`, :mod:`lowprec.core.scales` and the compiled
kernels of :mod:`lowprec.core.kernels` therefore work on a *dense view* of their input
(its dims permuted into storage order), reshaped so that a block's elements stay in the
innermost loop, and hand back their result laid out as the eager ops lay out theirs.

:func:`reference_paths` turns every fast path off (each cast then takes the general,
masked path; no dense views, no compiled kernels), so that tests can compare the two bit
for bit; :func:`fast_paths` says whether they are on.

This module imports nothing of lowprec but the granularity grammar's block views.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from lowprec.core.granularity import _block_views

__all__ = [
    "block_pair",
    "dense_view",
    "fast_paths",
    "from_dense_view",
    "groups",
    "in_scale_shape",
    "pattern",
    "reference_paths",
    "storage_order",
    "unview",
]

# ---------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------

# Eager fast paths on (the reference path is the general masked one; tests compare both
# bit for bit through :func:`reference_paths`).
_FAST_EAGER = True


def fast_paths() -> bool:
    """Whether the eager fast paths (range-driven cast shortcuts, dense views, compiled
    kernels) are on: True except inside :func:`reference_paths`."""
    return _FAST_EAGER


@contextlib.contextmanager
def reference_paths() -> Iterator[None]:
    """Within this context the eager shortcuts are off: every cast takes the general path
    (for tests that check the shortcuts bit for bit). Not thread-safe; tests only."""
    global _FAST_EAGER
    old, _FAST_EAGER = _FAST_EAGER, False
    try:
        yield
    finally:
        _FAST_EAGER = old


# ---------------------------------------------------------------------------------------
# Dense views
# ---------------------------------------------------------------------------------------


def dense_view(x: Tensor) -> Tensor:
    """``x`` with its dims permuted into storage order when that makes it contiguous (a
    transposed matrix: its transpose), else ``x``. For reductions whose result does not
    depend on the order of the elements (``amax``, ``aminmax``): CPU kernels read a
    contiguous tensor several times faster than a strided one."""
    if x.dim() < 2 or x.is_contiguous() or not _FAST_EAGER:
        return x
    y = x.permute(storage_order(x))
    return y if y.is_contiguous() else x


def storage_order(x: Tensor) -> list[int]:
    """``x``'s dims from the largest stride to the smallest (ties: in order): the
    permutation :func:`dense_view` applies."""
    return sorted(range(x.dim()), key=lambda d: (-x.stride()[d], d))


def from_dense_view(y: Tensor, x: Tensor) -> Tensor:
    """``y``, computed elementwise on ``dense_view(x)``, permuted back to ``x``'s dims (and
    so to ``x``'s strides, as an eager elementwise op on ``x`` lays out its result)."""
    if y.dim() < 2 or x.is_contiguous() or not _FAST_EAGER:
        return y
    perm = storage_order(x)
    inv = [0] * len(perm)
    for j, p in enumerate(perm):
        inv[p] = j
    return y.permute(inv)


# ---------------------------------------------------------------------------------------
# The compiled kernels' views
# ---------------------------------------------------------------------------------------


def block_pair(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor] | None:
    """``x`` with its dims in storage order (:func:`dense_view`; ``scale``, of ``x``'s rank
    or less, permuted alike) and both reshaped so that the block-wise broadcast of
    :func:`~lowprec.core.granularity.apply_scale` is a plain broadcast, or ``None`` if
    ``x`` is not dense. (A kernel on these views keeps a block's elements in its innermost
    loop, which inductor vectorises; indexing the scale by ``i // block`` there would not
    be.)"""
    d = dense_view(x)
    if not d.is_contiguous():
        return None
    s = scale.reshape((1,) * (x.dim() - scale.dim()) + tuple(scale.shape))
    if d is not x:  # (contiguous: a strided scale makes inductor tile the whole loop)
        s = s.permute(storage_order(x)).contiguous()
    dview, sview, _ = _block_views(tuple(d.shape), tuple(s.shape))
    return d.reshape(dview), s.reshape(sview)


def pattern(x: Tensor, scale: Tensor) -> tuple[object, ...]:
    """How ``scale`` broadcasts over ``x`` (part of a kernel's key, so that each compiled
    function sees a few shape patterns, not an unbounded number)."""
    return tuple((a == 1, a == b) for a, b in zip(scale.shape, x.shape, strict=True))


def unview(out: Tensor, x: Tensor) -> Tensor:
    """A kernel's result on :func:`block_pair`'s view, laid out as an eager elementwise op
    on ``x`` lays out its result."""
    d = dense_view(x)
    out = out.reshape(d.shape)
    return out if d is x else from_dense_view(out, x)


def groups(x: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, tuple[int, ...]] | None:
    """``x`` in :func:`block_pair`'s view for a scale of ``shape``, and the dims of that
    view to reduce for one value per group; ``None`` if ``x`` is not dense."""
    probe = x.new_empty((1,) * (x.dim() - len(shape)) + tuple(shape), dtype=torch.float32)
    pair = block_pair(x, probe)
    if pair is None:
        return None
    view, sview = pair
    return view, tuple(
        i for i, (a, b) in enumerate(zip(view.shape, sview.shape, strict=True)) if a != b
    )


def in_scale_shape(s: Tensor, x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """A per-group result on :func:`groups`' view of ``x``, as a contiguous tensor of the
    scale shape ``shape`` in ``x``'s dims."""
    if dense_view(x) is x:
        return s.reshape(shape)
    full = (1,) * (x.dim() - len(shape)) + tuple(shape)  # the scale at x's rank
    permuted = [full[i] for i in storage_order(x)]
    return from_dense_view(s.reshape(permuted), x).contiguous().reshape(shape)
