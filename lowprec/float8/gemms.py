"""The three GEMMs of a float8 linear as one autograd function, and its scales.

:class:`Float8MatmulFn` computes ``y = Q(x) Q(W)ᵀ`` in forward and ``dx = Q(g) Q(W)``,
``dW = Q(g)ᵀ Q(x)`` in backward on :class:`~lowprec.core.tensor.ScaledTensor` operands
(:mod:`lowprec.float8.operands`); :func:`role_scale` is the one place a role's tensor-wide
scale is chosen. :class:`~lowprec.float8.linear.Float8Linear` is the module around them.

Observation: where a :func:`lowprec.core.observe.gemm_sink` is active when the forward
runs, each GEMM's two operands are handed to it just before the GEMM (in backward too) as
:class:`~lowprec.core.observe.CastOperand`\\ s: the high-precision operand, the same operand
quantized again with the GEMM's cast and scale and dequantized (the quantization is
deterministic: the values the GEMM multiplies), and the per-element scale. An operand that
arrives quantized (an FP8-gathered weight or input) has no high-precision value here: its
dequantized values stand for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lowprec.core.formats import get_format
from lowprec.core.granularity import apply_scale
from lowprec.core.observe import CastOperand, GemmSink, gemm_sink
from lowprec.core.scalers import AmaxReducer, DelayedScaler, StaticScaler
from lowprec.core.scales import amax as tensor_amax
from lowprec.core.tensor import ScaledTensor
from lowprec.float8.config import CastConfig, Float8Config
from lowprec.float8.operands import Operand, cast_kind, from_parts, gemm, operand, transposed
from lowprec.float8.quant import Parts, dequantize_parts, quantize_parts

__all__ = [
    "Float8MatmulFn",
    "GemmSpec",
    "HistoryScaler",
    "block_scaled",
    "eager_gemm",
    "role_scale",
]

HistoryScaler = DelayedScaler | StaticScaler


@dataclass(frozen=True)
class GemmSpec:
    """Everything the autograd function needs besides tensors (hashable, for compile)."""

    recipe: Float8Config
    update: bool  # record the grad_output amax in a delayed history
    calibrating: bool  # record the grad_output amax for static calibration
    go_scaler: HistoryScaler | None  # the grad_output's delayed/static scaler
    go_reduce: AmaxReducer | None = None  # the grad_output is a shard: its amax is reduced


def role_scale(
    sc: HistoryScaler | None,
    cast: CastConfig,
    t: Tensor | None,
    *,
    update: bool,
    calibrating: bool,
    state: Tensor | None = None,
    amax: Tensor | None = None,
    reduce: AmaxReducer | None = None,
) -> Tensor | None:
    """The one place a role's tensor-wide scale is chosen: the scale of ``t`` from the
    role's core scaler (delayed: its history, recorded when ``update``; static: its
    calibration, recorded when ``calibrating``, or its frozen scale), or ``None`` for a
    dynamic role, whose scale the GEMM's operand computes from ``t`` itself.

    ``amax``: the ``amax`` of the whole tensor, given (already reduced across ranks);
    ``reduce``: ``t`` is a shard, and the ``amax`` of a tensor-wise role is ``reduce`` of its
    local ``amax``. With either, a dynamic role's scale is computed here, from that ``amax``.
    ``state``: the scaler's state tensor threaded through the autograd function.
    """
    if isinstance(sc, StaticScaler) and sc.frozen:
        return sc(t, amax=amax)
    if amax is None and reduce is not None and cast_kind(cast) == "tensor":
        assert t is not None
        amax = reduce(tensor_amax(t))
    if isinstance(sc, DelayedScaler):
        return sc(t, update=update, state=state, amax=amax)
    if isinstance(sc, StaticScaler):
        return sc(t, update=calibrating, state=state, amax=amax)
    return None if amax is None else cast.scale_for(amax)


@torch.library.custom_op("lowprec::keep_for_backward", mutates_args=())
def _keep_for_backward(t: Tensor) -> Tensor:
    """A copy of ``t`` that ``torch.compile``'s partitioner must save, not recompute.

    Left to itself, AOTAutograd's min-cut partitioner keeps a wider intermediate and
    recomputes the FP8 cast in backward, which forfeits the memory saving. It does not
    recompute ops outside its allow-list, so passing the 1-byte tensor through this opaque
    op pins it as the saved value. Eager mode does not need (or use) it.
    """
    return t.clone()


@_keep_for_backward.register_fake
def _(t: Tensor) -> Tensor:
    return torch.empty_like(t)


def block_scaled(r: Float8Config) -> bool:
    """Whether a role of ``r`` has MX or NVFP4 (block-scaled, E8M0/E4M3 scale) casts."""
    return any(cast_kind(c) in ("mx", "nv") for c in (r.input, r.weight, r.grad_output))


class Float8MatmulFn(torch.autograd.Function):
    """The three GEMMs of a linear on :class:`~lowprec.core.tensor.ScaledTensor` operands.

    Operands are built from plain ``(data, scale)`` parts (:func:`quantize_parts`) and only
    consumed by :func:`~lowprec.float8.operands.gemm`: no payload is read back from a
    ScaledTensor made here, so ``torch.compile(fullgraph=True)`` traces them (the GEMM's
    ScaledTensor rule runs below Dynamo).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        w: Tensor,
        x_scale: Tensor | None,
        w_scale: Tensor | None,
        go_scale: Tensor | None,
        go_state: Tensor | None,
        spec: GemmSpec,
        out_dtype: torch.dtype,
    ) -> Tensor:
        r = spec.recipe
        ctx.sink = sink = gemm_sink()
        ctx.x_hp = None
        if "forward" in r.high_precision_gemms:  # y = x Wᵀ on the unquantized operands
            xh = x.dequantize() if isinstance(x, ScaledTensor) else x
            wh = w.dequantize() if isinstance(w, ScaledTensor) else w
            if sink is not None:
                sink("forward", _hp("input", xh), _hp("weight", wh.t()))
            y_hp = torch.matmul(xh.to(out_dtype), wh.to(out_dtype).t())
            # The backward's quantized operands use the forward's tensor scales, as below.
            ctx.save_for_backward(xh, None, x_scale, w, w_scale)
            ctx.go_state, ctx.go_scale = go_state, go_scale
            ctx.spec, ctx.x_meta = spec, (None, x.dtype)
            return y_hp
        # A high-precision weight gradient needs the unquantized input: it is saved instead.
        fp8_saved = r.fp8_saved_activations and "weight_grad" not in r.high_precision_gemms
        # A ScaledTensor operand arrives quantized (tensor-wise) by the distributed layer:
        # an FP8-gathered FSDP2 weight, an FP8-gathered sequence-parallel input.
        xd: Tensor | None = None
        xs: Tensor | None = None
        xpad: Any = None
        if isinstance(x, ScaledTensor):
            xd, xs = x.qdata, x.scale
            xq: Operand = from_parts((xd, xs, None), r.input, 1, x.dtype, r)
        elif fp8_saved:  # the payload is saved for backward
            xd, xs, xpad = xp = quantize_parts(x, r.input, 1, x_scale)
            xq = from_parts(xp, r.input, 1, x.dtype, r)
        else:
            xq, xs, _ = operand(x, r.input, 1, x_scale, r)
        ws_used: Tensor | None = None
        wq: Operand
        if isinstance(w, ScaledTensor):
            wq = from_parts((w.qdata.t(), w.scale, None), r.weight, 0, w.dtype, r)
        else:
            wq, ws_used, _ = operand(w.t(), r.weight, 0, w_scale, r)
        if sink is not None:
            ws_seen = w.scale if isinstance(w, ScaledTensor) else ws_used
            sink(
                "forward",
                _observed("input", x, r.input, 1, xs),
                _observed("weight", _hp_value(w).t(), r.weight, 0, ws_seen),
            )
            ctx.x_hp = _hp_value(x).detach()  # for the weight-gradient GEMM's observation
        y = gemm(xq, wq, out_dtype, r)
        # (A ScaledTensor weight carries its scale; FSDP2 refills it in place on re-gather.)
        w_tensor = cast_kind(r.weight) == "tensor" and not isinstance(w, ScaledTensor)
        w_used = ws_used if w_tensor else None
        if fp8_saved or isinstance(x, ScaledTensor):
            assert xd is not None
            kept = _keep_for_backward(xd) if torch.compiler.is_compiling() else xd
            ctx.save_for_backward(None, kept, xs, w, w_used)
        else:  # the forward's scale too: delayed/static scales must not become dynamic
            ctx.save_for_backward(x, None, xs, w, w_used)
        # The grad_output state is updated in place in backward, so it is held on ctx, not
        # saved: a saved tensor modified in place fails autograd's version check when a
        # layer's backward runs twice in one graph (weight sharing, retain_graph).
        ctx.go_state, ctx.go_scale = go_state, go_scale
        ctx.spec, ctx.x_meta = spec, (xpad, x.dtype)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, xq_data, xq_scale, w, w_scale = ctx.saved_tensors
        go_state = ctx.go_state
        spec: GemmSpec = ctx.spec
        r = spec.recipe
        xpad, x_dtype = ctx.x_meta
        x_tensor = cast_kind(r.input) == "tensor"
        hp = r.high_precision_gemms
        fp8_dx = ctx.needs_input_grad[0] and "input_grad" not in hp
        fp8_dw = ctx.needs_input_grad[1] and "weight_grad" not in hp
        g_scale = ctx.go_scale
        if g_scale is None and (fp8_dx or fp8_dw):
            g_scale = role_scale(
                spec.go_scaler,
                r.grad_output,
                g,
                update=spec.update,
                calibrating=spec.calibrating,
                state=go_state,
                reduce=spec.go_reduce,
            )
        g_tensor = cast_kind(r.grad_output) == "tensor"
        dx = dw = None
        gq: Operand
        gp: Parts | None = None
        if (g_tensor and fp8_dw) or fp8_dx:  # tensor-wise: used transposed for dW too
            gq, _, gp = operand(g, r.grad_output, 1, g_scale, r)
        sink: GemmSink | None = ctx.sink
        if sink is not None:
            _observe_backward(ctx, sink, g, g_scale, fp8_dx, fp8_dw)
        if ctx.needs_input_grad[0] and not fp8_dx:  # dx = g W, unquantized
            wh = w.dequantize() if isinstance(w, ScaledTensor) else w
            dx = torch.matmul(g, wh.to(g.dtype)).to(x_dtype)
        if ctx.needs_input_grad[1] and not fp8_dw:  # dW = gᵀ x, unquantized
            xh = x if x is not None else dequantize_parts(xq_data, xq_scale, xpad, g.dtype)
            dw = torch.matmul(g.t(), xh.to(g.dtype)).to(w.dtype)
        if fp8_dx:
            wq: Operand
            if isinstance(w, ScaledTensor):  # tensor-wise: the forward's values, transposed
                wq = from_parts((w.qdata, w.scale, None), r.weight, 0, w.dtype, r)
            else:
                wq = operand(w, r.weight, 0, w_scale, r)[0]
            dx = gemm(gq, wq, x_dtype, r)
        if fp8_dw:
            gq_t: Operand
            xq: Operand
            if g_tensor:  # the same values and scale, transposed
                gq_t = transposed(gq, gp, r.grad_output, g.dtype)
            else:
                gq_t = operand(g.t(), r.grad_output, 1, None, r)[0]
            if x is None:
                if x_tensor:  # used transposed in the wgrad GEMM: same values, same scale
                    xq = from_parts((xq_data, xq_scale, None), r.input, 0, x_dtype, r)
                else:  # re-quantize along the token dimension (documented double rounding)
                    deq = dequantize_parts(xq_data, xq_scale, xpad, torch.float32)
                    xq = operand(deq, r.input, 0, None, r)[0]
            else:  # tensor scale: the forward's (delayed/static/dynamic alike)
                xq = operand(x, r.input, 0, xq_scale if x_tensor else None, r)[0]
            dw = gemm(gq_t, xq, w.dtype, r)
        return dx, dw, None, None, None, None, None, None


