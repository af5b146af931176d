"""Unit recipes under data parallelism: the divisor that gives the one-process gradient.

A unit-scaled weight's gradient is its per-row contributions summed over the ``b`` rows
of the batch and scaled by ``b^-1/2``; on ``N`` ranks each rank has ``b/N`` rows. What
each row contributes depends on the loss:

* lowprec's unit losses (:func:`lowprec.unit.functional.cross_entropy`, ``mse_loss``,
  also when the unit mode converts a model's own ``F.cross_entropy`` in ``forward``)
  back-propagate the *sum*'s gradient (their mean's ``1/b`` is forward-only): each rank's
  gradient is ``(b/N)^-1/2 Σ_rank``, and the one-process ``b^-1/2 Σ`` is the ranks' sum
  divided by ``√N``;
* any other loss (the user's ``F.cross_entropy(model(x), y)`` outside the model) is taken
  to be a mean over the rank's rows, as DDP assumes of every loss: each row carries
  ``N/b`` where one process gives it ``1/b``, so each rank's gradient is
  ``N^{3/2}·b^{-3/2} Σ_rank`` and the one-process gradient is the sum divided by
  ``N^{3/2}``.

:class:`UnitDivisor` chooses at each backward, from which of the prepared module's outputs
the gradient arrives. The module's forward hook passes its outputs through one autograd
node (:class:`_Tap`) and records whether a unit loss was computed in the forward; the
node's backward sees every output's gradient at once, before any of the module's
parameters gets one:

* the gradient reaches only a loss output (a 0-dim output of a forward that computed a
  unit loss, e.g. HF's ``loss`` or CharGPT's): ``√N``;
* it reaches only other outputs (logits): a loss outside the model, ``N^{3/2}`` (a mean),
  or ``√N`` if a unit loss was computed after the forward (the user's
  ``lowprec.unit.functional.cross_entropy(model(x), y)``);
* both (the model's unit loss plus a mean loss of the user's on its logits, e.g. an
  auxiliary term): ``√N``, and the gradient through the other outputs is divided by
  ``N`` on its way in, so that the mean loss's part of the sum is its one-process part
  too (before, one divisor served both: the mean term's gradient came out N times too
  large; a unit loss computed in the forward and left unused made every gradient N
  times too large).

A unit loss *and* a mean loss both computed outside the model cannot be told apart at
the model's outputs: divide the mean one by ``N`` yourself. (A loss of the user's own
that sums over rows gets the mean's divisor, as under plain DDP.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lowprec.core.autograd import apply_fn
from lowprec.unit import unit_loss_computed

__all__ = ["UnitDivisor"]


class UnitDivisor:
    """The divisor of the ranks' gradient sum for a unit recipe on ``world`` ranks
    (module docstring), handed to ``apply`` at each backward of the module it is attached
    to (:meth:`attach`); :attr:`factor` is the last one chosen (``√world`` before any),
    :attr:`unit_loss` whether that backward came from a unit loss (only, or with
    another: :attr:`mixed`)."""

    def __init__(self, world: int, apply: Callable[[float], None]) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        self.world, self.apply = world, apply
        self.factor = math.sqrt(world)
        self.unit_loss = True
        self.mixed = False

    def attach(self, module: nn.Module) -> None:
        """Choose at each backward of ``module``'s outputs (forward hooks on ``module``,
        run eagerly under ``torch.compile``)."""
        module.register_forward_pre_hook(self._begin)
        module.register_forward_hook(self._end)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _begin(self, module: nn.Module, args: Any) -> None:
        unit_loss_computed(clear=True)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _end(self, module: nn.Module, args: Any, output: Any) -> Any:
        inner = unit_loss_computed(clear=True)  # a unit loss in the forward; cleared for after
        leaves, spec = tree_flatten(output)
        idx = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
        if not idx or not torch.is_grad_enabled():
            return None
        loss = tuple(inner and leaves[i].dim() == 0 for i in idx)
        tapped = apply_fn(_Tap, self, loss, *(leaves[i] for i in idx))
        for i, t in zip(idx, tapped, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _choose(self, loss_used: bool, other_used: bool) -> float:
        """Set the divisor for this backward; the factor for the other outputs' gradient."""
        outside_unit = unit_loss_computed()  # a unit loss on the outputs, after the forward
        self.mixed = loss_used and other_used and not outside_unit
        self.unit_loss = loss_used or outside_unit
        self.factor = math.sqrt(self.world) if self.unit_loss else self.world**1.5
        self.apply(self.factor)
        return 1.0 / self.world if self.mixed else 1.0


class _Tap(torch.autograd.Function):
    """Identity on the module's outputs; its backward sees every output's gradient at
    once, chooses the divisor (:meth:`UnitDivisor._choose`) and scales the gradient of
    the outputs that are not the model's unit loss when both kinds arrive."""

    @staticmethod
    def forward(ctx: Any, div: UnitDivisor, loss: tuple[bool, ...], *outs: Tensor) -> Any:
        ctx.div, ctx.loss = div, loss
        ctx.set_materialize_grads(False)
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        loss_used = any(g is not None for g, k in zip(grads, ctx.loss, strict=True) if k)
        other_used = any(g is not None for g, k in zip(grads, ctx.loss, strict=True) if not k)
        f = ctx.div._choose(loss_used, other_used)
        out = [g if (g is None or k or f == 1.0) else g * f
               for g, k in zip(grads, ctx.loss, strict=True)]  # fmt: skip
        return (None, None, *out)
