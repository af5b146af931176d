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

With ``skip_nonfinite=True`` a step whose loss or any gradient is Inf/NaN changes nothing
but the loss scaler's record: the update is not applied (whatever the scaler; a
:class:`~lowprec.amp.NoLossScaler` would apply it), and the model's buffers (float8 amax
histories and calibration maxima, any running statistics) are restored to their values
before the step, also when the loss scaler itself skipped; a :class:`~lowprec.recipes.Prepared`
whose static float8 scales calibrate does not count the step as a calibration batch
(:meth:`~lowprec.recipes.Prepared.restore_calibration`). The scaler records the step as
skipped, so a dynamic scale backs off as after any overflow. ``StepResult.nonfinite`` says
what was not finite. A backward that raises on a non-finite loss (scalify refuses
non-finite scales) counts as such a step.

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

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lowprec import _faults
from lowprec.amp import LossScaler, NoLossScaler
from lowprec.analysis.stats import grad_stats as _grad_stats
from lowprec.core.scales import ScaleOverflowError
from lowprec.core.tensor import ScaledTensor

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
    when asked for (divide ``grad_norm`` by ``loss_scale`` for the true norm);
    ``nonfinite`` (with ``skip_nonfinite``): ``"loss"``, ``"gradients"``, ``"loss and
    gradients"`` or ``None``, what was Inf/NaN."""

    loss: Tensor
    loss_scale: float
    skipped: bool
    grad_stats: dict[str, float] | None = None
    nonfinite: str | None = None


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
    skip_nonfinite: bool = False,
) -> StepResult:
    """One training step of ``run`` on the batch ``(x, y)`` (see the module docstring).

    ``lr``: the global learning rate of this step (``None`` leaves the groups' rates as
    they are). ``compute`` replaces ``run.compute`` as the forward/backward context.
    ``grad_stats``: also measure the gradients before the update. ``skip_nonfinite``: a
    step with an Inf/NaN loss or gradient changes no weight, optimizer or scaling state
    (see the module docstring).

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
    saved = [b.detach().clone() for b in run.model.buffers()] if skip_nonfinite else None
    snapshot = getattr(run, "calibration_state", None)  # a Prepared's static float8
    calibration = snapshot() if skip_nonfinite and snapshot is not None else None
    failed: str | None = None  # what a failed forward or backward made non-finite
    with (compute or run.compute)():
        try:
            _, loss = run.model(x, y)
        except ScaleOverflowError:  # values beyond float32 (scalify): FP32 overflows too
            if not skip_nonfinite:
                raise
            loss, failed = torch.full((), float("nan"), device=x.device), "loss and gradients"
        if loss is None:
            raise ValueError("run.model(x, y) returned no loss")
        _faults.point("forward")
        try:
            if failed is None:
                run.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
        except ScaleOverflowError:
            if not skip_nonfinite:
                raise
            failed = "gradients" if bool(_all_finite(loss)) else "loss and gradients"
        except (ValueError, RuntimeError, ArithmeticError):
            # A backward that fails on a NaN/Inf loss is a non-finite step; any other
            # failure is raised.
            if not skip_nonfinite or bool(_all_finite(loss)):
                raise
            failed = "loss and gradients"
    scale = run.scaler.loss_scale
    stats = _grad_stats(run.model.parameters()) if grad_stats else None
    bad = (
        _nonfinite(loss, run.model.parameters(), _data_parallel(run.model))
        if skip_nonfinite
        else None
    )
    if failed is not None:
        bad = failed
    _faults.point("backward")
    if bad is None:
        run.scaler.step(run.optimizer)
    else:  # as the scaler's own skip (with its cross-rank found-inf all-reduce)
        run.scaler.skip(run.optimizer)
    _faults.point("scaler")
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    skipped = run.scaler.history[-1].skipped
    if skipped and saved is not None:
        with torch.no_grad():
            for b, old in zip(run.model.buffers(), saved, strict=True):
                b.copy_(old)
        if calibration is not None:  # the batch is no calibration batch either
            run.restore_calibration(calibration)  # type: ignore[attr-defined]
    return StepResult(loss, scale, skipped, stats, bad)


def _all_finite(t: Tensor) -> Tensor:
    if isinstance(t, DTensor):  # a sharded gradient (FSDP2): this rank's shard
        t = t.to_local()
    if isinstance(t, ScaledTensor):  # a scalify gradient: its payload and its scale
        return torch.isfinite(t.qdata).all() & torch.isfinite(t.scale).all()
    return torch.isfinite(t.detach()).all()


def _nonfinite(loss: Tensor, params: Any, distributed: bool = False) -> str | None:
    """What of ``loss`` and the parameters' gradients holds Inf/NaN (one synchronisation).
    Under data parallelism (``distributed``) the answer is every rank's: a NaN on one rank
    is a NaN on all, so that all skip the same steps (one all-reduce of two flags)."""
    params = list(params)
    ok_loss = _all_finite(loss)
    grads = [_all_finite(p.grad).to(ok_loss.device) for p in params if p.grad is not None]
    ok_grads = torch.stack(grads).all() if grads else torch.ones_like(ok_loss)
    flags = torch.stack([ok_loss, ok_grads]).int()
    if distributed:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
    ok = flags.tolist()
    what = [name for name, bad in (("loss", not ok[0]), ("gradients", not ok[1])) if bad]
    return " and ".join(what) or None


def _data_parallel(model: nn.Module) -> bool:
    """Whether ``model`` trains data-parallel over a process group (DDP, or FSDP2's
    sharded parameters), so that every rank must agree on a skipped step."""
    if isinstance(model, DistributedDataParallel):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())
