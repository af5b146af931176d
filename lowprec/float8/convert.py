"""Converting a model: every ``nn.Linear`` to a :class:`~lowprec.float8.Float8Linear` and back.

``apply(model, config)`` is the float8 technique's entry point.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn
from torch.nn.utils import parametrize

from lowprec.float8.linear import Float8Linear
from lowprec.float8.recipe import Float8Recipe

__all__ = ["ModuleFilter", "apply", "convert_back", "convert_to_float8"]

log = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]


def convert_to_float8(
    model: nn.Module,
    recipe: str | Float8Recipe = "tensorwise",
    module_filter: ModuleFilter | None = None,
) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for a :class:`Float8Linear`.

    ``module_filter(module, fqn)`` returns True for the layers to convert (default: all).
    A linear used at several places becomes one ``Float8Linear`` used at all of them; its
    hooks carry over. Subclasses of ``nn.Linear`` and parametrized linears (e.g.
    ``weight_norm``) are left unchanged, named in a warning: their own forward would be lost.
    Returns ``model`` (or the new module if ``model`` itself is an ``nn.Linear``).

    Example:
        >>> import torch
        >>> nn = torch.nn
        >>> m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> m = convert_to_float8(m, "delayed", module_filter=lambda mod, fqn: fqn != "2")
        >>> [type(c).__name__ for c in m]
        ['Float8Linear', 'ReLU', 'Linear']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(recipe, str):
        recipe = Float8Recipe.from_name(recipe)
    if not isinstance(recipe, Float8Recipe):
        raise TypeError(f"recipe must be a Float8Recipe or name, got {type(recipe).__name__}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError("module_filter must be a callable (module, fqn) -> bool")

    left: list[str] = []

    def wanted(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear) or isinstance(mod, Float8Linear):
            return False
        if module_filter is not None and not module_filter(mod, fqn):
            return False
        if type(mod) is not nn.Linear or parametrize.is_parametrized(mod):
            left.append(f"{fqn or 'the model'} ({type(mod).__name__})")
            return False  # its own forward or parametrization would be lost
        if not mod.weight.dtype.is_floating_point:
            raise TypeError(
                f"model: {fqn or 'the model'}.weight has dtype {mod.weight.dtype}; float8 "
                "conversion needs floating-point weights"
            )
        return True

    if wanted(model, ""):
        assert isinstance(model, nn.Linear)
        return Float8Linear.from_linear(model, recipe)
    done: dict[int, Float8Linear] = {}
    _convert_children(model, wanted, done, recipe)
    if left:
        log.warning(
            "convert_to_float8: left unchanged (nn.Linear subclasses or parametrized "
            "linears, whose own forward would be lost): %s",
            ", ".join(dict.fromkeys(left)),
        )
    return model


def apply(
    model: nn.Module,
    config: str | Float8Recipe = "tensorwise",
    module_filter: ModuleFilter | None = None,
) -> nn.Module:
    """The float8 technique's entry point: :func:`convert_to_float8` with ``config`` (a
    :class:`~lowprec.float8.Float8Recipe` or a preset name, see :func:`recipe_names`).

    Example:
        >>> import torch
        >>> m = apply(torch.nn.Sequential(torch.nn.Linear(32, 32)), "rowwise")
        >>> type(m[0]).__name__, m[0].recipe.name
        ('Float8Linear', 'rowwise')
    """
    return convert_to_float8(model, config, module_filter)


def _convert_children(
    model: nn.Module,
    wanted: Callable[[nn.Module, str], bool],
    done: dict[int, Float8Linear],
    recipe: Float8Recipe,
) -> None:  # a module used at several places stays one module
    for fqn, mod in list(model.named_modules(remove_duplicate=False)):
        for name, child in list(mod._modules.items()):
            full = f"{fqn}.{name}" if fqn else name
            if child is None:
                continue
            if id(child) in done:
                setattr(mod, name, done[id(child)])
            elif wanted(child, full):
                assert isinstance(child, nn.Linear)
                done[id(child)] = Float8Linear.from_linear(child, recipe)
                setattr(mod, name, done[id(child)])


def convert_back(model: nn.Module) -> nn.Module:
    """Replace every :class:`Float8Linear` by a plain ``nn.Linear`` sharing its parameters
    (the scaling state is dropped). Returns ``model`` (or the new module)."""

    def plain(m: Float8Linear) -> nn.Linear:
        new = nn.Linear(m.in_features, m.out_features, m.bias is not None, device="meta")
        new.weight, new.bias = m.weight, m.bias
        new.train(m.training)
        return new

    if isinstance(model, Float8Linear):
        return plain(model)
    done: dict[int, nn.Linear] = {}
    for mod in list(model.modules(remove_duplicate=False)):
        for name, child in list(mod._modules.items()):
            if isinstance(child, Float8Linear):
                if id(child) not in done:
                    done[id(child)] = plain(child)
                setattr(mod, name, done[id(child)])
    return model
