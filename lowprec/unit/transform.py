"""``unit_scale(model)``: turn a standard PyTorch model into its unit-scaled equivalent.

Three mechanisms, each doing what it is good at:

1. **Weights** are re-initialised to unit variance in place on a deep copy (``nn.Linear``,
   ``nn.Embedding``, ``nn.Conv1d`` weights ``N(0, 1)``, biases 0, norm gains 1).
2. **Residual adds** are found with ``torch.fx``: every module is traced on its own, its
   children kept as leaves; an ``add(a, b)`` where ``a`` is an ancestor of ``b`` is a
   residual (``b = f(a)``). It becomes ``residual_split`` at the branch point and
   ``residual_add`` with the branch's ``τ`` (a module that cannot be traced, e.g. because
   of a Python ``if`` on a shape, is left as it is and recorded in ``unit_report``; its adds
   stay plain adds — in ``CharGPT`` only the token + position embedding sum).
3. **Ops** are converted at run time by a ``TorchFunctionMode`` entered in the model's
   ``forward`` (the root's class is swapped for a subclass doing that, so the signature,
   outputs and ``state_dict`` keys are unchanged): ``F.linear``, ``matmul``/``@``/``bmm``/
   ``mm``, ``F.embedding``, ``F.layer_norm``, ``F.rms_norm``, ``gelu``, ``relu``, ``silu``,
   ``softmax``, ``log_softmax``, ``F.cross_entropy`` (forward value unchanged),
   ``F.scaled_dot_product_attention``, ``F.dropout``, ``F.conv1d`` become the
   :mod:`lowprec.unit.functional` ops. Functions like ``lowprec.amp.softmax_fp32`` are
   covered through the torch ops they call. The readout (by default the last
   ``nn.Linear``) gets μP's extra forward ``1/√fan_in`` (a forward hook).

Ops with no unit rule (``conv2d``, ``batch_norm``, ``tanh``, ...) run unchanged: modules of
unsupported types are named in a WARNING at transform time, functions at their first call
(``strict=True`` raises ``NotImplementedError`` instead). Constant multiplies (``x * c``)
are kept as they are: CharGPT's ``q kᵀ·d^-½`` after the unit matmul's own ``d^-½`` gives
u-μP's ``1/d`` attention-logit scale.

``float8=True``: every matmul (``F.linear``, ``matmul``) but the readout's rounds its operands
to E4M3 and the gradient flowing into its output to E5M2, saturating, with no scales (the
paper's setting). The readout stays in the model's dtype unless ``UnitConfig.float8_readout``,
as the float8 recipes keep the head in BF16: the logits feed the softmax and the loss
directly, so the readout is the matmul most sensitive to FP8 rounding (its cost:
``docs/unit-scaling.md``).
"""

from __future__ import annotations

import copy
import logging
import math
import operator
import types
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.overrides import TorchFunctionMode

from lowprec.core.warn import warn_once
from lowprec.unit import functional as U
from lowprec.unit.config import UnitConfig
from lowprec.unit.core import scale_fwd

__all__ = ["UnitConfig", "unit_scale"]

log = logging.getLogger("lowprec.unit")


# ---- the op-converting mode --------------------------------------------------------------

_UNIT_OPS: dict[Any, Callable[..., Any]] = {}
for _name in dir(U):
    _f = getattr(U, _name)
    if callable(_f) and hasattr(_f, "__wrapped__"):
        _UNIT_OPS[_f] = _f.__wrapped__
_UNIT_OPS[scale_fwd] = scale_fwd.__wrapped__  # type: ignore[attr-defined]

_MATMUL = {torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm, torch.mm,
           Tensor.mm}  # fmt: skip
_SOFTMAX = {torch.softmax, F.softmax, Tensor.softmax}
_LOG_SOFTMAX = {torch.log_softmax, F.log_softmax, Tensor.log_softmax}
_RELU = {F.relu, torch.relu, Tensor.relu}
_NO_RULE = {
    F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.batch_norm, F.group_norm,
    F.instance_norm, torch.einsum, torch.baddbmm, torch.addmm, F.bilinear, torch.tanh,
    torch.sigmoid, F.sigmoid, F.tanh, F.softplus, F.elu, F.leaky_relu, F.mish, F.hardswish,
    F.glu, F.mse_loss, F.nll_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
    F.multi_head_attention_forward, F.normalize, torch.exp,
}  # fmt: skip


