"""``prepare(model, recipe)``: apply a recipe to a model; ``Prepared``: what a loop needs."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lowprec.amp import (
    LossScaler,
    MasterWeights,
    MatmulInFp32,
    SensitiveInFp32,
    lean_optimizer,
    native_bf16_matmul,
)
from lowprec.core.modes import checkpointed_layer
from lowprec.core.warn import warn_once
from lowprec.float8 import Float8Linear, calibrate
from lowprec.float8.calibration import calibrated_scalers
from lowprec.recipes import compose
from lowprec.recipes.policy import DTYPES, Policy
from lowprec.recipes.presets import get_recipe
from lowprec.recipes.recipe import Recipe

_log = logging.getLogger("lowprec.recipes")

__all__ = ["OptimizerFactory", "Prepared", "build_optimizer", "factory_lr", "prepare"]

OptimizerFactory = Callable[[list[Any]], torch.optim.Optimizer]


@dataclass
class Prepared:
    """What a training loop needs after :func:`prepare`.

    Use ``with prepared.compute(): loss = ...; prepared.scaler.scale(loss).backward()``, then
    ``prepared.scaler.step(prepared.optimizer)`` and ``prepared.scaler.update()``.

    Static float8 scales calibrate themselves: while :attr:`calibrating`, the forward and
    backward passes record the running maximum of each static role's ``amax``
    (:func:`lowprec.float8.calibrate`; the step trains as usual, with the scale of the
    maximum so far), from the first ``compute()`` in training mode on; after the
    ``recipe.calibration_batches``-th one, the scales freeze when the next ``compute()``
    begins, so that the last calibration batch's backward counts wherever the loop runs it
    (inside ``compute()``, as the README's loop, or after it, as Lightning and Fabric do).
    A checkpoint saved after calibration restores the frozen scales; one saved during it
    (:meth:`calibration_progress`) goes on calibrating for the batches still missing, from
    the maxima so far.
    """

    model: nn.Module
    optimizer: Any
    scaler: LossScaler
    recipe: Recipe
    _calibration: contextlib.ExitStack | None = field(default=None, repr=False)
    _calibrated_batches: int = field(default=0, repr=False)

    @property
    def calibrating(self) -> bool:
        """True while static float8 scales still wait for calibration batches (after the
        last one, none: they freeze when the next ``compute()`` begins)."""
        if self._calibration is not None:
            return self._calibrated_batches < self.recipe.calibration_batches
        return any(
            isinstance(m, Float8Linear) and m.needs_calibration for m in self.model.modules()
        )

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Context for forward and backward: autocast; with FP16/BF16 parameters softmax,
        the normalisations and the losses in FP32 (:class:`~lowprec.amp.SensitiveInFp32`)
        and, on CPU, matmuls with FP32 accumulation; and the calibration of static float8
        scales on the first training batches."""
        with contextlib.ExitStack() as stack:
            calibrating = self._begin_calibration()
            if self.recipe.autocast is not None:
                device = next(self.model.parameters()).device.type
                stack.enter_context(torch.autocast(device, dtype=DTYPES[self.recipe.autocast]))
            dtype = self.recipe.param_dtype
            modes: list[TorchFunctionMode] = []
            if dtype in ("fp16", "bf16") and self.recipe.scalify is None:
                modes.append(SensitiveInFp32())  # type: ignore[no-untyped-call]
            if _on_cpu(self.model) and (
                dtype == "fp16" or (dtype == "bf16" and not native_bf16_matmul())
            ):
                modes.append(MatmulInFp32(DTYPES[dtype]))  # type: ignore[no-untyped-call]
            if modes and self.model.training and checkpointed_layer(self.model) is not None:
                warn_once(
                    _log,
                    f"compute:checkpointing:{self.recipe.name}",
                    "recipe %s: activation checkpointing recomputes layers in backward "
                    "outside compute(), without its FP32 softmax/normalisations%s: their "
                    "gradients differ from a run without checkpointing (docs/reliability.md)",
                    self.recipe.name,
                    " and FP32-accumulated matmuls" if len(modes) > 1 else "",
                )
            for mode in modes:
                stack.enter_context(mode)
            yield
        if calibrating:
            self._end_calibration_batch()

    def _begin_calibration(self) -> bool:
        if self._calibration is not None and self._calibrated_batches >= (
            self.recipe.calibration_batches
        ):  # the last calibration batch's forward and backward are done: freeze
            stack, self._calibration = self._calibration, None
            stack.close()  # (ValueError if a role saw no data)
            return False
        if self._calibration is None:
            if not (self.recipe.needs_calibration and self.model.training and self.calibrating):
                return False
            self._calibration = contextlib.ExitStack()
            # training batches only: an evaluation in between records nothing
            self._calibration.enter_context(calibrate(self.model, training_only=True))
            self._calibrated_batches = 0
        return self.model.training

    def _end_calibration_batch(self) -> None:
        self._calibrated_batches += 1  # the scales freeze when the next compute() begins

    def calibration_state(self) -> dict[str, Any] | None:
        """While static float8 scales calibrate (or are about to): what
        :meth:`restore_calibration` needs to undo a step, a copy of every calibrated
        scaler's state and the count of calibration batches; otherwise ``None``."""
        if self._calibration is None and not (
            self.recipe.needs_calibration and self.model.training and self.calibrating
        ):
            return None
        return {
            "batches": self._calibrated_batches,
            "open": self._calibration is not None,
            "scalers": [(s, s.state_dict()) for s in calibrated_scalers(self.model)],
        }

    def restore_calibration(self, state: dict[str, Any] | None) -> None:
        """Undo the calibration batches counted since ``state`` (from
        :meth:`calibration_state`; ``None`` does nothing): the scalers' maxima and frozen
        scales and the batch count come back, and a calibration that ended since goes on.
        :func:`~lowprec.recipes.step.train_step` calls it for a skipped step, so that a
        non-finite batch neither counts as a calibration batch nor enters the maxima."""
        if state is None:
            return
        for s, saved in state["scalers"]:
            s.load_state_dict(saved)
        self._calibrated_batches = state["batches"]
        if self._calibration is None and state["open"]:
            stack = contextlib.ExitStack()
            stack.enter_context(calibrate(self.model, fresh=False, training_only=True))
            self._calibration = stack

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def calibration_progress(self) -> dict[str, Any]:
        """How far the calibration of static float8 scales has come: ``{"batches": n,
        "open": b}`` (``open``: it started and has not ended). Saved with checkpoints, so
        that a run resumed in the middle of its calibration goes on calibrating."""
        return {"batches": self._calibrated_batches, "open": self._calibration is not None}

    def resume_calibration(self, progress: dict[str, Any] | None) -> None:
        """Restore :meth:`calibration_progress` after the model's state is loaded: a
        calibration that was open goes on from the loaded maxima (loading a module state
        with maxima freezes the scales; they are unfrozen) for the batches it still needs.
        ``None`` (a checkpoint without it) leaves the loaded state as it is."""
        if progress is None:
            return
        batches, was_open = progress.get("batches"), progress.get("open")
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"calibration batches must be an int >= 0, got {batches!r}")
        if not isinstance(was_open, bool):
            raise ValueError(f"calibration 'open' must be a bool, got {was_open!r}")
        if self._calibration is not None:
            self._calibration.close()
            self._calibration = None
        self._calibrated_batches = batches
        if was_open:
            for s in calibrated_scalers(self.model):
                s.unfreeze()
            stack = contextlib.ExitStack()
            stack.enter_context(calibrate(self.model, fresh=False, training_only=True))
            self._calibration = stack

    def state_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "calibration": self.calibration_progress(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["recipe"]
        if Recipe.from_dict(saved) != self.recipe:  # a checkpoint of 0.1 stores a flat dict
            raise ValueError(
                f"state: saved with recipe {saved.get('name')!r}, not {self.recipe.name!r}"
            )
        # All or nothing: a part that fails to load restores what the earlier parts changed.
        snapshot = copy.deepcopy(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
            }
        )
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
            self.resume_calibration(state.get("calibration"))
        except Exception:
            self.model.load_state_dict(snapshot["model"])
            self.optimizer.load_state_dict(snapshot["optimizer"])
            self.scaler.load_state_dict(snapshot["scaler"])
            raise


