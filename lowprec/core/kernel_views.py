"""Tensor layouts for the compiled kernels of :mod:`lowprec.core.kernels`.

A kernel runs on a dense view of its input with the dims in storage order, reshaped so
that a block-wise scale broadcasts plainly (a block's elements stay in the innermost loop,
which inductor vectorises), and hands back its result laid out as the eager ops would lay
theirs out. Imports from :mod:`lowprec.core.rounding` are local: that module imports the
kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowprec.core.granularity import _block_views

__all__ = ["block_pair", "groups", "in_scale_shape", "pattern", "unview"]


def block_pair(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor] | None:
    """``x`` with its dims in storage order (:func:`~lowprec.core.rounding.dense_view`;
    ``scale``, of ``x``'s rank or less, permuted alike) and both reshaped so that the
    block-wise broadcast of :func:`~lowprec.core.granularity.apply_scale` is a plain
    broadcast, or ``None`` if ``x`` is not dense. (A kernel on these views keeps a block's
    elements in its innermost loop, which inductor vectorises; indexing the scale by
    ``i // block`` there would not be.)"""
    from lowprec.core.rounding import dense_view, storage_order

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
    from lowprec.core.rounding import dense_view, from_dense_view

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
    from lowprec.core.rounding import dense_view, from_dense_view, storage_order

    if dense_view(x) is x:
        return s.reshape(shape)
    full = (1,) * (x.dim() - len(shape)) + tuple(shape)  # the scale at x's rank
    permuted = [full[i] for i in storage_order(x)]
    return from_dense_view(s.reshape(permuted), x).contiguous().reshape(shape)