def _ce(cfg: UnitConfig, x: Tensor, target: Tensor, weight: Any = None, size_average: Any = None,
        ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
        label_smoothing: float = 0.0) -> Tensor:  # fmt: skip
    if weight is not None or size_average is not None or reduce is not None:
        raise ValueError("cross_entropy: weight, size_average and reduce are not supported")
    if label_smoothing != 0.0 or ignore_index != -100:
        raise ValueError("cross_entropy: label_smoothing and ignore_index are not supported")
    return cast(Tensor, _UNIT_OPS[U.cross_entropy](x, target, reduction))


def _embedding(cfg: UnitConfig, idx: Tensor, w: Tensor, padding_idx: Any = None,
               max_norm: Any = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
               sparse: bool = False) -> Tensor:  # fmt: skip
    if padding_idx is not None or max_norm is not None or scale_grad_by_freq or sparse:
        raise ValueError(
            "embedding: padding_idx, max_norm, scale_grad_by_freq and sparse are not supported"
        )
    return cast(Tensor, _UNIT_OPS[U.embedding](idx, w))


def _softmax(cfg: UnitConfig, x: Tensor, dim: int | None = None, _stacklevel: int = 3,
             dtype: torch.dtype | None = None) -> Tensor:  # fmt: skip
    if dim is None:
        raise ValueError("softmax: dim must be given")
    x = x if dtype is None else x.to(dtype)
    return cast(Tensor, _UNIT_OPS[U.softmax](x, dim, mult=cfg.softmax_mult))


def _log_softmax(cfg: UnitConfig, x: Tensor, dim: int | None = None, _stacklevel: int = 3,
                 dtype: torch.dtype | None = None) -> Tensor:  # fmt: skip
    if dim is None:
        raise ValueError("log_softmax: dim must be given")
    return cast(Tensor, _UNIT_OPS[U.log_softmax](x if dtype is None else x.to(dtype), dim))


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, (tuple, list)) else v


