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

:class:`UnitDivisor` chooses at each backward: hooks on the prepared module clear
:func:`lowprec.unit.unit_loss_computed` when its forward begins, and when the backward
reaches the module's outputs (before any gradient is reduced) read it and set the
divisor: ``√N`` if a unit loss was computed since, else ``N^{3/2}``. (A loss of the
user's own that sums over rows gets the mean's divisor, as under plain DDP.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lowprec.unit import unit_loss_computed

__all__ = ["UnitDivisor"]


class UnitDivisor:
    """The divisor of the ranks' gradient sum for a unit recipe on ``world`` ranks
    (module docstring), handed to ``apply`` at each backward of the module it is attached
    to (:meth:`attach`); :attr:`factor` is the last one chosen (``√world`` before any)."""

    def __init__(self, world: int, apply: Callable[[float], None]) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        self.world, self.apply = world, apply
        self.factor = math.sqrt(world)
        self.unit_loss = True

    def attach(self, module: nn.Module) -> None:
        """Choose at each backward of ``module``'s outputs (forward hooks on ``module``,
        run eagerly under ``torch.compile``)."""
        module.register_forward_pre_hook(self._begin)
        module.register_forward_hook(self._end)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _begin(self, module: nn.Module, args: Any) -> None:
        unit_loss_computed(clear=True)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        outs = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, self._choose, mode="any")

    def _choose(self, grad: Tensor) -> None:
        self.unit_loss = unit_loss_computed()
        self.factor = math.sqrt(self.world) if self.unit_loss else self.world**1.5
        self.apply(self.factor)
