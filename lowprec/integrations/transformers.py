"""lowprec inside HF transformers' ``Trainer``: :func:`make_trainer` and :class:`LowprecTrainer`.

``make_trainer(model, args, recipe=..., **trainer_kwargs)`` returns a ``Trainer`` subclass
that trains ``model`` with any lowprec recipe. Everything that makes the recipe is
lowprec's own, reached through :func:`lowprec.recipes.prepare` and the loss scaler's
``GradScaler`` API; nothing is re-implemented here:

* the model: :func:`~lowprec.recipes.prepare` converts it (float8 linears, a unit-scaled
  u-μP copy, a scalify wrapper, per-layer rules, the parameter dtype) on ``args.device``
  before the ``Trainer`` (and Accelerate's DDP/FSDP wrapping) sees it;
* the optimizer: the ``Trainer``'s own choice (``args.optim``, ``args.learning_rate``, or
  ``optimizer_cls_and_kwargs``) built by ``prepare`` as the recipe's policy says: FP32
  master weights, lean states, stochastic rounding (a generator seeded with ``args.seed``);
  u-μP's parameter groups for unit recipes (``"lr_mult"`` per group; the ``Trainer``'s
  scheduler scales each group's rate); weight decay groups as the ``Trainer`` makes them;
* loss scaling: the recipe's loss scaler is the Accelerator's ``scaler``, so that
  ``accelerator.backward`` scales the loss, the optimizer step is skipped on Inf/NaN
  gradients (and the LR scheduler with it), gradients are unscaled before clipping, and the
  ``Trainer`` saves and restores the scaler (``scaler.pt``) as it does ``GradScaler``'s;
* forward and backward run inside :meth:`~lowprec.recipes.Prepared.compute` (autocast,
  CPU FP16/BF16 matmuls, the calibration of static float8 scales), evaluation's forward too.

Checkpoints. The ``Trainer``'s own checkpoint holds the model, the optimizer (FP32 masters,
lean states, the generator), the scaler, the scheduler and the RNG states; each checkpoint
folder also gets ``lowprec_state.pt`` (:func:`~lowprec.integrations.common.lowprec_state`:
the recipe, the model's buffers such as float8 amax histories, calibration progress), read
back with ``torch.load(weights_only=True)``. ``trainer.train(resume_from_checkpoint=...)``
then continues exactly: the same losses and parameters, bit for bit, as a run that was
never interrupted (``tests/integrations/test_transformers.py``).

Run directory. With ``run_dir``, a :class:`~lowprec.jobs.recorder.RunRecorder` writes one
metrics record per optimizer step (loss, loss scale, skipped, learning rate) and the
numerics, which ``lowprec report RUN_DIR`` reads; a resumed run continues the directory
after the checkpoint's step.

Data parallel (``torchrun``, ``accelerate launch``; ``args.world_size > 1``): the run is
built by :func:`lowprec.distributed.prepare` with ``"ddp"`` (the technique, DDP with the
recipe's hooks: float8 scaling state reduced over the ranks, u-μP's ``sqrt(N)`` divisor;
then optimizer and scaler), and the ``Trainer`` takes the wrapped model as it is. Every
rank must build the same model.

FSDP2 (``accelerate launch --use_fsdp --fsdp_version 2``, or ``TrainingArguments(fsdp=True,
fsdp_config={"version": 2})``): the run is built by :func:`lowprec.distributed.prepare`
with ``"fsdp"`` from rank 0's weights, the ``Trainer``'s Accelerator is kept out of FSDP
and takes the sharded model as prepared, and checkpoints are sharded (DCP) with the
unsharded model written by rank 0 (:mod:`lowprec.integrations.hf_parallel`).

Not supported (refused with a message): an optimizer instance in ``optimizers`` (lowprec
builds the optimizer), ``model_init``, ``args.fp16``/``args.bf16`` (the recipe sets the
precision), DeepSpeed, FSDP1 and the FSDP settings lowprec's FSDP2 does not honour
(:func:`~lowprec.integrations.hf_parallel.parallel_mode`), ``load_best_model_at_end``
under FSDP2. A step skipped for Inf/NaN gradients does not restore the model's buffers
(``train_step(skip_nonfinite=True)`` does): a delayed-scaling amax history keeps that
step's amax.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, Trainer, TrainingArguments

from lowprec.amp.master import MasterWeights
from lowprec.analysis.gemms import DEFAULT_EVERY
from lowprec.autopilot.guard import Guard, GuardConfig, Move
from lowprec.integrations.common import (
    ModuleFilter,
    decay_groups,
    load_lowprec_state,
    lowprec_state,
    move_scheduler,
    unit_accumulated,
    unwrap,
    with_module_filter,
)
from lowprec.integrations.hf_parallel import (
    FSDP_DIR,
    accelerator_without_fsdp,
    check_materialized,
    check_sharded,
    load_sharded,
    parallel_mode,
    save_sharded,
)
from lowprec.integrations.hf_setup import (
    LowprecCallback,
    hf_config_view,
    optimizer_factory,
)
from lowprec.jobs.recorder import RunRecorder
from lowprec.recipes import Prepared, Recipe, prepare
from lowprec.scalify.transform import Scalified

__all__ = ["STATE_NAME", "LowprecTrainer", "make_trainer"]

STATE_NAME = "lowprec_state.pt"


class LowprecTrainer(Trainer):  # type: ignore[misc]
    """A ``transformers.Trainer`` that trains with a lowprec recipe (module docstring).

    Args:
        model: the model (an HF ``PreTrainedModel`` or any ``nn.Module`` the ``Trainer``
            accepts); converted in place or replaced (unit, scalify) by the recipe.
        args: the ``TrainingArguments`` (not ``fp16``/``bf16``: the recipe sets the precision).
        recipe: a recipe name (:func:`lowprec.recipes.recipe_names`) or a
            :class:`~lowprec.recipes.Recipe`.
        module_filter: ``(module, fqn) -> bool``: the linears a float8 recipe converts
            (:func:`~lowprec.integrations.common.with_module_filter`).
        run_dir: write a lowprec run directory there (``lowprec report`` reads it).
        numerics_every: with ``run_dir``: record numerics every this many steps.
        gemms_every: measure the low-precision GEMMs every this many steps (the run
            directory's ``gemms.jsonl``, and what the guard judges).
        guard: ``True`` or a :class:`~lowprec.autopilot.guard.GuardConfig`: the guard
            moves a float8 layer whose measured GEMMs fail to a safer format during
            training (:mod:`lowprec.autopilot.guard`); its moves go into checkpoints (and
            ``guard.jsonl`` of the run directory) and are replayed on resume. One process.
        **trainer_kwargs: the ``Trainer``'s other arguments (``train_dataset``,
            ``data_collator``, ``callbacks``, ``optimizer_cls_and_kwargs``, ``optimizers``
            with ``None`` as optimizer and any scheduler, ...).

    Attributes:
        lowprec: the :class:`~lowprec.recipes.Prepared` (model, optimizer, scaler, recipe).
    """

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments,
        *,
        recipe: str | Recipe,
        module_filter: ModuleFilter | None = None,
        run_dir: str | Path | None = None,
        numerics_every: int | None = 100,
        gemms_every: int | None = DEFAULT_EVERY,
        guard: bool | GuardConfig = False,
        **trainer_kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"args must be a TrainingArguments, got {type(args).__name__}")
        if getattr(args, "fp16", False) or getattr(args, "bf16", False):
            raise ValueError(
                "args: fp16/bf16 would add HF's autocast and GradScaler on top of the recipe; "
                "leave them False, the recipe sets the precision"
            )
        if getattr(args, "deepspeed", None):
            raise ValueError("args.deepspeed: DeepSpeed is not supported with lowprec recipes")
        if trainer_kwargs.get("model_init") is not None:
            raise ValueError("model_init: not supported; pass the model (lowprec converts it)")
        optimizers = trainer_kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None:
            raise TypeError(
                "optimizers: lowprec builds the optimizer (masters, lean states, u-muP groups); "
                "pass (None, scheduler) and choose it with args.optim or optimizer_cls_and_kwargs"
            )
        if run_dir is not None and not isinstance(run_dir, (str, Path)):
            raise TypeError(f"run_dir must be a str, Path or None, got {type(run_dir).__name__}")
        r = with_module_filter(recipe, model, module_filter)
        if r.unit is not None:
            outside = [n for n, on in (
                ("args.label_smoothing_factor", bool(getattr(args, "label_smoothing_factor", 0))),
                ("compute_loss_func", trainer_kwargs.get("compute_loss_func") is not None),
            ) if on]  # fmt: skip
            if outside:
                raise ValueError(
                    f"{', '.join(outside)}: with a unit recipe the loss must be the model's "
                    "own (unit) loss; HF would compute it outside the model as a plain op, and "
                    "every gradient would be off by a factor of the token count"
                )
        parallel = parallel_mode(args)
        if not isinstance(guard, (bool, GuardConfig)):
            raise TypeError(f"guard must be a bool or a GuardConfig, got {type(guard).__name__}")
        if guard is not False and parallel:
            raise ValueError("guard: it runs on one process, not data-parallel")
        if guard is not False and r.float8 is None:
            raise ValueError(f"guard: recipe {r.name!r} has no float8 layers to move")
        if parallel == "fsdp" and args.load_best_model_at_end:
            raise ValueError(
                "args.load_best_model_at_end: not supported under FSDP2 (lowprec's sharded "
                "checkpoints restore the model with its optimizer)"
            )
        self._parallel = parallel  # read by create_accelerator_and_postprocess
        model.to(args.device)  # the masters are made where the parameters are
        generator = None
        if r.policy.stochastic_rounding:
            generator = torch.Generator(args.device).manual_seed(args.seed)
        # HF's groups, always: args.weight_decay (0.0 too) for the decayed parameters, 0.0
        # for the others (the optimizer's own default, e.g. AdamW's 0.01, never applies)
        regroup = decay_groups(self.get_decay_parameter_names, args.weight_decay)
        factory = optimizer_factory(args, model, trainer_kwargs.get("optimizer_cls_and_kwargs"))
        if parallel:
            # torchrun / accelerate launch: lowprec's own order (technique, DDP wrap or
            # fully_shard with the recipe's hooks, then optimizer and scaler); the Trainer
            # takes the wrapped or sharded model as it is.
            from lowprec.distributed import prepare as prepare_parallel

            fsdp = parallel == "fsdp"
            if fsdp:
                check_materialized(model)
            try:  # FSDP2: rank 0's converted model on every rank (DDP broadcasts it itself)
                self.lowprec: Prepared = prepare_parallel(
                    model, r, parallel, factory, generator, param_groups=regroup,
                    sync_module_states=fsdp,
                )  # fmt: skip
            except ValueError as e:
                if not fsdp:
                    raise
                raise ValueError(f"{e} (under FSDP2; without an FSDP config the run is DDP)") from e
        else:
            self.lowprec = prepare(model, r, factory, generator, param_groups=regroup)
        net = unwrap(self.lowprec.model)
        if parallel == "fsdp":  # Accelerate's prepare leaves it as it is (no DDP wrap)
            object.__setattr__(net, "_is_accelerate_prepared", True)
        self._guard = None if guard is False else Guard(net, None if guard is True else guard)
        self._gemms_every = gemms_every
        self._run_dir = None if run_dir is None else Path(run_dir)
        self._numerics_every = numerics_every
        self._recorder: RunRecorder | None = None
        self._step_loss: Tensor | None = None
        self._step_lr: float | None = None  # the rate of the step being logged
        self._unscaled = False
        callbacks = [*(trainer_kwargs.pop("callbacks", None) or []), LowprecCallback(self)]
        with hf_config_view(net):
            super().__init__(model=net, args=args, callbacks=callbacks, **trainer_kwargs)
        if net is not self.lowprec.model:
            self.model_wrapped = self.lowprec.model  # the Trainer does not wrap it again
        # The recipe's loss scaler is the Accelerator's: accelerate.backward scales the loss,
        # AcceleratedOptimizer.step unscales, skips on Inf/NaN and updates it, the Trainer
        # saves and loads it (GradScaler's API).
        self.accelerator.scaler = self.lowprec.scaler
        if isinstance(net, Scalified):
            self._inspect_wrapped(net.module)
        if r.unit is not None:
            # The unit loss's backward is unit per counted token (its mean's 1/n is
            # forward-only); HF's loss kwargs would divide the summed loss by the token
            # count as a plain op, making every gradient 1/n of unit (0.004x at 240
            # tokens). The model computes its own mean; compute_loss scales the rest.
            self.model_accepts_loss_kwargs = False

    def create_accelerator_and_postprocess(self) -> None:
        """The ``Trainer``'s Accelerator; under FSDP2 built without Accelerate's FSDP
        plugin (:func:`~lowprec.integrations.hf_parallel.accelerator_without_fsdp`)."""
        if getattr(self, "_parallel", None) != "fsdp":
            super().create_accelerator_and_postprocess()
            return
        with accelerator_without_fsdp(self.args):
            super().create_accelerator_and_postprocess()
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type == DistributedType.FSDP:
            raise RuntimeError(
                "FSDP2: an Accelerator with Accelerate's FSDP plugin already exists in this "
                "process (Accelerate's state is shared); lowprec shards the model itself: "
                "build the trainer before any Accelerator"
            )

    def _inspect_wrapped(self, inner: nn.Module) -> None:
        """What the ``Trainer`` reads from the model's class and ``forward`` signature
        (label names, loss kwargs, the dataset columns kept), read from the model a
        scalify wrapper runs (whose own ``forward`` takes ``*args, **kwargs``)."""
        from transformers.utils.generic import can_return_loss, find_labels

        forward = inspect.signature(inner.forward).parameters
        self.model_accepts_loss_kwargs = getattr(
            inner,
            "accepts_loss_kwargs",
            any(p.kind == inspect.Parameter.VAR_KEYWORD for p in forward.values()),
        )
        if self.args.label_names is None:
            self.label_names = find_labels(type(inner))  # type: ignore[no-untyped-call]
        self.can_return_loss = can_return_loss(type(inner))  # type: ignore[no-untyped-call]
        if hasattr(self, "_loss_shifts_labels"):  # causal LMs count labels[..., 1:]
            from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

            config = getattr(inner, "config", None)
            loss_type: Any = getattr(inner, "loss_type", None)
            self._loss_shifts_labels = LOSS_MAPPING.get(
                loss_type
            ) is ForCausalLMLoss and not getattr(config, "is_encoder_decoder", False)
        if self._signature_columns is None:
            self._signature_columns: Any = [*forward, *{"label", "label_ids", *self.label_names}]

    # -- the optimizer -------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """The optimizer that :func:`lowprec.recipes.prepare` built; a scheduler passed as
        ``optimizers=(None, scheduler)`` moves onto it
        (:func:`~lowprec.integrations.common.move_scheduler`: it stepped the user's
        optimizer, and logged its rates, while lowprec's kept the base rate)."""
        self.optimizer = self.lowprec.optimizer
        if self.lr_scheduler is not None:
            move_scheduler(self.lr_scheduler, self.optimizer)
        return self.optimizer

    def _unscale(self) -> None:
        """Unscale the gradients once per step (before clipping or measuring them)."""
        if not self._unscaled:
            self.lowprec.scaler.unscale_(self.lowprec.optimizer)
            self._unscaled = True

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        """Clip (and return the norm of) the unscaled gradients: with FP32 master weights
        the FP32 ones (:meth:`~lowprec.amp.master.MasterWeights.clip_grad_norm_`), whose
        norm is exact where the model's FP16 copies underflow (a norm of 0 there: no
        clip at all); otherwise the Trainer's own clip."""
        self._unscale()
        opt = self.lowprec.optimizer
        if isinstance(opt, MasterWeights):
            return opt.clip_grad_norm_(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)  # type: ignore[no-untyped-call]

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            self._unscale()
        return super()._get_grad_norm(model, grad_norm)  # type: ignore[no-untyped-call]

    def _get_learning_rate(self) -> float:
        """The global learning rate (a u-μP group's rate divided by its ``lr_mult``)."""
        lr = float(super()._get_learning_rate())
        return lr / float(self.lowprec.optimizer.param_groups[0].get("lr_mult", 1.0))

    # -- forward and backward ------------------------------------------------------------
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """The ``Trainer``'s step (forward, scaled backward) inside the recipe's compute
        context."""
        model.train()
        with self.lowprec.compute():
            loss: Tensor = super().training_step(model, inputs, num_items_in_batch)
        d = loss.detach()
        self._step_loss = d if self._step_loss is None else self._step_loss + d
        return loss

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The ``Trainer``'s loss; a unit recipe's, with ``k`` micro-batches a step, has
        its backward scaled by ``√k`` (:func:`~lowprec.integrations.common.unit_accumulated`;
        the ``Trainer`` divides the loss by ``k``)."""
        out: Any = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not (model.training and torch.is_grad_enabled()):
            return out
        k = int(getattr(self, "current_gradient_accumulation_steps", 1) or 1)
        if return_outputs:
            return unit_accumulated(out[0], self.lowprec.recipe, k), out[1]
        return unit_accumulated(out, self.lowprec.recipe, k)

    def prediction_step(self, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with self.lowprec.compute():
            return super().prediction_step(model, *args, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The ``Trainer``'s optimizer and scheduler files, and ``lowprec_state.pt``; under
        FSDP2 the sharded checkpoint ``lowprec_fsdp/`` and the scheduler instead."""
        if self._parallel == "fsdp":
            save_sharded(self.lowprec, self.lr_scheduler, output_dir, self.args.should_save)
            return
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            state = lowprec_state(self.lowprec)
            if self._guard is not None:
                state["guard"] = self._guard.state_dict()
            torch.save(state, os.path.join(output_dir, STATE_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The model's weights; under FSDP2 nothing here: the sharded checkpoint restores
        them with the optimizer (:meth:`_load_optimizer_and_scheduler`)."""
        if self._parallel != "fsdp":
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        else:
            check_sharded(resume_from_checkpoint)  # before training starts

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._parallel == "fsdp":
            if checkpoint is not None:
                load_sharded(self.lowprec, self.lr_scheduler, checkpoint)
                self._unscaled = False
            return
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_NAME)
        if os.path.isdir(os.path.join(checkpoint, FSDP_DIR)):
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} was saved under FSDP2 (sharded, "
                f"{FSDP_DIR}/); resume it under FSDP2"
            )
        if not os.path.isfile(path):
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} has no {STATE_NAME} (not saved by a "
                "lowprec trainer): the recipe's buffers and calibration cannot be restored"
            )
        device = next(self.lowprec.model.parameters()).device
        state = torch.load(path, map_location=device, weights_only=True)
        saved_guard = state.get("guard") if isinstance(state, dict) else None
        if self._guard is not None and saved_guard is not None:
            # the layers the guard moved, as they were at the checkpoint, before its state
            self._guard.replay([Move.from_dict(m) for m in saved_guard.get("moves", [])])
        elif saved_guard is not None and saved_guard.get("moves"):
            raise ValueError(
                f"resume_from_checkpoint: {checkpoint} was saved by a run whose guard moved "
                "layers; resume it with guard=True"
            )
        load_lowprec_state(self.lowprec, state)
        if self._guard is not None and saved_guard is not None:
            self._guard.load_state_dict(saved_guard)
        self._unscaled = False

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """As the ``Trainer``'s, on the HF model a scalify wrapper runs (its tied keys)."""
        if not isinstance(self.model, Scalified):
            super()._issue_warnings_after_load(load_result)
            return
        wrapper, self.model = self.model, self.model.module
        try:
            super()._issue_warnings_after_load(load_result)
        finally:
            self.model = wrapper

    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        """A scalify'd HF model is saved as the HF model it wraps (``save_pretrained``:
        its config, tied weights handled); any other model as the ``Trainer`` saves it.
        Under FSDP2 every rank gathers the unsharded state, which rank 0 writes."""
        inner = self.model.module if isinstance(self.model, Scalified) else None  # not DDP
        if self._parallel == "fsdp" and state_dict is None:
            from lowprec.distributed.checkpoint import full_state_dict

            whole: nn.Module = inner if inner is not None else self.model  # type: ignore[assignment]
            state_dict = full_state_dict(whole)
            if not self.args.should_save:
                return
        if not isinstance(inner, PreTrainedModel):
            super()._save(output_dir, state_dict)
            return
        out = str(output_dir if output_dir is not None else self.args.output_dir)
        if self.args.should_save:
            os.makedirs(out, exist_ok=True)
            inner.save_pretrained(out, state_dict=state_dict)
            torch.save(self.args, os.path.join(out, "training_args.bin"))

    # -- the run directory ---------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        except BaseException:
            self._close_recorder(summary=False)
            raise

    def _open_recorder(self, step: int, max_steps: int) -> None:
        if (self._run_dir is None and self._guard is None) or self._recorder is not None:
            return
        writer = self._run_dir is not None and self.is_world_process_zero()
        out = self._run_dir or Path(str(self.args.output_dir)) / "lowprec-run"  # not written
        resume = step > 0 and (not writer or (out / "config.json").is_file())
        self._recorder = RunRecorder(
            out,
            unwrap(self.lowprec.model),
            recipe=self.lowprec.recipe,
            config={"trainer": "transformers", "learning_rate": self.args.learning_rate},
            steps=max_steps if max_steps > 0 else None,
            scaler=self.lowprec.scaler,
            numerics_every=self._numerics_every,
            gemms_every=self._gemms_every,
            resume=resume,
            resume_from=step if resume else None,
            writer=writer,
        )

    def _close_recorder(self, summary: bool = True) -> None:
        if self._recorder is not None:
            self._recorder.close(summary=summary)
            self._recorder = None

    def _end_step(self, step: int) -> None:
        """After an optimizer step: reset the per-step state; the guard judges the step
        (not a skipped one); log the step."""
        self._unscaled = False
        loss, self._step_loss = self._step_loss, None
        rec = self._recorder
        if rec is None or loss is None:
            return
        extra: dict[str, Any] = {}
        history = self.lowprec.scaler.history
        skipped = bool(history) and history[-1].skipped
        if self._guard is not None and not skipped:
            moves = self._guard.check(step, rec.gemm_records, float(loss))
            if moves:
                extra["guard_moves"] = len(moves)
                rec.append("guard.jsonl", [m.to_dict() for m in moves])
        lr, self._step_lr = self._step_lr, None  # the rate the step used (on_optimizer_step)
        rec.log(step, loss=loss, lr=self._get_learning_rate() if lr is None else lr, **extra)


def make_trainer(
    model: nn.Module,
    args: TrainingArguments,
    *,
    recipe: str | Recipe,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    run_dir: str | Path | None = None,
    guard: bool | GuardConfig = False,
    **trainer_kwargs: Any,
) -> LowprecTrainer:
    """A :class:`LowprecTrainer`: ``model`` trained by the HF ``Trainer`` with ``recipe``.

    Example::

        args = TrainingArguments("out", max_steps=100, save_steps=50, report_to=[])
        trainer = make_trainer(model, args, recipe="fp8-tensorwise", train_dataset=ds,
                               run_dir="runs/hf")
        trainer.train()                      # later: trainer.train(resume_from_checkpoint=True)
    """
    return LowprecTrainer(
        model,
        args,
        recipe=recipe,
        module_filter=module_filter,
        run_dir=run_dir,
        guard=guard,
        **trainer_kwargs,
    )
