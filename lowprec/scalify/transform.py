"""``scalify``: run a standard module or function in scaled arithmetic.

The wrapped call (1) pushes its config on the calling thread's stack for the forward,
(2) turns every floating-point input and parameter into a scalify ``ScaledTensor`` (scale
``max |x|``, data in the config's format) that records the config, (3) runs the
*unchanged* model code, whose aten ops go through the rules, and (4) pops the config and
returns plain tensors (``d·s``). In backward the output gradients enter as scaled
gradients recording the same config, propagate by the rules (each run under that config,
see :mod:`lowprec.scalify.domains`), and leave as plain tensors of each parameter's dtype in
``.grad``. Parameters stay what they were (the FP32 master copy).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch
from torch import Tensor, nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves

from lowprec.core.modes import checkpointed_layer
from lowprec.core.registry import Registry
from lowprec.core.tensor import ScaledTensor
from lowprec.core.warn import warn_once
from lowprec.scalify import fallback as _fallback  # noqa: F401  (registers the rules)
from lowprec.scalify import rules as _rules  # noqa: F401
from lowprec.scalify import rules_attn as _rules_attn  # noqa: F401
from lowprec.scalify import rules_moe as _rules_moe  # noqa: F401
from lowprec.scalify import rules_nn as _rules_nn  # noqa: F401
from lowprec.scalify.config import ScalifyConfig, pop, push
from lowprec.scalify.core import compiling
from lowprec.scalify.domains import record
from lowprec.scalify.ops import enter, unscale
from lowprec.scalify.structures import convert

__all__ = ["POLICIES", "Scalified", "resolve_config", "scalify"]

POLICIES: Registry[ScalifyConfig] = Registry("scalify policy", ScalifyConfig)
POLICIES.add("static", rescale="none", description="scales only propagate")
POLICIES.add("dynamic", rescale="max", pow2="up", description="each op's output by its max")
POLICIES.add("dynamic-l2", rescale="l2", pow2="up", description="each op's output by its RMS")
F = TypeVar("F", bound=Callable[..., Any])
_log = logging.getLogger(__name__)


def resolve_config(data_format: str | None, policy: str | ScalifyConfig) -> ScalifyConfig:
    """The config of ``scalify(..., data_format, policy)``: ``policy`` is a
    :class:`ScalifyConfig` or ``"static"`` (scales only propagate), ``"dynamic"`` (each
    op's output rescaled by its max, power-of-two up) or ``"dynamic-l2"`` (by its RMS);
    ``data_format`` (``None``: ``"fp16"``, or the config's own) the data format. A config
    is used as given: a ``data_format`` that differs from its own raises ``ValueError``
    (it is never silently replaced)."""
    if isinstance(policy, ScalifyConfig):
        if data_format is not None and data_format != policy.data_format:
            raise ValueError(
                f"data_format={data_format!r} conflicts with the config's data_format="
                f"{policy.data_format!r}; give one of them (the config alone, or a policy name)"
            )
        return policy
    return POLICIES.get(policy, data_format=data_format or "fp16")


def _run(cfg: ScalifyConfig, key: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with floating inputs entering scaled arithmetic under
    ``cfg`` (recorded as ``key``), ``cfg`` pushed for the call (eagerly: a compiled graph
    needs no push, its tensors carry the key) and plain outputs. Tensors inside objects
    (a KV cache passed in, updated in place and returned) enter and leave too, see
    :mod:`lowprec.scalify.structures`: after the call no object reachable from the inputs
    or outputs holds a ScaledTensor."""

    def into(x: Tensor) -> Tensor:
        if not isinstance(x, ScaledTensor) and x.is_floating_point():
            return enter(x, key)
        return x

    def call() -> Any:
        try:
            res = fn(*convert(args, into), **convert(kwargs, into))
            return convert(res, _leave)
        finally:
            convert((args, kwargs), _leave)  # caches passed in and not returned

    if compiling():
        return call()
    push(cfg)
    try:
        return call()
    finally:
        pop()


def _check_inputs(args: Any, kwargs: Any) -> None:
    """``TypeError`` naming the input for a complex tensor (scaled arithmetic is real).
    Integer and bool inputs pass through unchanged (indices, masks): ops use them as
    torch does, and a matmul of one raises ``TypeError`` (see the rules)."""
    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, Tensor) and leaf.is_complex():
            where = keystr(path[1:]) if path else ""
            side = "args" if path and getattr(path[0], "idx", 0) == 0 else "kwargs"
            raise TypeError(
                f"{side}{where}: complex tensors are not supported by scalify, got {leaf.dtype}"
            )


def _fsdp_types() -> tuple[type, ...]:
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FSDPModule, FullyShardedDataParallel)