# MX and NVFP4 linears run their forward and backward outside torch.compile's graph (a
# graph break at each; the eager kernels of lowprec.core.kernels quantize): inductor's CPU
# code generation fails on their quantize graphs (AssertionError in its loop tiling, torch
# 2.13, e.g. an HF Llama in bf16), and a break inside the function made the resumed frames
# trace the recipe's block sizes as symbols once two block formats had been compiled.
eager_gemm: Callable[..., Tensor] = torch.compiler.disable(Float8MatmulFn.apply)  # type: ignore[no-untyped-call]


def _hp_value(t: Tensor) -> Tensor:
    """``t``'s high-precision value: a ScaledTensor operand (FP8-gathered) dequantized."""
    if isinstance(t, ScaledTensor):
        return dequantize_parts(t.qdata, t.scale, None, torch.float32)
    return t


def _hp(role: str, t: Tensor) -> CastOperand:
    """An operand a high-precision GEMM multiplies as it is."""
    t = _hp_value(t).detach()
    return CastOperand(role, t, t, get_format(t.dtype).name)


def _observed(
    role: str,
    t: Tensor,
    cast: CastConfig,
    cd: int,
    scale: Tensor | None,
    src: Tensor | None = None,
) -> CastOperand:
    """The operand ``t`` (contracted over ``cd``) as the GEMM multiplies it: quantized with
    ``cast`` (at ``scale`` where the cast is tensor-wise, as the GEMM was) and dequantized.
    ``src``: the tensor the GEMM actually quantized, where it is not ``t`` itself (the
    dequantized saved input, re-quantized along the token dimension)."""
    hp = _hp_value(t).detach()
    tensor = cast_kind(cast) == "tensor"
    data, s, pad = quantize_parts(hp if src is None else src, cast, cd, scale if tensor else None)
    deq = dequantize_parts(data, s, pad, torch.float32)
    if s.dim() == 0 or s.numel() == 1:
        elem = s.reshape(())
    else:
        elem = apply_scale(torch.ones(data.shape, device=data.device), s)
        if pad is not None:
            elem = elem[: pad[0], : pad[1]]
    return CastOperand(role, hp, deq, cast.fmt, elem, s, cast.granularity)


