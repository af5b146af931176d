"""lowprec's float8 recipes as torchtitan model converters, registered by name.

torchtitan (0.1 to 0.2.x) converts a model through named converters: a class registered
with ``torchtitan.protocols.model_converter.register_model_converter(cls, name)`` and
chosen in the job config (``[model] converters = ["lowprec.fp8-rowwise"]``), built as
``cls(job_config, parallel_dims)``; torchtitan calls ``convert(model)`` (in place, before
parallelising) and ``post_optimizer_hook(model)`` after every optimizer step.

:func:`register` registers :class:`LowprecConverter` as ``"lowprec"`` (the recipe named by
a custom job-config section ``[lowprec] recipe = "fp8-delayed"``) and one converter per
float8 recipe as ``"lowprec.<recipe>"``. A converter applies the recipe's *float8
technique* with its per-layer rules and ``float8_skip`` plus torchtitan's output head
``output`` (:func:`lowprec.float8.apply`,
:func:`lowprec.recipes.layers.layer_config`), in place; the recipe's precision policy
(parameter dtype, master weights, loss scaling) is left to torchtitan's own mixed
precision (FSDP2's ``mixed_precision_param``), and recipes that build a new module (unit
scaling, scalify) cannot be in-place converters and are refused.

torchtitan itself is not a dependency and is imported only by :func:`register` without
``register_fn``; ``docs/integrations.md`` says why it does not run in this project's CI.

Example:
    >>> from types import SimpleNamespace
    >>> import torch
    >>> registry = {}
    >>> names = register(lambda cls, name: registry.__setitem__(name, cls))
    >>> "lowprec" in names and "lowprec.fp8-delayed" in names
    True
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    >>> registry["lowprec.fp8-tensorwise"](SimpleNamespace(), None).convert(model)
    >>> [type(m).__name__ for m in model]
    ['Float8Linear', 'Float8Linear']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from torch import nn

import lowprec.float8
from lowprec.float8 import Float8Config
from lowprec.recipes import Recipe, get_recipe, recipe_names
from lowprec.recipes.layers import block_depths, layer_config

# torchtitan's name for the output head (its own float8 converter skips it by default).
TORCHTITAN_HEADS = ("output",)

__all__ = ["TORCHTITAN_HEADS", "LowprecConverter", "converter_for", "float8_recipes", "register"]


def _check(recipe: str | Recipe) -> Recipe:
    r = get_recipe(recipe)
    if r.float8 is None or r.unit is not None or r.scalify is not None:
        raise ValueError(
            f"recipe {r.name!r}: a torchtitan converter applies a float8 technique in place; "
            f"valid: {', '.join(float8_recipes())}"
        )
    return r


def float8_recipes() -> list[str]:
    """The registered recipes a converter can apply: a float8 technique alone."""
    out = []
    for name in recipe_names():
        r = get_recipe(name)
        if r.float8 is not None and r.unit is None and r.scalify is None:
            out.append(name)
    return out


class LowprecConverter:
    """A torchtitan ``ModelConverter`` that applies a lowprec float8 recipe (module
    docstring). The recipe: the class's own (:func:`converter_for`), else the job
    config's ``lowprec.recipe``."""

    recipe: ClassVar[Recipe | None] = None

    def __init__(self, job_config: Any, parallel_dims: Any) -> None:
        r = type(self).recipe
        if r is None:
            name = getattr(getattr(job_config, "lowprec", None), "recipe", None)
            if name is None:
                raise ValueError(
                    "job_config: the 'lowprec' converter reads the recipe from a [lowprec] "
                    "section (recipe = NAME), which is missing; or use 'lowprec.<recipe>'"
                )
            r = name
        self.recipe_used = _check(r)
        self.parallel_dims = parallel_dims

    def convert(self, model: nn.Module) -> None:
        """Swap the model's linears for float8 ones in place, by the recipe's rules."""
        r = self.recipe_used
        default = r.float8
        assert default is not None
        depths = block_depths(model)
        skip = (*r.float8_skip, *TORCHTITAN_HEADS)

        def config(m: nn.Module, fqn: str) -> Float8Config | None:
            return layer_config(r.layers, fqn, default, skip, depths)

        out = lowprec.float8.apply(model, default, config)
        if out is not model:
            raise ValueError("model: a torchtitan model is converted in place, not a lone linear")

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Nothing: lowprec's float8 scalers update their state in the forward and
        backward passes (delayed amax histories included)."""


def converter_for(recipe: str | Recipe) -> type[LowprecConverter]:
    """A :class:`LowprecConverter` class with ``recipe`` fixed."""
    r = _check(recipe)
    return type(f"LowprecConverter_{r.name}", (LowprecConverter,), {"recipe": r})


def register(register_fn: Callable[[type, str], Any] | None = None) -> list[str]:
    """Register ``"lowprec"`` and ``"lowprec.<recipe>"`` for every float8 recipe with
    ``register_fn(cls, name)`` (default: torchtitan's ``register_model_converter``);
    returns the names."""
    if register_fn is None:
        from torchtitan.protocols.model_converter import (  # type: ignore[import-not-found]
            register_model_converter,
        )

        register_fn = register_model_converter
    names = ["lowprec"]
    register_fn(LowprecConverter, "lowprec")
    for name in float8_recipes():
        register_fn(converter_for(name), f"lowprec.{name}")
        names.append(f"lowprec.{name}")
    return names
