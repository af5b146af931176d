"""The HF ``Trainer`` adapter's set-up pieces (:mod:`lowprec.integrations.transformers`):
the optimizer the ``Trainer`` would build, as a factory for :func:`lowprec.recipes.prepare`;
a scalify'd model's ``config`` while the ``Trainer`` is built; and
the callback through which :class:`~lowprec.integrations.transformers.LowprecTrainer`
hooks into the ``Trainer``'s loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from lowprec.recipes import OptimizerFactory
from lowprec.scalify.transform import Scalified

if TYPE_CHECKING:
    from lowprec.integrations.transformers import LowprecTrainer

__all__ = ["LowprecCallback", "hf_config_view", "optimizer_factory"]


class LowprecCallback(TrainerCallback):  # type: ignore[misc]
    """The :class:`LowprecTrainer`'s hooks into the ``Trainer``'s loop."""

    def __init__(self, trainer: LowprecTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._open_recorder(state.global_step, state.max_steps)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A skipped step leaves the optimizer's per-step state (the masters' copied
        # gradients) behind; the Trainer zeroes only the model's gradients.
        self.trainer.lowprec.optimizer.zero_grad(set_to_none=True)
        # the rate this step used: the scheduler steps after this callback
        self.trainer._step_lr = self.trainer._get_learning_rate()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._end_step(state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._close_recorder()


@contextlib.contextmanager
def hf_config_view(model: nn.Module) -> Iterator[None]:
    """While the ``Trainer`` is built: a scalify'd model's ``config`` (its frozen
    :class:`~lowprec.scalify.ScalifyConfig`, which the ``Trainer`` would take for an HF
    config and set ``use_cache`` on) reads as the wrapped HF model's config (or ``None``)."""
    if not isinstance(model, Scalified):
        yield
        return
    own = model.__dict__["config"]
    model.__dict__["config"] = getattr(model.module, "config", None)
    try:
        yield
    finally:
        model.__dict__["config"] = own


def optimizer_factory(
    args: TrainingArguments,
    model: nn.Module,
    cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None,
) -> OptimizerFactory:
    """The optimizer the ``Trainer`` would build (``args.optim`` or ``cls_and_kwargs``), as
    a factory over the parameters that :func:`~lowprec.recipes.prepare` gives it."""
    if cls_and_kwargs is None:
        hf_model: Any = model
        cls_and_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, hf_model)
    cls, kwargs = cls_and_kwargs
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"the optimizer (args.optim={args.optim!r}) must be a torch.optim.Optimizer class "
            f"that takes parameter groups, got {cls!r}"
        )
    if any(k in kwargs for k in ("params", "model", "optimizer_dict")):
        raise ValueError(f"args.optim={args.optim!r}: builds its own parameter list; not supported")
    kw = dict(kwargs)

    def factory(params: list[Any]) -> torch.optim.Optimizer:
        return cls(params, **kw)

    return factory
