"""Recipes: named, serialisable descriptions of how a model is trained.

A :class:`Recipe` is a precision :class:`Policy` (parameter dtype, compute dtype through
autocast, FP32 master weights, loss scaling, stochastic rounding of the write-back) plus
optional technique configs: :class:`~lowprec.float8.Float8Config`,
:class:`~lowprec.unit.UnitConfig`, :class:`~lowprec.scalify.ScalifyConfig`, or unit +
float8 together (:mod:`~lowprec.recipes.compose` says which combinations are accepted and
why the others are refused). :func:`prepare` applies a recipe to any ``nn.Module`` and
returns what a training loop needs (:class:`Prepared`).

Modules: :mod:`~lowprec.recipes.policy` (``Policy``), :mod:`~lowprec.recipes.recipe`
(``Recipe``, ``to_dict``/``from_dict``), :mod:`~lowprec.recipes.compose` (composition
rules and application), :mod:`~lowprec.recipes.serial` (configs to JSON),
:mod:`~lowprec.recipes.presets` (the named recipes), :mod:`~lowprec.recipes.prepared`
(``prepare``, ``Prepared``).

Adding a recipe takes one call::

    register(Recipe("fp16-ls-1024", "FP16, static loss scale 1024",
                    Policy("fp16", master_weights=True, loss_scaling="static",
                           loss_scale=1024.0)))

Example:
    >>> r = get_recipe("fp8-rowwise")
    >>> r.kind, r.param_dtype, r.float8.name
    ('float8', 'bf16', 'rowwise')
"""

from lowprec.recipes.compose import TechniqueConfig
from lowprec.recipes.policy import Policy
from lowprec.recipes.prepared import OptimizerFactory, Prepared, prepare
from lowprec.recipes.presets import get_recipe, recipe_names, register
from lowprec.recipes.recipe import Recipe

__all__ = [
    "OptimizerFactory",
    "Policy",
    "Prepared",
    "Recipe",
    "TechniqueConfig",
    "get_recipe",
    "prepare",
    "recipe_names",
    "register",
]