def _handle(cfg: UnitConfig, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    if func in _UNIT_OPS:
        return _UNIT_OPS[func](*args, **kw)
    if func is F.linear:
        return _UNIT_OPS[U.linear](*args, **kw, float8=cfg.float8)
    if func in _MATMUL and not kw:
        return _UNIT_OPS[U.matmul](args[0], args[1], float8=cfg.float8)
    if func is F.embedding:
        return _embedding(cfg, *args, **kw)
    if func is F.layer_norm:
        return _UNIT_OPS[U.layer_norm](*args, **kw)
    if func is F.rms_norm:
        return _UNIT_OPS[U.rms_norm](*args, **kw)
    if func is F.gelu:
        approximate = kw.get("approximate", args[1] if len(args) > 1 else "none")
        return _UNIT_OPS[U.gelu](args[0], approximate, mult=cfg.act_mult)
    if func is F.silu:
        return _UNIT_OPS[U.silu](args[0], mult=cfg.act_mult)
    if func in _RELU:
        return _UNIT_OPS[U.relu](args[0])
    if func in _SOFTMAX:
        return _softmax(cfg, *args, **kw)
    if func in _LOG_SOFTMAX:
        return _log_softmax(cfg, *args, **kw)
    if func is F.cross_entropy:
        return _ce(cfg, *args, **kw)
    if func is F.scaled_dot_product_attention:
        return _UNIT_OPS[U.scaled_dot_product_attention](*args, **kw)
    if func is F.dropout:
        if kw.get("inplace", len(args) > 3 and args[3]):
            raise ValueError("dropout: inplace=True is not supported")
        return _UNIT_OPS[U.dropout](*args[:3], **{k: v for k, v in kw.items() if k != "inplace"})
    if func is F.conv1d:
        a = list(args) + [None] * (7 - len(args))
        x, w, b, stride, padding, dilation, groups = a
        return _UNIT_OPS[U.conv1d](
            x, w, b, _first(stride or 1), _first(padding or 0), _first(dilation or 1), groups or 1
        )
    if func in _NO_RULE and not torch.compiler.is_compiling():
        name = getattr(func, "__qualname__", repr(func))
        if cfg.strict:
            raise NotImplementedError(f"unit_scale: {name} has no unit-scaling rule")
        warn_once(
            log,
            f"unit:no-rule:{name}",
            "unit_scale: %s has no unit-scaling rule; it runs unchanged",
            name,
        )
    return func(*args, **kw)


class _UnitMode(TorchFunctionMode):
    """Converts standard ops to unit-scaled ones (see the module doc)."""

    def __init__(self, cfg: UnitConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return _handle(self.cfg, func, args, kwargs or {})


def _unit_forward_class(cls: type[nn.Module]) -> type[nn.Module]:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with _UnitMode(cast(UnitConfig, self._unit_config)):
            return super(new_cls, self).forward(*args, **kwargs)  # type: ignore[arg-type]

    attrs = {"forward": forward, "__module__": cls.__module__}
    new_cls = type(f"Unit{cls.__name__}", (cls,), attrs)
    return new_cls


# ---- residual adds (torch.fx) ------------------------------------------------------------


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


_ADDS = {operator.add, torch.add, operator.iadd}


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _find_residuals(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """``(add, skip, branch_out)`` of every residual add in ``graph``, in order."""
    found = []
    for n in graph.nodes:
        is_add = (n.op == "call_function" and n.target in _ADDS) or (
            n.op == "call_method" and n.target in ("add", "__add__")
        )
        if not is_add or len(n.args) != 2 or n.kwargs:
            continue
        a, b = n.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            continue
        if a in _ancestors(b):
            found.append((n, a, b))
        elif b in _ancestors(a):
            found.append((n, b, a))
    return found


def _rewrite_residual(
    graph: fx.Graph, add: fx.Node, skip: fx.Node, out: fx.Node, tau: float
) -> None:
    branch = _ancestors(out) | {out}
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((u for u in skip.users if u in branch), key=order.__getitem__)
    with graph.inserting_before(first):
        split = graph.call_function(U.residual_split, (skip, tau))
        res_in = graph.call_function(operator.getitem, (split, 0))
        skip_out = graph.call_function(operator.getitem, (split, 1))
    for user in list(skip.users):
        if user in branch:
            user.replace_input_with(skip, res_in)
    add.target, add.op = U.residual_add, "call_function"
    add.args, add.kwargs = (out, skip_out, tau), {}


# ---- the transform -----------------------------------------------------------------------

_PARAM_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Conv1d)


def _reinit(model: nn.Module) -> list[str]:
    """Unit-variance init; returns the names of modules whose own parameters are untouched."""
    left = []
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d)):
                nn.init.normal_(m.weight)
                if isinstance(getattr(m, "bias", None), Tensor):
                    nn.init.zeros_(cast(Tensor, m.bias))
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                if m.weight is not None:
                    nn.init.ones_(m.weight)
                if isinstance(getattr(m, "bias", None), Tensor):
                    nn.init.zeros_(cast(Tensor, m.bias))
            elif any(True for _ in m.parameters(recurse=False)):
                left.append(f"{name or '<root>'} ({type(m).__name__})")
    return left


def _residual_modules(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Module, fx.Graph, list[Any]]], list[str]]:
    found, untraced = [], []
    for name, m in model.named_modules():
        if isinstance(m, (*_PARAM_TYPES, nn.ModuleList, nn.ModuleDict)) or not list(m.children()):
            continue
        try:
            graph = _LeafTracer().trace(m)
        except Exception as e:
            untraced.append(f"{name or '<root>'} ({type(m).__name__}: {type(e).__name__})")
            continue
        res = _find_residuals(graph)
        if res:
            found.append((name, m, graph, res))
    return found, untraced