_FSDP = _fsdp_types()


def _check_not_sharded_inside(module: nn.Module) -> None:
    """``TypeError`` if FSDP shards a module inside a :class:`Scalified` (see
    docs/scalify.md, "Distributed"): its pre-forward hook would gather the parameters
    after scalify took them and replace them by plain tensors, which then skip scaled
    arithmetic. ``fully_shard(scalify(model))`` (the wrapper as FSDP's root) is fine."""
    if not _FSDP:
        return
    for name, m in module.named_modules():
        if isinstance(m, _FSDP):
            where = f"module {name!r} ({type(m).__name__})" if name else "the wrapped model"
            raise TypeError(
                f"scalify: {where} is sharded by FSDP (fully_shard) inside a Scalified "
                "wrapper: FSDP would gather its parameters after scalify takes them, so "
                "they would skip scaled arithmetic. Shard the wrapper itself instead: "
                "fully_shard(scalify(model)) (one FSDP unit), or use DDP"
            )


def _check_not_tensor_parallel(module: nn.Module) -> None:
    """``TypeError`` naming the first parameter that is a DTensor when the wrapped model
    runs (tensor parallelism: ``ColwiseParallel`` and the like, which FSDP2 as the
    wrapper's root never leaves behind): scaled arithmetic computes on plain tensors."""
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            raise TypeError(
                f"scalify: parameter {name!r} is a DTensor (placements {tuple(p.placements)}): "
                "tensor parallelism is not supported under scalify, whose scaled arithmetic "
                "runs on plain tensors. Use FSDP2 (fully_shard(scalify(model))) or DDP, or "
                "a float8 or unit-scaling recipe under tensor parallelism"
            )


def _check_no_checkpointing(module: nn.Module) -> None:
    """``TypeError`` naming the first module with activation checkpointing on (HF's
    ``gradient_checkpointing_enable()`` sets ``gradient_checkpointing = True`` on its
    layers): its forward is recomputed in backward after scalify has handed the
    parameters back, so the recomputed part would skip scaled arithmetic (with FP8 data
    the gradients differed from the uncheckpointed ones by 16%)."""
    name = checkpointed_layer(module)
    if name is not None:
        m = module if name == "<root>" else module.get_submodule(name)
        raise TypeError(
            f"scalify: module {name!r} ({type(m).__name__}) has gradient "
            "checkpointing on: its forward would be recomputed in backward outside "
            "scaled arithmetic. Turn it off (model.gradient_checkpointing_disable())"
        )


def _leave(x: Tensor) -> Tensor:
    return unscale(x) if isinstance(x, ScaledTensor) else x


_INNER = "module."


