"""``scalify``: run a standard module or function in scaled arithmetic.

The wrapped call (1) makes its config active, (2) turns every floating-point input and
parameter into a scalify ``ScaledTensor`` (scale ``max |x|``, data in the config's
format), (3) runs the *unchanged* model code, whose aten ops go through the rules, and
(4) returns plain tensors (``d·s``). In backward the output gradients enter as scaled
gradients, propagate by the rules, and leave as plain tensors of each parameter's dtype
in ``.grad``. Parameters stay what they were (the FP32 master copy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar, overload

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lowprec.core.tensor import ScaledTensor
from lowprec.scalify import rules as _rules  # noqa: F401  (registers the rules)
from lowprec.scalify import rules_nn as _rules_nn  # noqa: F401
from lowprec.scalify.config import ScalifyConfig, set_config
from lowprec.scalify.ops import as_scaled, unscale

__all__ = ["Scalified", "resolve_config", "scalify"]

_POLICIES: dict[str, dict[str, Any]] = {
    "static": {"rescale": "none"},
    "dynamic": {"rescale": "max", "pow2": "up"},
    "dynamic-l2": {"rescale": "l2", "pow2": "up"},
}
F = TypeVar("F", bound=Callable[..., Any])


def resolve_config(data_format: str | None, policy: str | ScalifyConfig) -> ScalifyConfig:
    """The config of ``scalify(..., data_format, policy)``: ``policy`` is a
    :class:`ScalifyConfig` or ``"static"`` (scales only propagate), ``"dynamic"`` (each
    op's output rescaled by its max, power-of-two up) or ``"dynamic-l2"`` (by its RMS)."""
    if isinstance(policy, ScalifyConfig):
        return policy if data_format is None else replace(policy, data_format=data_format)
    if policy not in _POLICIES:
        raise ValueError(f"unknown scalify policy {policy!r}; valid: {sorted(_POLICIES)}")
    return ScalifyConfig(data_format=data_format or "fp16", **_POLICIES[policy])


def _enter(x: Any) -> Any:
    if isinstance(x, Tensor) and not isinstance(x, ScaledTensor) and x.is_floating_point():
        return as_scaled(x)
    return x


def _leave(x: Any) -> Any:
    return unscale(x) if isinstance(x, ScaledTensor) else x


class Scalified(nn.Module):
    """``module`` run in scaled arithmetic (see :func:`scalify`). The original module is
    ``self.module``: state_dict keys gain the prefix ``"module."``."""

    def __init__(self, module: nn.Module, config: ScalifyConfig) -> None:
        super().__init__()
        self.module = module
        self.config = config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        set_config(self.config)
        params: dict[str, Tensor] = {n: as_scaled(p) for n, p in self.module.named_parameters()}
        args, kwargs = tree_map(_enter, (args, kwargs))
        out = torch.func.functional_call(self.module, params, args, kwargs, strict=False)
        return tree_map(_leave, out)

    def extra_repr(self) -> str:
        return f"config={self.config}"


@overload
def scalify(
    obj: nn.Module, data_format: str | None = ..., policy: str | ScalifyConfig = ...
) -> Scalified: ...
@overload
def scalify(obj: F, data_format: str | None = ..., policy: str | ScalifyConfig = ...) -> F: ...
def scalify(
    obj: Any, data_format: str | None = "fp16", policy: str | ScalifyConfig = "static"
) -> Any:
    """Run ``obj`` (an ``nn.Module`` or a function of tensors) in scaled arithmetic.

    Same signature and output structure as ``obj``; outputs are plain tensors equal to the
    original's up to the rounding of the data format (``"fp16"``, ``"bf16"``, ``"fp32"``,
    or ``"fp8"``: FP8 matmul inputs, FP16 elsewhere). A module is wrapped in
    :class:`Scalified` (state_dict prefix ``"module."``), its parameters untouched.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 2)
        >>> x = torch.randn(3, 4) * 2.0**40  # far beyond FP16's range
        >>> y = scalify(lin, "fp16")(x)
        >>> bool(torch.allclose(y, lin(x), rtol=1e-2))
        True
    """
    cfg = resolve_config(data_format, policy)
    if isinstance(obj, nn.Module):
        return Scalified(obj, cfg)
    if not callable(obj):
        raise TypeError(f"obj must be an nn.Module or a callable, got {type(obj).__name__}")

    @functools.wraps(obj)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        set_config(cfg)
        args, kwargs = tree_map(_enter, (args, kwargs))
        return tree_map(_leave, obj(*args, **kwargs))

    return wrapped
