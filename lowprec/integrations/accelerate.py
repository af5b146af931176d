"""lowprec under HF Accelerate: :func:`prepare` a model and optimizer with a recipe, then
``accelerator.prepare`` them, in one call.

Accelerate's own FP8 support is a fixed set of backends (torchao, Transformer Engine,
MS-AMP) chosen by ``mixed_precision="fp8"`` and configured with ``AORecipeKwargs(config,
module_filter_func)``, which converts the model before DDP/FSDP wraps it. :func:`prepare`
does the same with any lowprec recipe, with a ``module_filter`` of the same form::

    accelerator = Accelerator()                      # mixed_precision="no": the recipe decides
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, lp = prepare(accelerator, model, optimizer, "fp8-tensorwise",
                                   module_filter=lambda m, fqn: "lm_head" not in fqn)
    for batch in loader:
        with lp.compute():                           # autocast, CPU matmuls, calibration
            loss = model(**batch).loss
            accelerator.backward(loss)               # the recipe's loss scale
        lp.scaler.unscale_(lp.optimizer)             # only to clip or measure gradients
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()                             # skipped on Inf/NaN gradients
        optimizer.zero_grad()

What happens: the model is moved to ``accelerator.device`` and converted by
:func:`lowprec.recipes.prepare`, which builds the optimizer (the class and defaults of the
one given, or a factory) with the recipe's FP32 masters, lean states or u-μP groups; the
recipe's loss scaler becomes ``accelerator.scaler`` (it has ``GradScaler``'s API), so that
``accelerator.backward`` scales the loss and the prepared optimizer's ``step`` unscales,
skips on Inf/NaN and updates the scale; ``accelerator.save_state`` / ``load_state`` save
and restore the scaler (``scaler.pt``) with the model and optimizer, and the part of the
recipe's state they do not hold (buffers such as amax histories, static-scale calibration,
the recipe, checked on load) is registered with ``accelerator.register_for_checkpointing``.

Gradient accumulation (``Accelerator(gradient_accumulation_steps=k)``, ``with
accelerator.accumulate(model)``): ``accelerator.backward`` divides each micro-batch's loss
by ``k``; for a unit recipe the adapter's ``accelerator.backward`` also scales the backward
by ``√k`` (:func:`~lowprec.integrations.common.unit_accumulated`), so the step's gradient
is the unit gradient of one batch of all ``k`` micro-batches' rows, as the HF ``Trainer``
and Lightning adapters give: the user divides the loss by nothing.

Several processes (``accelerate launch``, DDP): the float8 scaling state is reduced over
the ranks after each backward, so every rank casts with the same scales (a unit recipe's
gradients are averaged by Accelerate's DDP: a WARNING says so).

Refused: an Accelerator with ``mixed_precision`` other than ``"no"`` (its autocast or
GradScaler would sit on top of the recipe's), and DeepSpeed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lowprec.integrations.common import (
    ModuleFilter,
    factory_of,
    load_lowprec_state,
    lowprec_state,
    unit_accumulated,
    with_module_filter,
)
from lowprec.recipes import OptimizerFactory, Prepared, Recipe
from lowprec.recipes import prepare as prepare_recipe

__all__ = ["LowprecCheckpoint", "prepare"]

logger = logging.getLogger(__name__)


def _data_parallel(prepared: Prepared) -> None:
    """Several processes (``accelerate launch``): every rank uses the same float8 scales
    (the scaling state reduced with MAX after each backward, as ``lowprec.distributed``
    does); a unit recipe's gradients are averaged by Accelerate's DDP, not summed and
    divided by the unit divisor of :func:`lowprec.distributed.prepare` (``sqrt(N)`` after
    lowprec's unit losses, ``N^{3/2}`` after a mean loss of the user's own:
    :mod:`lowprec.distributed.unit_reduce`; logged once). Unit MoE experts scale their
    weight gradients by the token counts of all ranks
    (:func:`lowprec.unit.moe.share_token_counts`), so each is off by that same factor."""
    from lowprec.distributed import attach_scaling_sync

    if prepared.recipe.float8 is not None:
        attach_scaling_sync(prepared.model)
    if prepared.recipe.unit is not None:
        from lowprec.unit.moe import share_token_counts

        share_token_counts(prepared.model)  # unit experts: every rank's token counts
        logger.warning(
            "lowprec.integrations.accelerate: unit recipe %r under DDP: Accelerate averages "
            "the gradients (1/N), not the divisor that keeps unit scaling's one-process "
            "gradient (sqrt(N) after a unit loss, N^1.5 after a mean loss of your own): "
            "off by sqrt(N) either way; Adam hides the factor, SGD does not "
            "(lowprec.distributed.prepare and make_trainer choose the divisor)",
            prepared.recipe.name,
        )


def _unit_backward(accelerator: Any, recipe: Recipe) -> None:
    """``accelerator.backward`` for a unit recipe: the loss's backward also scaled by
    ``√k``, ``k`` the Accelerator's ``gradient_accumulation_steps`` at each call
    (:func:`~lowprec.integrations.common.unit_accumulated`). ``accelerator.backward``
    divides every micro-batch's loss by ``k``, right for a mean loss; a unit weight
    gradient carries ``b^-1/2`` of its own backward's ``b`` tokens, so the ``k``
    micro-batches sum to ``√k`` times one batch of ``k·b`` tokens and the step's
    gradient was ``1/√k`` of that batch's unit gradient (``1/(k·√k)`` for users who also
    divided by ``√k`` as the docs said). ``k`` = 1: unchanged."""
    backward = accelerator.backward

    @functools.wraps(backward)
    def unit_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        k = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
        return backward(unit_accumulated(loss, recipe, k), **kwargs)

    accelerator.backward = unit_backward


class LowprecCheckpoint:
    """The recipe state that ``accelerator.save_state`` does not hold otherwise
    (:func:`~lowprec.integrations.common.lowprec_state`), as an object for
    ``accelerator.register_for_checkpointing``."""

    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared

    def state_dict(self) -> dict[str, Any]:
        return lowprec_state(self.prepared)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_lowprec_state(self.prepared, state)


def prepare(
    accelerator: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory | None,
    recipe: str | Recipe,
    *,
    module_filter: ModuleFilter | None = None,
    param_groups: Callable[[nn.Module, list[Any]], list[Any]] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[nn.Module, Any, Prepared]:
    """``model`` and ``optimizer`` converted by ``recipe`` and prepared by ``accelerator``:
    ``(model, optimizer, prepared)``, the first two as ``accelerator.prepare`` returns them
    (DDP/FSDP-wrapped model, ``AcceleratedOptimizer``), ``prepared`` the
    :class:`~lowprec.recipes.Prepared` (``compute()``, ``scaler``, the unwrapped
    ``model`` and ``optimizer``).

    ``optimizer``: a fresh optimizer over ``model``'s trainable parameters (all of them),
    with one group (its class and defaults are rebuilt over the converted parameters,
    :func:`~lowprec.integrations.common.factory_of`), an optimizer factory
    ``params -> Optimizer``, or ``None`` (AdamW, lr 1e-3). ``module_filter(module, fqn)``:
    the linears a float8 recipe converts (as ``AORecipeKwargs(module_filter_func=...)``).
    ``param_groups`` and ``generator``: as for :func:`lowprec.recipes.prepare`.
    """
    if not (hasattr(accelerator, "prepare") and hasattr(accelerator, "backward")):
        raise TypeError(
            f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp != "no":
        raise ValueError(
            f"accelerator: mixed_precision={mp!r} adds Accelerate's own autocast/GradScaler/FP8 "
            "on top of the recipe; create the Accelerator with mixed_precision='no'"
        )
    if getattr(accelerator, "scaler", None) is not None:
        raise ValueError("accelerator: it has a gradient scaler already; the recipe brings its own")
    if "DEEPSPEED" in str(getattr(accelerator, "distributed_type", "")):
        raise ValueError("accelerator: DeepSpeed is not supported with lowprec recipes")
    if optimizer is None:
        factory: OptimizerFactory | None = None
    elif isinstance(optimizer, torch.optim.Optimizer):
        factory = factory_of(optimizer, model)
    elif callable(optimizer):
        factory = optimizer
    else:
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a factory params -> Optimizer or None, "
            f"got {type(optimizer).__name__}"
        )
    r = with_module_filter(recipe, model, module_filter)
    model.to(accelerator.device)  # the FP32 masters are made where the parameters are
    prepared = prepare_recipe(model, r, factory, generator, param_groups=param_groups)
    if int(getattr(accelerator, "num_processes", 1)) > 1:
        _data_parallel(prepared)
    accelerator.scaler = prepared.scaler
    if prepared.recipe.unit is not None:
        _unit_backward(accelerator, prepared.recipe)
    wrapped_model, wrapped_optimizer = accelerator.prepare(prepared.model, prepared.optimizer)
    accelerator.register_for_checkpointing(LowprecCheckpoint(prepared))
    return wrapped_model, wrapped_optimizer, prepared
