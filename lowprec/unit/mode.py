"""The op-converting torch function mode of :func:`lowprec.unit.unit_scale`.

Inside a unit-scaled model's ``forward`` every ``torch.nn.functional`` (and ``torch``) op
that has a unit rule runs as its :mod:`lowprec.unit.functional` version. A call the unit
rule does not handle (e.g. ``F.scaled_dot_product_attention`` with a float mask,
``F.cross_entropy`` with ``label_smoothing``) and an op with no rule at all run unchanged,
with one WARNING naming the module (where known) and the precise cause; ``strict``
raises ``NotImplementedError`` instead. Residual adds found by running the model
(:mod:`lowprec.unit.residual_run`) are applied here too, through the model's runtime.

**Attention written out** (``softmax(q kᵀ·c + mask) @ v``, HF's eager attention, Bloom's,
GPT-J's, a hand-written one) gets two rules on top of the ops':

* the unit ``matmul`` of two activations already divides by ``√K``, so a following
  multiplication by the number ``1/√K`` (or division by ``√K``), the model's own
  ``q kᵀ/√d``, is dropped: the logits are ``q·k/√d`` once, as in the SDPA rule, not
  ``q·k/d``;
* a softmax's output (through dropout, casts and views that keep its rows) taken as the
  left operand of a matmul is attention probabilities: that matmul is
  :func:`lowprec.unit.functional.probs_matmul` (``1/√(mean_i Σ_j p_ij²)``, whatever the
  mask) instead of the generic ``1/√K``;
* an activation repeated ``c`` times (grouped-query attention's key/value heads: HF's
  ``repeat_kv``, ``repeat_interleave``), through views, as an operand of a matmul of two
  activations has its backward scaled by ``1/√c`` (its ``c`` copies' gradients sum), as
  the SDPA rule's ``enable_gqa``: the written-out form then has SDPA's gradients;
* an activation multiplied by a number ``c`` (through views: OPT's and Whisper's
  ``q_proj(x)·d^-1/2``, then attention at scale 1) is *pre-scaled*. As SDPA's query or key
  it enters the rule divided by ``c``, at scale ``scale·c``: the same logits, with the
  unit-scale query the rule's variance assumes (it read ``c²`` of the logits' variance
  otherwise). As an operand of a matmul contracting ``K = 1/c²`` (the model's ``1/√K``
  applied first) it enters divided by ``c``: the unit matmul applies ``1/√K`` itself, as
  for a multiplication after it; so does a linear's input pre-scaled by ``1/√fan_in``
  (T5's ``d^-1/2`` before its tied output layer).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lowprec.core.modes import eager_frames
from lowprec.core.warn import warn_once
from lowprec.unit import functional as U
from lowprec.unit.attention import check_mask, check_qkv
from lowprec.unit.config import UnitConfig
from lowprec.unit.core import _PLAIN, check_number, plain_ops, scale_bwd, scale_fwd

__all__ = ["UNIT_OPS", "UnitMode", "plain_ops"]

log = logging.getLogger("lowprec.unit")

UNIT_OPS: dict[Any, Callable[..., Any]] = {}
for _op_name in dir(U):
    _f = getattr(U, _op_name)
    if callable(_f) and hasattr(_f, "__wrapped__"):
        UNIT_OPS[_f] = _f.__wrapped__
UNIT_OPS[scale_fwd] = scale_fwd.__wrapped__  # type: ignore[attr-defined]

_MATMUL = {torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm, torch.mm,
           Tensor.mm}  # fmt: skip
# In-place arithmetic on a unit op's output (``a += b`` is ``a.add_(b)``): those outputs
# are views made inside a custom autograd Function (``scale_bwd`` returns its input as a
# view), which autograd forbids changing in place. The out-of-place op's result is swapped
# into ``a`` (``torch.utils.swap_tensors``): ``a`` holds the result, with its autograd
# history, as the model's code means (Falcon's ``mlp_output += attention_output``).
_IN_PLACE: dict[Any, Callable[..., Any]] = {
    Tensor.add_: Tensor.add, Tensor.sub_: Tensor.sub, Tensor.mul_: Tensor.mul,
    Tensor.div_: Tensor.div, Tensor.__iadd__: Tensor.add, Tensor.__isub__: Tensor.sub,
    Tensor.__imul__: Tensor.mul, Tensor.__itruediv__: Tensor.div,
}  # fmt: skip
_SOFTMAX = {torch.softmax, F.softmax, Tensor.softmax}
# ops that keep a softmax's output attention probabilities (dropout, casts, copies, and
# views that keep the last dim: the rows stay rows)
_KEEPS_PROBS = {F.dropout, Tensor.to, Tensor.type_as, Tensor.contiguous, Tensor.float,
                Tensor.half, Tensor.bfloat16, Tensor.clone, Tensor.view, Tensor.reshape,
                torch.reshape}  # fmt: skip
# ops that repeat a tensor (grouped-query attention's key/value heads, HF's ``repeat_kv``)
_REPEATS = {Tensor.expand, Tensor.expand_as, Tensor.repeat, Tensor.repeat_interleave,
            torch.repeat_interleave, torch.broadcast_to}  # fmt: skip
# ops that keep a repeated tensor's copies (views, transposes, casts, copies)
_KEEPS_REPEATS = {*_KEEPS_PROBS, Tensor.transpose, torch.transpose, Tensor.permute,
                  torch.permute, Tensor.flatten}  # fmt: skip
_LOG_SOFTMAX = {torch.log_softmax, F.log_softmax, Tensor.log_softmax}
_RELU = {F.relu, torch.relu, Tensor.relu}
_KEEP = 4  # tensors each of the attention patterns' lists remembers
_KEEP_REPEATS = 8  # two repeats (key, value) and their views
_FOLDS = {F.scaled_dot_product_attention, F.linear}  # take pre-scaled operands (module doc)
_DIVS = {Tensor.__truediv__, Tensor.div, torch.div}
_SCALINGS = {Tensor.__mul__, Tensor.__rmul__, Tensor.mul, torch.mul, *_DIVS}
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
        raise ValueError("class weight, size_average and reduce have no unit rule")
    if label_smoothing != 0.0:
        raise ValueError(f"label_smoothing={label_smoothing} has no unit rule")
    return cast(Tensor, UNIT_OPS[U.cross_entropy](x, target, reduction, ignore_index))


def _embedding(cfg: UnitConfig, idx: Tensor, w: Tensor, padding_idx: Any = None,
               max_norm: Any = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
               sparse: bool = False) -> Tensor:  # fmt: skip
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise ValueError("max_norm, scale_grad_by_freq and sparse have no unit rule")
    return cast(Tensor, UNIT_OPS[U.embedding](idx, w, padding_idx))


def _softmax(cfg: UnitConfig, x: Tensor, dim: int | None = None, _stacklevel: int = 3,
             dtype: torch.dtype | None = None) -> Tensor:  # fmt: skip
    if dim is None:
        raise ValueError("softmax without dim has no unit rule")
    x = x if dtype is None else x.to(dtype)
    return cast(Tensor, UNIT_OPS[U.softmax](x, dim, mult=cfg.softmax_mult))


def _log_softmax(cfg: UnitConfig, x: Tensor, dim: int | None = None, _stacklevel: int = 3,
                 dtype: torch.dtype | None = None) -> Tensor:  # fmt: skip
    if dim is None:
        raise ValueError("log_softmax without dim has no unit rule")
    return cast(Tensor, UNIT_OPS[U.log_softmax](x if dtype is None else x.to(dtype), dim))


def _sdpa(cfg: UnitConfig, query: Tensor, key: Tensor, value: Tensor,
          attn_mask: Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
          scale: float | None = None, enable_gqa: bool = False) -> Tensor:  # fmt: skip
    """``F.scaled_dot_product_attention``'s unit rule (torch's arguments). ``softmax_mult``
    multiplies the logits: the SDPA rule runs at ``scale·mult`` (``scale`` default
    ``1/√d``). With ``float8`` the attention is written out as HF's eager attention is
    converted (unit ``matmul`` for ``q kᵀ``, the unit softmax, dropout, ``probs_matmul``),
    so that its two matmuls round their operands to FP8 as every other matmul does; a
    boolean ``attn_mask`` masks the logits. A float (additive) ``attn_mask`` is refused
    in both forms, as the SDPA rule refuses it (``ValueError``: the op then runs unchanged
    and is reported), so that ``float8`` changes only the roundings of the model."""
    if not cfg.float8:
        if cfg.softmax_mult != 1.0:
            d = max(1, query.shape[-1]) if query.dim() else 1
            scale = (d**-0.5 if scale is None else scale) * cfg.softmax_mult
        return cast(Tensor, UNIT_OPS[U.scaled_dot_product_attention](
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        ))  # fmt: skip
    check_mask(attn_mask, is_causal)
    group = check_qkv(query, key, value, enable_gqa)
    if group > 1:  # the G copies' gradients sum: 1/√G each, as the SDPA rule's
        key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
        key, value = scale_bwd(key, group**-0.5), scale_bwd(value, group**-0.5)
    logits = UNIT_OPS[U.matmul](query, key.transpose(-2, -1), float8=True)  # q·k/√d
    d = max(1, query.shape[-1])
    if scale is not None and check_number("scale", scale) * d**0.5 != 1.0:
        logits = logits * (scale * d**0.5)
    n_q, n_k = query.shape[-2], key.shape[-2]
    if is_causal:
        attn_mask = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        logits = logits.masked_fill(~attn_mask, torch.finfo(logits.dtype).min)
    p = UNIT_OPS[U.softmax](logits, -1, mult=cfg.softmax_mult)
    if dropout_p:
        p = UNIT_OPS[U.dropout](p, dropout_p, True)
    return cast(Tensor, UNIT_OPS[U.probs_matmul](p, value, float8=True, mult=cfg.softmax_mult))


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, (tuple, list)) else v


def _dropout(cfg: UnitConfig, *args: Any, **kw: Any) -> Tensor:
    if kw.get("inplace", len(args) > 3 and args[3]):
        raise ValueError("inplace=True has no unit rule")
    return cast(Tensor, UNIT_OPS[U.dropout](*args[:3], **{k: v for k, v in kw.items()
                                                        if k != "inplace"}))  # fmt: skip


def _conv1d(cfg: UnitConfig, *args: Any) -> Tensor:
    x, w, b, stride, padding, dilation, groups = list(args) + [None] * (7 - len(args))
    return cast(Tensor, UNIT_OPS[U.conv1d](
        x, w, b, _first(stride or 1), _first(padding or 0), _first(dilation or 1), groups or 1
    ))  # fmt: skip


def _readout_linear(cfg: UnitConfig) -> Callable[..., Any]:
    """The readout's ``F.linear``: the unit linear, its input gradient unconstrained
    (:class:`UnitMode`'s ``readout``)."""
    return lambda *a, **k: UNIT_OPS[U.linear](*a, **k, constraint=None, float8=cfg.float8)


def _rule(cfg: UnitConfig, func: Any) -> Callable[..., Any] | None:
    """The unit version of ``func`` (called with ``func``'s arguments), or ``None``."""
    if func in UNIT_OPS:
        return UNIT_OPS[func]
    if func is F.linear:
        return lambda *a, **k: UNIT_OPS[U.linear](*a, **k, float8=cfg.float8)
    if func in _MATMUL:
        return lambda a, b: UNIT_OPS[U.matmul](a, b, float8=cfg.float8)
    if func is F.gelu:
        return lambda x, approximate="none": UNIT_OPS[U.gelu](x, approximate, mult=cfg.act_mult)
    if func is F.silu:
        return lambda x, inplace=False: UNIT_OPS[U.silu](x, mult=cfg.act_mult)
    if func in _RELU:
        return lambda x, inplace=False: UNIT_OPS[U.relu](x)
    table: dict[Any, Callable[..., Any]] = {
        F.embedding: _embedding, F.cross_entropy: _ce, F.dropout: _dropout, F.conv1d: _conv1d,
    }  # fmt: skip
    if func in table:
        f = table[func]
        return lambda *a, **k: f(cfg, *a, **k)
    if func in _SOFTMAX:
        return lambda *a, **k: _softmax(cfg, *a, **k)
    if func in _LOG_SOFTMAX:
        return lambda *a, **k: _log_softmax(cfg, *a, **k)
    if func is F.scaled_dot_product_attention:
        return lambda *a, **k: _sdpa(cfg, *a, **k)
    # torch.rms_norm / torch.layer_norm: what the mode sees for F.rms_norm (and for models
    # calling torch's own) under torch.compile, whose tracing skips F's Python wrapper
    direct = {F.layer_norm: U.layer_norm, F.rms_norm: U.rms_norm, torch.rms_norm: U.rms_norm}
    if func is torch.layer_norm:
        return _torch_layer_norm
    return UNIT_OPS[direct[func]] if func in direct else None


def _torch_layer_norm(
    x: Tensor, normalized_shape: Any, weight: Tensor | None = None, bias: Tensor | None = None,
    eps: float = 1e-5, cudnn_enable: bool = True,
) -> Tensor:  # fmt: skip
    """``torch.layer_norm``'s signature (a trailing ``cudnn_enable``) for the unit rule."""
    return cast(Tensor, UNIT_OPS[U.layer_norm](x, normalized_shape, weight, bias, eps))


def _name(func: Any) -> str:
    """``F.x``, ``torch.x`` or ``Tensor.x``: how the call reads in the model's code."""
    qual = str(getattr(func, "__qualname__", repr(func)))
    short = qual.rpartition(".")[2]
    if getattr(F, short, None) is func:
        return "F." + short
    if getattr(torch, short, None) is func:
        return "torch." + short
    return qual


@eager_frames
class UnitMode(TorchFunctionMode):
    """Converts standard ops to unit-scaled ones (see the module doc).

    ``runtime``: a :class:`lowprec.unit.residual_run.Runtime` (residual adds found by
    running the model, module names for messages) or ``None``; ``collect``: a list that
    receives unhandled calls as ``(key, message)`` instead of a WARNING each (the
    transform's analysis run gathers them into its one WARNING); ``readout``: the model's
    readout layer, whose ``F.linear`` (the one given its ``weight``) is the unit linear with
    an unconstrained input gradient, ``1/√fan_out`` (u-μP's readout: the gradient reaching
    the rest of the model has unit scale whatever the vocabulary; tied to the forward's
    ``1/√fan_in`` it was ``√(fan_out/fan_in)``).
    """

    def __init__(
        self,
        cfg: UnitConfig,
        runtime: Any = None,
        collect: list[tuple[str, str]] | None = None,
        readout: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.runtime, self.collect = cfg, runtime, collect
        self.readout = readout
        # The last few softmax outputs (and their dropouts, casts, views): a matmul taking
        # one on the left is attention's ``p @ v``; and the last few outputs of the unit
        # matmul of two activations with ``K``, the summed dim's size. Short lists compared
        # by identity (the patterns are a few ops long; torch.compile traces lists, not
        # weak dictionaries), so no tensor is kept alive for long.
        self._probs: list[Tensor] = []
        self._products: list[tuple[Tensor, int]] = []
        # The last few repeats of an activation (and their views) with their copy count
        # ``c``: as an operand of a matmul of two activations, the ``c`` copies' gradients
        # sum in the backward, which is scaled by ``1/√c`` (the SDPA rule's ``enable_gqa``,
        # so that grouped-query attention written out has the SDPA form's gradients).
        self._repeats: list[tuple[Tensor, int]] = []
        # The last few activations multiplied by a number ``c`` (and their views), with
        # ``c``: pre-scaled queries (module doc).
        self._prescaled: list[tuple[Tensor, float]] = []

    def _unhandled(self, func: Any, cause: str) -> None:
        where = self.runtime.where() if self.runtime is not None else None
        msg = f"{where}: {cause}" if where else cause
        if self.cfg.strict:
            raise NotImplementedError(f"unit_scale: {msg}")
        key = f"unit:unhandled:{where}:{_name(func)}:{cause[:80]}"
        if self.collect is not None:
            self.collect.append((key, msg))
        elif not torch.compiler.is_compiling():
            warn_once(log, key, "unit_scale: %s; it runs unchanged (standard op)", msg)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kw = kwargs or {}
        if getattr(_PLAIN, "depth", 0):
            return func(*args, **kw)  # plain_ops(): the plain model's computation
        if not torch.compiler.is_compiling() and _from_compiled_code():
            return func(*args, **kw)  # a call of a graph Dynamo traced: already converted
        rt = self.runtime
        if rt is not None and rt.frames:
            out = rt.on_op(func, args, kw)
            if out is not NotImplemented:
                return out
            args, kw = rt.substitute(args, kw)
        if self._repeats and func in _MATMUL and len(args) == 2 and not kw:
            args = self._scaled_repeats(args)
        if self._prescaled and (func in _MATMUL or func in _FOLDS):
            args, kw = self._fold_prescaled(func, args, kw)
        if self._probs and args and any(t is args[0] for t in self._probs):
            if (
                func in _MATMUL
                and len(args) == 2
                and not kw
                and not any(t is args[1] for t in self._probs)
            ):
                try:
                    return UNIT_OPS[U.probs_matmul](
                        *args, float8=self.cfg.float8, mult=self.cfg.softmax_mult
                    )
                except (ValueError, TypeError):
                    pass  # the generic matmul rule below reports it
            elif func in _KEEPS_PROBS:
                out = self._convert(func, args, kw)
                if isinstance(out, Tensor) and out.dim() and out.shape[-1] == args[0].shape[-1]:
                    self._probs = [*self._probs[-(_KEEP - 1) :], out]
                return out
        if func in _SCALINGS and len(args) == 2 and not kw and self._products:
            if self._drops_scaling(func, args[0], args[1]):
                return args[0]  # the model's 1/√K, which the unit matmul applied
        out = self._convert(func, args, kw)
        if isinstance(out, Tensor):
            if func in _REPEATS or (self._repeats and func in _KEEPS_REPEATS):
                self._track_repeat(func, args, out)
            if func in _SCALINGS or (self._prescaled and func in _KEEPS_REPEATS):
                self._track_prescaled(func, args, kw, out)
            if func in _SOFTMAX:
                self._probs = [*self._probs[-(_KEEP - 1) :], out]
            elif func in _MATMUL and len(args) == 2 and isinstance(args[1], Tensor):
                k = max(1, args[1].shape[-2]) if args[1].dim() >= 2 else 1
                self._products = [*self._products[-(_KEEP - 1) :], (out, k)]
        return out

    def _track_repeat(self, func: Any, args: tuple[Any, ...], out: Tensor) -> None:
        """Remember ``out`` if it repeats an activation (not a parameter) that needs a
        gradient, or is a view of such a repeat (same element count)."""
        x = args[0] if args else None
        if not isinstance(x, Tensor) or isinstance(x, nn.Parameter) or not x.requires_grad:
            return
        if func in _REPEATS:
            copies = out.numel() // x.numel() if x.numel() else 1
        elif out.numel() == x.numel():
            copies = next((c for t, c in self._repeats if t is x), 1)
        else:
            return
        if copies > 1:
            self._repeats = [*self._repeats[-(_KEEP_REPEATS - 1) :], (out, copies)]

    def _prescale(self, t: object) -> float:
        """The number a tracked pre-scaled activation ``t`` was multiplied by (else 1)."""
        return next((c for x, c in self._prescaled if x is t), 1.0)

    def _track_prescaled(
        self, func: Any, args: tuple[Any, ...], kw: dict[str, Any], out: Tensor
    ) -> None:
        """Remember ``out`` if it is an activation (not a parameter) that needs a gradient
        times a finite, non-zero Python number, or a view of such a one (same size)."""
        x = args[0] if args else None
        if not isinstance(x, Tensor) or isinstance(x, nn.Parameter) or not x.requires_grad:
            return
        if func in _SCALINGS:
            c = args[1] if len(args) == 2 and not kw else None
            if not isinstance(c, (int, float)) or isinstance(c, bool):
                return
            if c == 0 or not math.isfinite(c):
                return
            f = (1.0 / c if func in _DIVS else float(c)) * self._prescale(x)
        elif out.numel() == x.numel():
            f = self._prescale(x)
        else:
            return
        if f != 1.0:
            self._prescaled = [*self._prescaled[-(_KEEP_REPEATS - 1) :], (out, f)]

    def _fold_prescaled(
        self, func: Any, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """SDPA's or a matmul's arguments with their pre-scaled operands folded (module
        doc); unchanged where none is pre-scaled."""
        if func is F.linear:  # x Wᵀ: W (fan_out, fan_in)
            if not args or not isinstance(
                w := args[1] if len(args) > 1 else kw.get("weight"), Tensor
            ):
                return args, kw
            c = self._prescale(args[0])
            if c != 1.0 and abs(c * math.sqrt(w.shape[-1]) - 1.0) < 1e-6:
                return (args[0] / c, *args[1:]), kw
            return args, kw
        if func in _MATMUL:
            if len(args) != 2 or kw or not all(isinstance(a, Tensor) for a in args):
                return args, kw
            k = args[1].shape[-2] if args[1].dim() >= 2 else args[1].shape[0]
            folded = []
            for a in args:
                c = self._prescale(a)
                folded.append(a / c if c != 1.0 and abs(c * math.sqrt(k) - 1.0) < 1e-6 else a)
            return tuple(folded), kw
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = {**dict(zip(names, args, strict=False)), **kw}
        q, key = bound.get("query"), bound.get("key")
        cq, ck = self._prescale(q), self._prescale(key)
        if (cq == 1.0 and ck == 1.0) or not isinstance(q, Tensor) or "value" not in bound:
            return args, kw
        given = bound.get("scale")
        s = max(1, q.shape[-1]) ** -0.5 if given is None else _number(given)
        if s is None or len(args) > len(names):
            return args, kw
        bound["scale"] = s * cq * ck  # the same logits q·k·scale
        q = q / cq if cq != 1.0 else q
        key = key / ck if ck != 1.0 and isinstance(key, Tensor) else key
        rest = {n: v for n, v in bound.items() if n not in ("query", "key", "value")}
        return (q, key, bound["value"]), rest

    def _scaled_repeats(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A matmul's operands, a repeated activation (``c`` copies) in ``scale_bwd(·,
        1/√c)``; unchanged where an operand is a parameter (not two activations)."""
        if not all(isinstance(a, Tensor) and not isinstance(a, nn.Parameter) for a in args):
            return args
        copies = [next((c for t, c in self._repeats if t is a), 1) for a in args]
        if all(c == 1 for c in copies):
            return args  # the usual case: neither operand is a tracked repeat
        return tuple(
            a if c == 1 else scale_bwd(a, c**-0.5) for a, c in zip(args, copies, strict=True)
        )

    def _drops_scaling(self, func: Any, x: Any, c: Any) -> bool:
        """Whether ``func(x, c)`` multiplies a unit matmul's output ``x`` by ``1/√K`` (or
        divides it by ``√K``), which that matmul already applied.

        A Python number is matched by value first, so tensors are compared by identity
        only for a candidate factor: a division by a constant in code the mode sees under
        ``torch.compile`` (e.g. inside a traced autograd Function's backward) then never
        compares tensors of another subgraph, which Dynamo refuses; a tensor ``c`` that is
        not one CPU number is no candidate either. A one-element tensor ``c`` is read
        (``.item()``) only for a product of a unit matmul."""

        def factor(v: float | None) -> float | None:
            if v is None or v <= 0.0:
                return None
            return 1.0 / v if func in _DIVS else v

        if isinstance(c, Tensor):
            if c.numel() != 1 or c.device.type != "cpu":
                return False  # not a number (e.g. float8's row-wise scales)
            k = next((k for t, k in self._products if t is x), 0)
            f = factor(_number(c)) if k else None
            return f is not None and abs(f * math.sqrt(k) - 1.0) < 1e-6
        f = factor(_number(c))
        if f is None:
            return False
        ks = {k for _, k in self._products if abs(f * math.sqrt(k) - 1.0) < 1e-6}
        return bool(ks) and any(t is x for t, k in self._products if k in ks)

    def _convert(self, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        """``func`` by its unit rule, or unchanged (reported) where it has none."""
        rule = _rule(self.cfg, func)
        if func is F.linear and self.readout is not None:
            w = args[1] if len(args) > 1 else kw.get("weight")
            if w is not None and w is getattr(self.readout, "weight", None):
                rule = _readout_linear(self.cfg)
        if rule is not None:
            try:
                return rule(*args, **kw)
            except (ValueError, TypeError) as e:
                self._unhandled(func, f"{_name(func)} called with arguments its unit rule "
                                      f"does not handle: {e}")  # fmt: skip
        elif func in _NO_RULE:
            self._unhandled(func, f"{_name(func)} has no unit-scaling rule")
        if func in _IN_PLACE and args and _function_view(args[0]):
            a = args[0]
            torch.utils.swap_tensors(a, _IN_PLACE[func](*args, **kw))  # type: ignore[no-untyped-call]
            return a
        return func(*args, **kw)


@functools.cache
def _inductor_root() -> str | None:
    """Where inductor writes its generated code (read once per process)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return str(cache_dir())
    except Exception:  # no inductor: no generated code
        return None


def _from_compiled_code() -> bool:
    """Whether the torch call being handled comes from a graph that Dynamo traced: the code
    inductor generated, or the ``GraphModule`` of another backend (``"eager"``).

    After a graph break inside a unit model's forward, the mode is active around the
    compiled graphs when they run, so their calls (inductor's ``torch.addmm(..., out=buf)``
    kernels, an eager backend's ``torch.matmul``) reach it again: those graphs were
    converted when traced, and a second conversion would scale twice."""
    root = _inductor_root()
    frame: FrameType | None = sys._getframe(2)  # 0: here, 1: __torch_function__, 2: caller
    interpreted = False
    for _ in range(12):
        if frame is None:
            return False
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if root is not None and name.startswith(root):
            return True
        if name.startswith("<eval_with_key>"):  # an fx GraphModule: Dynamo's, or another's
            gm = frame.f_locals.get("self")
            return "dynamo_compile_id" in getattr(gm, "meta", {})
        if name.endswith("/torch/fx/interpreter.py"):  # running a graph: who runs it?
            interpreted = True
        elif interpreted and ("/torch/_functorch/" in name or "/torch/_higher_order_ops/" in name):
            return True  # the eager backend running a traced autograd Function's body
        elif "/torch/_dynamo/" in name or not name.startswith(_LIBRARY_DIRS):
            return False  # the caller is model code (or Dynamo's own): convert
        frame = frame.f_back  # torch's or lowprec's wrappers (F.*, handle_torch_function)
    return False


# torch's directory and lowprec's (two levels above this file: lowprec/unit/mode.py).
_LIBRARY_DIRS = tuple(
    d.replace(os.sep, "/") + "/"
    for d in (
        os.path.dirname(torch.__file__ or ""),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
)


def _number(v: object) -> float | None:
    """``v`` as a float if it is a real number or a one-element CPU tensor, else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, Tensor) and v.numel() == 1 and v.device.type == "cpu" and not v.is_complex():
        return float(v.item())
    return None


def _function_view(t: object) -> bool:
    """``t`` is a view returned by a custom autograd Function (in-place ops on it raise)."""
    if not isinstance(t, Tensor) or not t.requires_grad or not t._is_view():
        return False
    return isinstance(t.grad_fn, torch.autograd.function.BackwardCFunction)