def unit_scale(
    model: nn.Module,
    *,
    float8: bool = False,
    residual: str | Sequence[float] | Callable[[int], list[float]] = "running-mean",
    tau: float = 0.5,
    readout: str | None = "auto",
    config: UnitConfig | None = None,
    strict: bool = False,
) -> nn.Module:
    """Return a unit-scaled copy of ``model`` (``model`` itself is not changed).

    Called exactly like ``model``, with the same outputs (a loss from ``F.cross_entropy``
    keeps its true value; only gradients are scaled). ``residual``: the τ scheme of
    :func:`lowprec.unit.functional.residual_taus` (``"running-mean"``, ``"fixed"`` with
    ``tau``), one ``τ`` per residual add found, or a function of their number ``n`` giving
    the list (e.g. :func:`lowprec.unit.umup.umup_taus`). ``readout``: the output layer's module
    name (``"auto"``: the last ``nn.Linear``; ``None``: none). ``config`` overrides
    ``float8``/``strict`` and sets the mults. The result's ``unit_report`` dict says what
    was converted and what was left unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if hasattr(model, "_unit_config"):
        raise ValueError("model: already unit-scaled")
    if config is not None and not isinstance(config, UnitConfig):
        raise TypeError(f"config must be a UnitConfig or None, got {type(config).__name__}")
    cfg = config or UnitConfig(float8=float8, strict=strict)
    model = copy.deepcopy(model)
    left = _reinit(model)
    bad = sorted({type(m).__name__ for m in model.modules()
                  if isinstance(m, (nn.Conv2d, nn.Conv3d, nn.modules.batchnorm._BatchNorm,
                                    nn.GroupNorm, nn.MultiheadAttention, nn.RNNBase))})  # fmt: skip
    if bad and cfg.strict:
        raise NotImplementedError(f"unit_scale: no unit-scaling rule for modules {bad}")
    found, untraced = _residual_modules(model)
    n = sum(len(r) for *_, r in found)
    if isinstance(residual, str):
        taus = U.residual_taus(n, residual, tau)
    elif callable(residual):
        taus = list(residual(n))
    else:
        taus = [float(t) for t in residual]
    if len(taus) != n:
        raise ValueError(f"residual: {n} residual adds found, got {len(taus)} taus")
    i, residual_names = 0, []
    for name, _m, graph, res in found:
        for add, skip, out in res:
            _rewrite_residual(graph, add, skip, out, taus[i])
            residual_names.append(f"{name or '<root>'}.{add.name} (tau={taus[i]:.4g})")
            i += 1
    for name, m, graph, _ in reversed(found):  # deepest first: parents copy rewritten children
        gm = fx.GraphModule(m, graph, class_name=type(m).__name__)
        if not name:
            model = gm
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, gm)
    head = _find_readout(model, readout)
    if head is not None:
        fan_in = cast(nn.Linear, model.get_submodule(head)).in_features
        head_module = model.get_submodule(head)
        head_module.register_forward_hook(_ReadoutScale(cfg.output_mult / math.sqrt(fan_in)))
        if cfg.float8 and not cfg.float8_readout:
            fwd = types.MethodType(_readout_forward, head_module)
            head_module.forward = fwd  # type: ignore[method-assign]
    if bad or left:
        log.warning(
            "unit_scale: no unit-scaling rule for %s; left unchanged (standard init and ops)",
            ", ".join(bad + left),
        )
    model.__class__ = _unit_forward_class(type(model))
    object.__setattr__(model, "_unit_config", cfg)
    object.__setattr__(
        model,
        "unit_report",
        {
            "residual_adds": residual_names,
            "readout": head,
            "untraced_modules": untraced,
            "unsupported": bad + left,
        },
    )
    return model


class _ReadoutScale:
    """Forward hook: μP's readout multiplier ``output_mult/√fan_in`` (forward only)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        return scale_fwd(out, self.factor)


def _readout_forward(self: nn.Linear, x: Tensor) -> Tensor:
    """The readout's forward under ``float8``: the unit linear without FP8 rounding."""
    return U.linear(x, self.weight, self.bias)


def _find_readout(model: nn.Module, readout: str | None) -> str | None:
    if readout is None:
        return None
    if readout == "auto":
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        return names[-1] if names else None
    try:
        m = model.get_submodule(readout)
    except AttributeError:
        m = None
    if not isinstance(m, nn.Linear):
        raise ValueError(f"readout: {readout!r} is not an nn.Linear submodule of the model")
    return readout
