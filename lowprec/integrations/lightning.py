"""lowprec in PyTorch Lightning and Fabric: precision plugins that train with any recipe.

Lightning's own FP8 plugin is ``TransformerEnginePrecision`` (delayed scaling only, NVIDIA
GPUs). :class:`LowprecPrecision` is a ``lightning.pytorch.plugins.Precision`` for every
lowprec recipe::

    trainer = L.Trainer(plugins=[LowprecPrecision("fp8-delayed")], max_epochs=2)
    trainer.fit(module)                                    # later: ckpt_path="last"

What it does, at the plugin hooks Lightning calls:

* ``convert_module`` (before ``configure_optimizers``): the recipe's techniques and dtype
  (:func:`lowprec.recipes.compose.apply`), in place on the ``LightningModule`` for the
  in-place techniques (float8 linears, the policy's dtype), or on the submodule named
  ``module`` (by default the module's only child) for those that build a new module (a
  unit-scaled copy, a scalify wrapper), which then replaces that attribute;
* ``connect`` (after ``configure_optimizers``): the optimizer is rebuilt by
  :func:`lowprec.recipes.prepared.build_optimizer` as the recipe's policy says (FP32
  masters, lean states, stochastic rounding) from the class, defaults and parameter groups
  of the one ``configure_optimizers`` returned (one optimizer), with u-μP's groups for a
  unit recipe; its LR schedulers are moved onto the new optimizer;
* the forward contexts (training, validation, test, predict):
  :meth:`~lowprec.recipes.Prepared.compute`;
* ``pre_backward`` scales the loss by the recipe's loss scaler; ``optimizer_step`` runs the
  closure, unscales (gradient clipping sees the true gradients, on the model's
  parameters: :meth:`main_params`), and steps through the scaler (skipped on Inf/NaN
  gradients, the scale updated);
* checkpoints: the plugin's ``state_dict`` holds the loss scaler,
  :func:`~lowprec.integrations.common.lowprec_state` (the recipe, the model's buffers,
  calibration) and torch's RNG states (which Lightning's checkpoints lack); the
  checkpoint's ``state_dict`` keeps only the keys the unconverted module has (Lightning
  loads it before ``convert_module``), and the converted module's state is loaded again
  after the conversion (``on_load_checkpoint``), so that ``trainer.fit(module,
  ckpt_path=...)`` resumes exactly.

:class:`LowprecFabricPrecision` is Fabric's: ``Fabric(plugins=[LowprecFabricPrecision(r)])``
converts the module in ``fabric.setup_module``/``fabric.setup`` (for a unit recipe the
handle it returns records the converted module as its original one, so ``state_dict()``,
``parameters()`` and ``.module`` are the trained unit model's), builds the recipe's optimizer
with :meth:`LowprecFabricPrecision.optimizer`, runs forward inside ``compute()``, scales the
loss in ``fabric.backward``, unscales in ``fabric.clip_gradients`` (pass
``error_if_nonfinite=False`` under dynamic loss scaling: an overflowing step is skipped, not
an error) and steps through the scaler; save it with the rest (``fabric.save(path, {"model":
m, "optimizer": o, "lowprec": fabric.strategy.precision})``). Fabric accumulates nothing
itself: with ``k`` micro-batches a step, divide a unit recipe's loss by ``√k``.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.fabric.wrappers import _FabricModule
from lightning.pytorch.plugins import Precision
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

import lowprec.unit
from lowprec.integrations.common import (
    ModuleFilter,
    load_lowprec_state,
    lowprec_state,
    move_scheduler,
    unit_accumulated,
    with_module_filter,
)
from lowprec.recipes import Prepared, Recipe, compose, get_recipe
from lowprec.recipes.prepared import build_optimizer

__all__ = ["LowprecFabricPrecision", "LowprecPrecision"]


class _Recipe:
    """What the Lightning and the Fabric plugin share: conversion, optimizer, state."""

    precision = "lowprec"

    def _init(
        self, recipe: str | Recipe, module: str | None, module_filter: ModuleFilter | None
    ) -> None:
        self.recipe = get_recipe(recipe)  # ValueError for an unknown name, now
        if module is not None and not isinstance(module, str):
            raise TypeError(f"module must be an attribute name or None, got {module!r}")
        if module_filter is not None and self.recipe.float8 is None:
            raise ValueError(f"module_filter: recipe {self.recipe.name!r} has no float8 technique")
        self.module_name, self.module_filter = module, module_filter
        self.prepared: Prepared | None = None
        self._root: nn.Module | None = None
        self._keys: set[str] | None = None

    @property
    def _builds_new(self) -> bool:
        return self.recipe.unit is not None or self.recipe.scalify is not None

    def _convert(self, root: nn.Module) -> nn.Module:
        """Apply the recipe's techniques to ``root`` (or its submodule); the module to use."""
        name = self.module_name
        if name is None and self._builds_new:
            children = list(root.named_children())
            if len(children) != 1:
                raise ValueError(
                    f"module: recipe {self.recipe.name!r} builds a new module (unit scaling or "
                    f"scalify); name the attribute that holds the network (the module has "
                    f"{len(children)} children: {[n for n, _ in children]})"
                )
            name = children[0][0]
        target = root if name is None else getattr(root, name, None)
        if not isinstance(target, nn.Module):
            raise ValueError(f"module: {type(root).__name__} has no submodule {name!r}")
        self._keys = set(root.state_dict())
        r = with_module_filter(self.recipe, target, self.module_filter)
        self.recipe = r
        # lr=1.0: u-muP's groups are made again for the optimizer's learning rate in connect
        net, _ = compose.apply(
            target, r.technique, r.torch_dtype, 1.0, r.float8_skip, r.layers, r.name
        )
        if name is not None:
            setattr(root, name, net)
        elif net is not root:
            raise ValueError(
                f"recipe {r.name!r} builds a new module; pass module=<attribute of the network>"
            )
        self._root = root
        self.prepared = Prepared(net, None, r.policy.make_scaler(), r)
        return root

    def _optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` (over the converted parameters) rebuilt by the recipe's policy."""
        p = self._need()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups: list[Any] = [dict(g) for g in optimizer.param_groups]
        if self.recipe.unit is not None:
            groups = _umup_groups(p.model, self._root or p.model, groups)

        def factory(ps: list[Any]) -> torch.optim.Optimizer:
            return cls(ps, **defaults)

        generator = None
        if self.recipe.policy.stochastic_rounding:
            device = next(p.model.parameters()).device
            generator = torch.Generator(device).manual_seed(0)
        built = build_optimizer(groups, factory, self.recipe.policy, generator)
        p.optimizer = built
        return built

    def _need(self) -> Prepared:
        if self.prepared is None:
            raise RuntimeError("the module was not converted yet (convert_module runs first)")
        return self.prepared

    def _compute(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self.prepared is None else self.prepared.compute()

    def main_params(self, optimizer: Any) -> Any:
        """The model's parameters: clipping their (unscaled) gradients reaches the update
        (also through FP32 masters, :mod:`lowprec.amp.master`)."""
        return self._need().model.parameters()

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler, the recipe state and torch's RNG states (CPU, CUDA): Lightning's
        checkpoints hold no RNG state, and dropout or stochastic rounding without it would
        draw other numbers after a resume."""
        p = self._need()
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"scaler": p.scaler.state_dict(), "lowprec": lowprec_state(p), "rng": rng}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        p = self._need()
        p.scaler.load_state_dict(state_dict["scaler"])
        load_lowprec_state(p, state_dict["lowprec"])
        rng = state_dict.get("rng") or {}
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


class LowprecPrecision(_Recipe, Precision):  # type: ignore[misc]
    """A Lightning precision plugin that trains with a lowprec recipe (module docstring).

    Args:
        recipe: a recipe name or :class:`~lowprec.recipes.Recipe`.
        module: the attribute of the ``LightningModule`` that holds the network to convert
            (``None``: the module itself for in-place recipes, its only child for unit and
            scalify recipes).
        module_filter: ``(module, fqn) -> bool``: the linears a float8 recipe converts.
    """

    def __init__(
        self,
        recipe: str | Recipe,
        *,
        module: str | None = None,
        module_filter: ModuleFilter | None = None,
    ) -> None:
        super().__init__()
        self._init(recipe, module, module_filter)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return self._convert(module)

    def connect(
        self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Any], list[Any]]:
        if not optimizers:
            return model, optimizers, lr_schedulers
        if len(optimizers) != 1:
            raise ValueError(
                f"configure_optimizers: {len(optimizers)} optimizers; LowprecPrecision takes one"
            )
        old = optimizers[0]
        new = self._optimizer(old)
        for config in lr_schedulers:
            s = getattr(config, "scheduler", config)
            if getattr(s, "optimizer", None) is old:
                move_scheduler(s, new)
        return model, [new], lr_schedulers

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        with self._compute():
            yield

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        """The loss times the loss scale; for a unit recipe with ``k`` accumulated
        batches, its backward also times ``√k``
        (:func:`~lowprec.integrations.common.unit_accumulated`; Lightning divides the loss
        by ``k``)."""
        k = int(getattr(getattr(module, "trainer", None), "accumulate_grad_batches", 1) or 1)
        tensor = unit_accumulated(tensor, self.recipe, k)
        return super().pre_backward(self._need().scaler.scale(tensor), module)  # type: ignore[no-any-return]

    def optimizer_step(  # type: ignore[override]  # Lightning's own signature (not Fabric's)
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """The closure (forward, scaled backward), unscale, the hooks and clipping, then
        the scaler's step (skipped on Inf/NaN gradients) and update."""
        scaler = self._need().scaler
        result = closure()
        skip = result is None and model.automatic_optimization  # the step returned None
        if not skip:
            scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip:
            return result
        scaler.step(optimizer, **kwargs)
        scaler.update()
        return result

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep in the checkpoint's ``state_dict`` only the keys the unconverted module has
        (the others, buffers of the converted layers, are in the plugin's state)."""
        sd = checkpoint.get("state_dict")
        if isinstance(sd, dict) and self._keys is not None:
            checkpoint["state_dict"] = type(sd)((k, v) for k, v in sd.items() if k in self._keys)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """After the conversion: the converted module's parameters from the checkpoint (a
        unit recipe's copy was initialised anew); buffers follow in ``load_state_dict``."""
        sd = checkpoint.get("state_dict")
        if self._root is None or not isinstance(sd, dict):
            return
        _, unexpected = self._root.load_state_dict(sd, strict=False)
        if unexpected:
            raise ValueError(
                f"checkpoint: keys the converted module does not have: {unexpected[:5]}"
            )


class LowprecFabricPrecision(_Recipe, FabricPrecision):  # type: ignore[misc]
    """Fabric's precision plugin for a lowprec recipe (module docstring). Build the
    optimizer after ``fabric.setup_module(model)`` with :meth:`optimizer`."""

    def __init__(
        self,
        recipe: str | Recipe,
        *,
        module: str | None = None,
        module_filter: ModuleFilter | None = None,
    ) -> None:
        self._init(recipe, module, module_filter)
        self._handle_hook: RemovableHandle | None = None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module`` (a unit or scalify recipe: the new module is returned when
        ``module`` is the network itself).

        A unit recipe's new module has parameters of its own (a u-μP copy, initialised
        anew), and Fabric's handle (``_FabricModule``) points ``state_dict()``,
        ``load_state_dict``, ``parameters()``, ``.module`` and attribute look-ups at the
        module given to ``setup_module``, not at the one this returns: they showed the
        untrained model. So the handle that ``setup_module`` builds next records the
        converted module as its original one (:func:`_point_handle_at`). A scalify wrapper
        shares the given module's parameters: the handle keeps the given module (its
        ``save_pretrained``)."""
        if self._builds_new and self.module_name is None:
            r = with_module_filter(self.recipe, module, self.module_filter)
            net, _ = compose.apply(
                module, r.technique, r.torch_dtype, 1.0, r.float8_skip, r.layers, r.name
            )
            self.recipe, self._root, self._keys = r, net, set(net.state_dict())
            self.prepared = Prepared(net, None, r.policy.make_scaler(), r)
            self._drop_handle_hook()  # one of an earlier setup_module (that failed?)
            own = {id(p) for p in net.parameters()} != {id(p) for p in module.parameters()}
            if own:
                self._handle_hook = _point_handle_at(module, net)
            return net
        return self._convert(module)

    def _drop_handle_hook(self) -> None:
        """Remove the hook of :func:`_point_handle_at` (it may not remove itself: torch
        iterates over the hooks while it runs)."""
        if self._handle_hook is not None:
            self._handle_hook.remove()
            self._handle_hook = None

    def optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` (a fresh one over the converted module's parameters) rebuilt as
        the recipe says (FP32 masters, lean states, u-μP groups); pass the result to
        ``fabric.setup_optimizers``."""
        self._drop_handle_hook()
        return self._optimizer(optimizer)

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        self._drop_handle_hook()
        return self._compute()

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        """``tensor`` times the loss scale, backpropagated (Fabric's strategy discards what
        ``pre_backward`` returns, so the scaling happens here, as in Fabric's own mixed
        precision)."""
        super().backward(self._need().scaler.scale(tensor), model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        p = self._need()
        applied = p.scaler.step(optimizer, **kwargs)
        p.scaler.update()
        return applied

    def unscale_gradients(self, optimizer: Any) -> None:
        self._need().scaler.unscale_(optimizer)


def _point_handle_at(given: nn.Module, converted: nn.Module) -> RemovableHandle:
    """Make the ``_FabricModule`` that ``fabric.setup_module(given)`` builds next take
    ``converted`` as its ``_original_module`` (the module its ``state_dict``,
    ``load_state_dict``, ``parameters``, ``.module`` and attribute look-ups use) in place
    of ``given``: a module-registration hook (:func:`torch.nn.modules.module.
    register_module_module_registration_hook`) that replaces that one assignment, then
    does nothing until the plugin removes it (at its next call: the optimizer, a forward).
    Fabric 2.x builds the handle right after ``convert_module`` and the strategy's setup,
    in the same call."""
    ref = weakref.ref(given)
    fired = False

    def hook(module: nn.Module, name: str, submodule: nn.Module | None) -> nn.Module | None:
        nonlocal fired
        if (
            not fired
            and name == "_original_module"
            and isinstance(module, _FabricModule)
            and submodule is not None
            and submodule is ref()
        ):
            fired = True
            return converted
        return None

    # torch types the hook as returning None; a module returned replaces the assignment's
    return register_module_module_registration_hook(hook)  # type: ignore[arg-type]


def _umup_groups(net: nn.Module, root: nn.Module, groups: list[dict[str, Any]]) -> list[Any]:
    """u-μP's groups (:func:`lowprec.unit.recipe_param_groups`) for the learning rate of
    the user's one group, with its other options; parameters of ``root`` outside ``net`` in
    a group of their own (``lr_mult`` 1)."""
    if len(groups) != 1:
        raise ValueError(
            f"optimizer: {len(groups)} parameter groups; a unit recipe sets u-muP's groups "
            "itself from one group"
        )
    g = groups[0]
    lr, initial = float(g["lr"]), float(g.get("initial_lr", g["lr"]))
    rest = {k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
    out: list[dict[str, Any]] = []
    for u in lowprec.unit.recipe_param_groups(net, initial):
        m = u["lr_mult"]
        out.append({**rest, **u, "lr": lr * m, "initial_lr": initial * m})
    inside = {id(p) for p in net.parameters()}
    others = [p for p in root.parameters() if id(p) not in inside and p.requires_grad]
    if others:
        out.append({**rest, "params": others, "lr": lr, "initial_lr": initial, "lr_mult": 1.0})
    return out
