"""Unit-scaled embedding lookup and the losses, cross-entropy and mean squared error
(re-exported by :mod:`lowprec.unit.functional`).

Example:
    >>> import torch
    >>> w = torch.randn(10, 4, requires_grad=True)
    >>> embedding(torch.tensor([0, 3, 0]), w, padding_idx=0).sum().backward()
    >>> w.grad[0].abs().sum().item()   # the padding row gets no gradient, as in torch
    0.0
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from lowprec.core.autograd import apply_fn
from lowprec.unit.core import check_float, check_number, scale_bwd, scale_fwd
from lowprec.unit.core import unit_op as _unit_op

__all__ = ["cross_entropy", "embedding", "mse_loss", "unit_loss_computed"]

# Whether a unit-scaled loss was computed since the flag was last cleared. A constant
# stored into a list: a compiled forward replays the store on every call, with no guard
# on a value that changes between calls.
_SEEN = [False]


def unit_loss_computed(clear: bool = False) -> bool:
    """Whether a unit-scaled loss (:func:`cross_entropy`, :func:`mse_loss`, any
    reduction, called directly or through the unit mode) was computed since the flag was
    last cleared; ``clear=True`` clears it (after reading).

    Their backward is the sum's (the mean's ``1/N`` is forward-only), unlike a plain mean
    loss's: data parallelism reduces the two kinds of gradient by different divisors
    (:mod:`lowprec.distributed.unit_reduce` reads this flag at each backward)."""
    seen = _SEEN[0]
    if clear:
        _SEEN[0] = False
    return seen


class _DivFwd(torch.autograd.Function):
    """Forward ``x / d`` (``d`` a tensor); backward passes ``∂L/∂y`` unscaled."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, d: Tensor) -> Tensor:
        return x / d.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g, None


@_unit_op
def cross_entropy(
    logits: Tensor,
    targets: Tensor,
    reduction: str = "mean",
    ignore_index: int = -100,
    weight: Tensor | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross-entropy of ``logits (N, V)`` (or ``(N, V, ...)``) and class ``targets``;
    targets equal to ``ignore_index`` count for nothing, as in ``F.cross_entropy``.

    Forward: the TRUE loss (same value as ``F.cross_entropy``: for ``"mean"`` the sum over
    the ``N_valid`` counted targets divided by ``N_valid``). Backward: each counted row
    gets ``∂logits = (p - onehot)·√V/√(1 + (e-2)/V)`` times the incoming gradient (the
    mean's ``1/N_valid`` is forward-only): for unit-normal logits
    ``E[(p - onehot)²] ≈ 1/V + (e-2)/V²`` per element, so the gradient is unit.

    ``weight`` (one per class) and ``label_smoothing`` mean what they mean in
    ``F.cross_entropy``: the loss is torch's (with ``weight``, ``"mean"`` divides by the
    counted targets' total weight), and each row's gradient is torch's times the same
    unit factor (class weights scale it as they scale the loss: unit for weights near 1;
    smoothing moves the target mass, not the gradient's size).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    check_float("logits", logits)
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.is_floating_point():
        raise TypeError("targets: class-probability targets are not supported; pass class ids")
    if targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer class ids, got dtype {targets.dtype}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if logits.dim() == 0:
        raise ValueError("logits: need (N, V) or (V,) logits, got a 0-dim tensor")
    v = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
    if v == 0:
        raise ValueError(f"logits: need at least one class, got shape {tuple(logits.shape)}")
    if reduction == "mean" and targets.numel() == 0:
        raise ValueError("targets: empty; the mean over no targets is undefined (use 'sum')")
    if weight is not None:
        check_float("weight", weight)
        if weight.shape != (v,):
            raise ValueError(f"weight: need one per class, shape ({v},), got {tuple(weight.shape)}")
    if not 0.0 <= check_number("label_smoothing", label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    s = math.sqrt(v) / math.sqrt(1.0 + (math.e - 2.0) / v)
    _SEEN[0] = True
    total = F.cross_entropy(
        scale_bwd(logits, s),
        targets,
        weight=weight,
        reduction="sum",
        ignore_index=ignore_index,
        label_smoothing=float(label_smoothing),
    )
    if reduction == "sum":
        return total
    mask = targets != ignore_index
    if weight is None:
        counted = mask.sum()
    else:
        counted = (weight.detach()[targets.clamp(0, v - 1)] * mask).sum()
    return cast(Tensor, apply_fn(_DivFwd, total, counted))


@_unit_op
def embedding(
    idx: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """``y = W[idx]`` is unit for a unit-variance ``W``; backward: row ``v`` of ``∂W`` sums
    ``count(v)`` gradients, ``E[count] = B/V`` for ``B`` lookups, so ``∂W`` is scaled by
    ``√(V/B)``. Every argument of ``F.embedding`` means what it means there:

    * ``padding_idx``: that row's gradient stays zero;
    * ``max_norm``/``norm_type``: looked-up rows whose ``norm_type``-norm exceeds
      ``max_norm`` are renormalised in place first (``torch.embedding_renorm_``);
    * ``scale_grad_by_freq``: row ``v``'s gradient is divided by ``count(v)``, a mean of
      ``count(v)`` unit gradients, so the unit scale becomes ``√(B/V)`` instead;
    * ``sparse``: ``∂W`` is a sparse tensor (scaled the same).
    """
    if not isinstance(idx, Tensor):
        raise TypeError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(f"idx: need integer indices, got {idx.dtype}")
    check_float("weight", weight)
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
            raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")
        if not -weight.shape[0] <= padding_idx < weight.shape[0]:
            raise ValueError(
                f"padding_idx must be within num_embeddings ({weight.shape[0]}), got {padding_idx}"
            )
    if max_norm is not None:
        max_norm = check_number("max_norm", max_norm, 0.0, open_low=True)
    norm_type = check_number("norm_type", norm_type, 0.0, open_low=True)
    for name, flag in (("scale_grad_by_freq", scale_grad_by_freq), ("sparse", sparse)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if max_norm is not None:  # in place, before the lookup reads the rows (as torch)
        with torch.no_grad():
            torch.embedding_renorm_(weight.detach(), idx.contiguous(), max_norm, norm_type)
    ratio = weight.shape[0] / max(1, idx.numel())
    w = scale_bwd(weight, math.sqrt(1.0 / ratio if scale_grad_by_freq else ratio))
    return F.embedding(
        idx, w, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse
    )


@_unit_op
def mse_loss(x: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Mean (or sum) squared error: forward the TRUE loss, as ``F.mse_loss``; backward
    ``∂x = 2(x - t)/√8`` and ``∂t = -2(x - t)/√8`` times the incoming gradient (the mean's
    ``1/N`` is forward-only): for unit, independent ``x`` and ``t``,
    ``Var 2(x - t) = 8``, so both gradients are unit."""
    check_float("x", x)
    check_float("target", target)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if x.shape != target.shape:
        raise ValueError(
            f"x, target: shapes must be equal, got {tuple(x.shape)} and {tuple(target.shape)}"
        )
    s = 8**-0.5
    _SEEN[0] = True
    total = F.mse_loss(scale_bwd(x, s), scale_bwd(target, s), reduction="sum")
    return total if reduction == "sum" else scale_fwd(total, 1.0 / max(1, x.numel()))