def _strip_prefix(
    mod: nn.Module, state: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """state_dict post-hook: ``prefix + "module." + k`` becomes ``prefix + k`` (in order),
    and the inner modules' metadata (versions) move with their keys."""
    inner = prefix + _INNER
    keys = [k for k in state if k.startswith(inner)]
    for k in keys:
        state[prefix + k[len(inner) :]] = state.pop(k)
    meta = getattr(state, "_metadata", None)
    if meta is not None:
        for k in [k for k in meta if k == inner[:-1] or k.startswith(inner)]:
            meta[(prefix + k[len(inner) :]) if k != inner[:-1] else prefix[:-1]] = meta.pop(k)


def _add_prefix(
    mod: nn.Module, state: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    """load_state_dict pre-hook: the wrapped model's keys ``prefix + k`` load into
    ``self.module``; keys already written ``prefix + "module." + k`` (checkpoints from
    before keys were kept) load as they are."""
    assert isinstance(mod, Scalified)
    own = set(mod.module.state_dict().keys())
    inner = prefix + _INNER
    for k in [k for k in state if k.startswith(prefix)]:
        rest = k[len(prefix) :]
        if rest in own or not (rest.startswith(_INNER) and rest[len(_INNER) :] in own):
            state[inner + rest] = state.pop(k)
    meta = getattr(state, "_metadata", None)
    if meta is not None:  # module versions, keyed by module name: the inner names too
        for k in list(meta):
            if k == prefix[:-1] or (k.startswith(prefix) and not k.startswith(inner)):
                rest = "" if k == prefix[:-1] else k[len(prefix) :]
                meta.setdefault(inner + rest if rest else inner[:-1], meta[k])


class Scalified(nn.Module):
    """``module`` run in scaled arithmetic (see :func:`scalify`). The original module is
    ``self.module``; ``state_dict()`` has the original's keys (no ``"module."`` prefix),
    and ``load_state_dict`` takes them (or, from older checkpoints, the prefixed ones).
    ``named_parameters()`` names them ``"module." + name``."""

    def __init__(self, module: nn.Module, config: ScalifyConfig) -> None:
        super().__init__()
        if not isinstance(config, ScalifyConfig):
            raise TypeError(f"config must be a ScalifyConfig, got {type(config).__name__}")
        self.module = module
        self.config = config
        self._key = record(config)
        self.register_state_dict_post_hook(_strip_prefix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_prefix)  # type: ignore[no-untyped-call]

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled (in another process, say): register the config's domains there too."""
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        record(self.config)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _check_inputs(args, kwargs)
        _check_not_sharded_inside(self.module)
        _check_not_tensor_parallel(self.module)
        _check_no_checkpointing(self.module)
        params = dict(self.module.named_parameters())

        def call(params: dict[str, Tensor], *args: Any, **kwargs: Any) -> Any:
            return torch.func.functional_call(self.module, params, args, kwargs, strict=False)

        return _run(self.config, self._key, call, (params, *args), kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's ``generate`` (HF transformers) with every forward it makes
        in scaled arithmetic (through this wrapper, KV cache included); ``AttributeError``
        if the wrapped model has none. Calling ``self.module.generate`` instead would run
        the model unscaled."""
        inner = self.module
        gen = getattr(inner, "generate", None)
        if not callable(gen):
            raise AttributeError(f"{type(inner).__name__} has no generate()")
        own = inner.__dict__.get("forward")
        original = inner.forward

        def scaled(*a: Any, **k: Any) -> Any:
            inner.forward = original  # the wrapper calls the model's own forward
            try:
                return self(*a, **k)
            finally:
                inner.forward = scaled

        inner.forward = scaled
        try:
            return gen(*args, **kwargs)
        finally:
            if own is None:
                del inner.forward
            else:
                inner.forward = own

    def extra_repr(self) -> str:
        return f"config={self.config}"


def run_scalified(obj: Any, cfg: ScalifyConfig) -> Any:
    """``obj`` (a module: :class:`Scalified`; a function of tensors: a wrapped function)
    run in scaled arithmetic under ``cfg`` — the body of :func:`lowprec.scalify.apply`."""
    if isinstance(obj, nn.Module):
        return Scalified(obj, cfg)
    if not callable(obj):
        raise TypeError(f"obj must be an nn.Module or a callable, got {type(obj).__name__}")
    key = record(cfg)

    @functools.wraps(obj)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _check_inputs(args, kwargs)
        if isinstance(getattr(obj, "__self__", None), nn.Module) and not any(
            isinstance(t, Tensor) and t.is_floating_point() for t in tree_leaves((args, kwargs))
        ):
            warn_once(
                _log, "scalify:no-float-inputs",
                "scalify: %s got no floating-point tensor, and the parameters of its module "
                "are not scaled when a bound method is wrapped: nothing runs in scaled "
                "arithmetic. Wrap the module instead (scalify(model); scalify(model)"
                ".generate(...) for HF generation)", getattr(obj, "__qualname__", obj),
            )  # fmt: skip
        return _run(cfg, key, obj, args, kwargs)

    return wrapped


@overload
def scalify(
    obj: nn.Module, data_format: str | None = ..., policy: str | ScalifyConfig = ...
) -> Scalified: ...
@overload
def scalify(obj: F, data_format: str | None = ..., policy: str | ScalifyConfig = ...) -> F: ...
def scalify(
    obj: Any, data_format: str | None = None, policy: str | ScalifyConfig = "static"
) -> Any:
    """Alias of :func:`lowprec.scalify.apply` by data format and policy:
    ``apply(obj, resolve_config(data_format, policy))`` (see :func:`resolve_config`;
    ``data_format`` ``None`` is ``"fp16"``, or a config's own).

    Runs ``obj`` (an ``nn.Module`` or a function of tensors) in scaled arithmetic: same
    signature and output structure as ``obj``; outputs are plain tensors equal to the
    original's up to the rounding of the data format (``"fp16"``, ``"bf16"``, ``"fp32"``,
    or ``"fp8"``: FP8 matmul inputs, FP16 elsewhere). A module is wrapped in
    :class:`Scalified` (same state_dict keys as ``obj``), its parameters untouched.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 2)
        >>> x = torch.randn(3, 4) * 2.0**40  # far beyond FP16's range
        >>> y = scalify(lin, "fp16")(x)
        >>> bool(torch.allclose(y, lin(x), rtol=1e-2))
        True
    """
    return run_scalified(obj, resolve_config(data_format, policy))
