"""MoE routers in float8 (:attr:`Float8Config.fp8_router`).

A router that is an ``nn.Linear`` converts as any linear. One that is not — a
``TopKRouter``: a 2-D ``weight`` ``(E, H)``, an optional ``bias``, a forward with its own
softmax and top-k — becomes a :class:`Float8Router`, whose forward is the router's own with
each ``F.linear`` by its weight computed by :meth:`Float8Linear.gemm` (a torch function
mode intercepts it). :func:`lowprec.float8.experts.router_ids` finds the routers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lowprec.core.modes import eager_frames
from lowprec.core.warn import warn_once
from lowprec.float8.carry import _carry_extras, _carry_hooks
from lowprec.float8.config import Float8Config
from lowprec.float8.linear import Float8Linear

__all__ = ["Float8Router"]

log = logging.getLogger(__name__)


@eager_frames
class _RouterLinear(TorchFunctionMode):
    """Computes each ``F.linear(x, w, b)`` with ``w`` of the router's weight shape by the
    router's float8 GEMM."""

    def __init__(self, layer: Float8Router) -> None:
        super().__init__()
        self.layer, self.hit = layer, False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(w, Tensor) and w.shape == self.layer.weight.shape:
                self.hit = True
                y = self.layer.gemm(x, w)
                return y if b is None else y + b.to(y.dtype)
        return func(*args, **kwargs)


class Float8Router(Float8Linear):
    """A router module that is not an ``nn.Linear`` (a ``TopKRouter``: 2-D ``weight``
    ``(E, H)``, optional ``bias``, a forward with its own softmax and top-k) with its
    ``F.linear`` in float8 (module docstring).

    :meth:`from_router` builds an instance of a subclass of both this class and the
    router's class (``Float8<Router>``), holding the router's parameters, buffers and
    attributes: code that finds routers by class (transformers' ``OutputRecorder`` of the
    router logits, which the load-balancing loss reads) still finds it. Its forward is
    the router's own, with each ``F.linear`` by the router's weight computed by
    :meth:`Float8Linear.gemm`.
    """

    _router_cls: type[nn.Module] = nn.Module

    @classmethod
    def from_router(cls, mod: nn.Module, recipe: str | Float8Config) -> Float8Router:
        w = getattr(mod, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 2:
            raise TypeError(f"mod: a router needs a 2-D weight, got {type(mod).__name__}")
        b = mod._parameters.get("bias")
        sub = _subclass(type(mod))
        new = sub.__new__(sub)
        nn.Module.__init__(new)  # the router's own __init__ needs its model config
        new.in_features, new.out_features = w.shape[1], w.shape[0]
        new.weight = w
        new.register_parameter("bias", b)
        new._setup(recipe)
        new.train(mod.training)
        _carry_hooks(mod, new)
        _carry_extras(mod, new, {"weight", "bias"})
        for k, v in mod.__dict__.items():  # plain attributes (top_k, num_experts, ...)
            if not k.startswith("_") and k not in new.__dict__ and k != "training":
                new.__dict__[k] = v
        object.__setattr__(new, "_lowprec_original", mod)
        return new

    def to_router(self) -> nn.Module:
        """The original router, holding this module's parameters."""
        orig: nn.Module = self.__dict__["_lowprec_original"]
        own = orig._parameters
        own.update({n: p for n, p in self._parameters.items() if n in own})
        orig.train(self.training)
        return orig

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mode = _RouterLinear(self)
        with mode:
            out = self._router_cls.forward(self, *args, **kwargs)
        if not mode.hit:
            warn_once(
                log,
                f"float8:router:{self._router_cls.__name__}",
                "float8: %s computes no F.linear with its weight; its GEMM stays in high precision",
                self._router_cls.__name__,
            )
        return out


_SUBCLASSES: dict[type[nn.Module], type[Float8Router]] = {}


def _subclass(router_cls: type[nn.Module]) -> type[Float8Router]:
    """``Float8<Router>``: a subclass of :class:`Float8Router` and ``router_cls`` (cached)."""
    sub = _SUBCLASSES.get(router_cls)
    if sub is None:
        name = f"Float8{router_cls.__name__}"
        sub = type(name, (Float8Router, router_cls), {"_router_cls": router_cls})
        _SUBCLASSES[router_cls] = sub
    return sub