def _observe_backward(
    ctx: Any, sink: GemmSink, g: Tensor, g_scale: Tensor | None, fp8_dx: bool, fp8_dw: bool
) -> None:
    """Hand the backward GEMMs' operands to ``sink`` (as :class:`Float8MatmulFn` quantizes
    them: the tensor-wise scales of the forward, the gradient's scale of this backward)."""
    x, xq_data, xq_scale, w, w_scale = ctx.saved_tensors
    r: Float8Config = ctx.spec.recipe
    xpad, _ = ctx.x_meta
    g_tensor = cast_kind(r.grad_output) == "tensor"
    x_tensor = cast_kind(r.input) == "tensor"
    if ctx.needs_input_grad[0]:
        if fp8_dx:
            ws = w.scale if isinstance(w, ScaledTensor) else w_scale
            go = _observed("grad_output", g, r.grad_output, 1, g_scale)
            sink("input_grad", go, _observed("weight", w, r.weight, 0, ws))
        else:
            sink("input_grad", _hp("grad_output", g), _hp("weight", w))
    if not ctx.needs_input_grad[1]:
        return
    x_hp = ctx.x_hp if ctx.x_hp is not None else x
    if x_hp is None:  # only the quantized input was kept (no observation in forward)
        x_hp = dequantize_parts(xq_data, xq_scale, xpad, torch.float32)
    if not fp8_dw:
        sink("weight_grad", _hp("grad_output", g.t()), _hp("input", x_hp))
        return
    gt = _observed("grad_output", g.t(), r.grad_output, 1, g_scale if g_tensor else None)
    src = None
    if x is None and not x_tensor:  # the saved input, dequantized and re-quantized
        src = dequantize_parts(xq_data, xq_scale, xpad, torch.float32)
    xs = xq_scale if x_tensor else None
    sink("weight_grad", gt, _observed("input", x_hp, r.input, 0, xs, src))
