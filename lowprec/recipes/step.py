"""The one training step: every loop in lowprec (``lowprec train``, the demo, the benchmarks)
runs :func:`train_step`.

One step of a model ``model(x, y) -> (logits, loss)``:

1. with ``lr`` given, every parameter group gets ``group["lr"] = lr · group["lr_mult"]``
   (:func:`set_lr`; a group without ``"lr_mult"`` has multiplier 1, so u-μP's per-group
   learning rates follow any schedule of the global one);
2. forward and backward of the scaled loss ``S · loss`` inside the run's compute context;
3. optionally :func:`~lowprec.analysis.stats.grad_stats` of the (still scaled) gradients;
4. ``scaler.step(optimizer)`` (unscale by ``1/S``; skipped if a gradient is Inf/NaN),
   ``scaler.update()``, ``optimizer.zero_grad(set_to_none=True)``.

A run is anything with ``model``, ``optimizer``, ``scaler`` and a ``compute()`` context:
a :class:`~lowprec.recipes.Prepared`, or :class:`Plain` for a bare model and optimizer
(no loss scaling, no compute context).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor, nn

from lowprec.amp import LossScaler, NoLossScaler
from lowprec.analysis.stats import grad_stats as _grad_stats

__all__ = ["Plain", "Run", "StepResult", "set_lr", "train_step"]


class Run(Protocol):
    """What :func:`train_step` needs (a :class:`~lowprec.recipes.Prepared` is one)."""

    model: nn.Module
    optimizer: Any
    scaler: LossScaler

    def compute(self) -> AbstractContextManager[None]: ...


@dataclass
class Plain:
    """A bare model and optimizer as a :class:`Run`: no loss scaling (``NoLossScaler``:
    the update is always applied) and an empty compute context."""

    model: nn.Module
    optimizer: Any
    scaler: LossScaler = field(default_factory=NoLossScaler)

    def compute(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class StepResult:
    """What one step did. ``loss`` is the unscaled loss with its autograd graph (detach it
    to keep it); ``loss_scale`` the scale ``S`` used; ``skipped`` whether the update was
    skipped (Inf/NaN gradients); ``grad_stats`` the statistics of the scaled gradients
    when asked for (divide ``grad_norm`` by ``loss_scale`` for the true norm)."""

    loss: Tensor
    loss_scale: float
    skipped: bool
    grad_stats: dict[str, float] | None = None


def set_lr(optimizer: Any, lr: float) -> None:
    """Set every parameter group's learning rate to ``lr · group.get("lr_mult", 1.0)``.

    Example:
        >>> import torch
        >>> p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        >>> opt = torch.optim.SGD([{"params": [p]}, {"params": [q], "lr_mult": 0.25}], lr=1.0)
        >>> set_lr(opt, 0.5)
        >>> [g["lr"] for g in opt.param_groups]
        [0.5, 0.125]
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise TypeError(f"lr must be a number, got {type(lr).__name__}")
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def train_step(
    run: Run,
    x: Tensor,
    y: Tensor,
    lr: float | None = None,
    *,
    compute: Callable[[], AbstractContextManager[None]] | None = None,
    grad_stats: bool = False,
) -> StepResult:
    """One training step of ``run`` on the batch ``(x, y)`` (see the module docstring).

    ``lr``: the global learning rate of this step (``None`` leaves the groups' rates as
    they are). ``compute`` replaces ``run.compute`` as the forward/backward context.
    ``grad_stats``: also measure the gradients before the update.

    Example:
        >>> import torch
        >>> class M(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.w = nn.Parameter(torch.ones(()))
        ...     def forward(self, x, y):
        ...         return None, ((self.w * x - y) ** 2).mean()
        >>> m = M()
        >>> r = train_step(Plain(m, torch.optim.SGD(m.parameters(), lr=0.0)), torch.ones(2),
        ...                torch.zeros(2), lr=0.25)
        >>> float(r.loss), float(m.w), r.skipped  # w - 0.25 · d/dw (w - 0)² = 1 - 0.25 · 2
        (1.0, 0.5, False)
    """
    if lr is not None:
        set_lr(run.optimizer, lr)
    with (compute or run.compute)():
        _, loss = run.model(x, y)
        if loss is None:
            raise ValueError("run.model(x, y) returned no loss")
        run.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
    scale = run.scaler.loss_scale
    stats = _grad_stats(run.model.parameters()) if grad_stats else None
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, scale, run.scaler.history[-1].skipped, stats)