def factory_lr(factory: OptimizerFactory) -> float:
    """The learning rate ``factory`` gives its optimizer (the base of u-μP's groups)."""
    probe = factory([nn.Parameter(torch.zeros(1))])
    return float(probe.param_groups[0]["lr"])


def _on_cpu(model: nn.Module) -> bool:
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu"


def prepare(
    model: nn.Module,
    recipe: str | Recipe,
    optimizer_factory: OptimizerFactory | None = None,
    generator: torch.Generator | None = None,
    *,
    param_groups: Callable[[nn.Module, list[Any]], list[Any]] | None = None,
) -> Prepared:
    """Apply ``recipe`` to ``model`` (in place: its parameters are cast) and build the
    optimizer (``optimizer_factory(params)``, default AdamW lr 1e-3) and the loss scaler.

    The techniques, in order (:func:`lowprec.recipes.compose.apply`):

    * unit: the model is made unit-scaled (:func:`lowprec.unit.unit_scale`, a new module)
      and the optimizer gets u-μP parameter groups: each group's ``"lr_mult"`` times the
      factory's learning rate (a loop that schedules the lr sets
      ``group["lr"] = lr_now * lr_mult``);
    * scalify: the model is wrapped by :func:`lowprec.scalify.scalify` (its state_dict
      keys gain the wrapper's prefix);
    * the model is cast to the policy's ``param_dtype``; with BF16 or FP16 (and no
      scalify, which scales its FP32 inputs itself) a forward pre-hook casts its
      floating-point inputs to it too, as FSDP2's mixed precision does
      (:class:`lowprec.recipes.compose.CastInputs`);
    * float8: every ``nn.Linear`` whose last name component is not in ``float8_skip``
      becomes a :class:`~lowprec.float8.Float8Linear` (inside a unit-scaled model: the
      unit linear's product, see :mod:`lowprec.recipes.compose`). Static roles calibrate
      on the first training batches (:class:`Prepared`).

    The optimizer: :func:`build_optimizer` (FP32 masters, remainders, lean optimizer
    states, as the policy says). ``generator`` drives stochastic rounding, if the recipe
    uses it. ``param_groups(model, params)``, if given, regroups the parameters of the
    converted model (``params``: its parameters, or u-μP's groups) before the optimizer is
    built, e.g. into weight-decay groups (keep each group's ``"lr_mult"``).

    Example:
        >>> p = prepare(nn.Linear(8, 8), "bf16")
        >>> p.model.weight.dtype, type(p.optimizer).__name__, type(p.scaler).__name__
        (torch.bfloat16, 'MasterWeights', 'NoLossScaler')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model: {type(model).__name__} has no parameter that requires grad (nothing to train)"
        )
    for name, fn, what in (
        ("optimizer_factory", optimizer_factory, "params -> torch.optim.Optimizer"),
        ("param_groups", param_groups, "(model, params) -> params or groups"),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable ({what}) or None, got {fn!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    r = get_recipe(recipe)
    factory = optimizer_factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    lr = factory_lr(factory) if r.unit is not None else 0.0
    model, params = compose.apply(
        model, r.technique, r.torch_dtype, lr, r.float8_skip, r.layers, r.name
    )
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    if param_groups is not None:
        params = param_groups(model, params)
    optimizer = build_optimizer(params, factory, r.policy, generator)
    return Prepared(model, optimizer, r.policy.make_scaler(), r)


def build_optimizer(
    params: list[Any],
    factory: OptimizerFactory,
    policy: Policy,
    generator: torch.Generator | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of ``policy`` over ``params`` (parameters or groups, e.g. u-μP's with
    ``lr_mult``), from the user's ``factory``:

    * ``master="fp32"``: a :class:`~lowprec.amp.MasterWeights` around the factory's
      optimizer on FP32 copies (made lean by :func:`~lowprec.amp.lean_optimizer` if
      ``optimizer_state`` is not ``"auto"``: 8-bit moments of FP32 masters);
    * a lean policy (:attr:`Policy.lean`: explicit ``optimizer_state``, ``master="none"``
      with stochastic rounding, or ``master="remainder"``): the factory's AdamW / Adam /
      SGD as a :mod:`lowprec.amp.lean` optimizer on the parameters themselves, with the
      policy's state precision, remainders and stochastic rounding;
    * otherwise the factory's optimizer as it is.
    """
    lean = {"state": policy.state_precision, "generator": generator}
    if policy.master_kind == "fp32":
        inner = factory
        if policy.optimizer_state != "auto":

            def inner(ps: list[Any]) -> torch.optim.Optimizer:
                return lean_optimizer(factory(ps), **lean)

        return MasterWeights(params, inner, policy.stochastic_rounding, generator)
    if policy.lean:
        master = "remainder" if policy.master_kind == "remainder" else "none"
        return lean_optimizer(
            factory(params),
            master=master,
            stochastic_rounding=policy.stochastic_rounding,
            **lean,
        )
    return factory(params)
