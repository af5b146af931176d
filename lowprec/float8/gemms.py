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

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lowprec.core.observe import GemmSink, gemm_sink
from lowprec.core.scalers import AmaxReducer
from lowprec.core.tensor import ScaledTensor
from lowprec.float8.config import GEMM_ROLES, Float8Config
from lowprec.float8.gemm_observe import hp_operand as _hp
from lowprec.float8.gemm_observe import hp_value as _hp_value
from lowprec.float8.gemm_observe import observe_backward, observed
from lowprec.float8.gemm_options import (
    HistoryScaler,
    Streams,
    hadamard_pair,
    own_scale,
    role_scale,
    same_operands,
    shares_weight,
    transposed_weight,
)
from lowprec.float8.operands import (
    Operand,
    cast_kind,
    from_parts,
    gemm,
    operand,
    surely_emulated,
    transposed,
)
from lowprec.float8.quant import Parts, dequantize_parts, quantize_parts
from lowprec.float8.replay import recomputing

__all__ = [
    "Float8MatmulFn",
    "GemmSpec",
    "HistoryScaler",
    "block_scaled",
    "role_scale",
]


@dataclass(frozen=True)
class GemmSpec:
    """Everything the autograd function needs besides tensors (hashable, for compile)."""

    recipe: Float8Config
    update: bool  # record the grad_output amax in a delayed history
    calibrating: bool  # record the grad_output amax for static calibration
    go_scaler: HistoryScaler | None  # the grad_output's delayed/static scaler
    go_reduce: AmaxReducer | None = None  # the grad_output is a shard: its amax is reduced
    # The input / weight are shards: the tensor-wise scale of a per-GEMM cast (which the
    # function computes itself, unlike the base roles' scales) reduces their amax.
    x_reduce: AmaxReducer | None = None
    w_reduce: AmaxReducer | None = None


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
    """Whether a role of ``r``, or a role a per-GEMM config of ``r`` quantizes
    (:attr:`~lowprec.float8.Float8Config.gemms`), has MX or NVFP4 (block-scaled, E8M0/E4M3
    scale) casts."""
    casts = [r.input, r.weight, r.grad_output]
    casts += [c.cast(role) for g, c in r.gemms for role in GEMM_ROLES[g]]
    return any(cast_kind(c) in ("mx", "nv") for c in casts)


class Float8MatmulFn(torch.autograd.Function):
    """The three GEMMs of a linear on :class:`~lowprec.core.tensor.ScaledTensor` operands.

    Operands are built from plain ``(data, scale)`` parts (:func:`quantize_parts`) and only
    consumed by :func:`~lowprec.float8.operands.gemm`: no payload is read back from a
    ScaledTensor made here, so ``torch.compile(fullgraph=True)`` traces them (the GEMM's
    ScaledTensor rule runs below Dynamo).

    Formats per GEMM: each GEMM ``G`` quantizes its operands with the casts of
    ``c = r.for_gemm(G)`` and multiplies them with ``c``'s emulation options. A role's
    scale is the base role's (delayed, static, or the forward's tensor-wise scale reused in
    backward) where ``c``'s cast of it is the base cast (``r.own_cast(G, role)`` false),
    else computed by that GEMM from the operand. Operands are shared only between GEMMs
    whose casts of them are equal: the forward's quantized input is saved for the weight
    gradient (``fp8_saved_activations``) only if ``r.same_cast("input", "forward",
    "weight_grad")``, a tensor-wise gradient is quantized once for both backward GEMMs only
    if their casts of it are equal, and an operand that arrives quantized (a ScaledTensor,
    quantized with the base cast) is dequantized and quantized again for a GEMM whose cast
    differs.

    Stochastic casts draw from the streams of ``rng`` (the layer's ``(key, step)``,
    :class:`~lowprec.float8.gemm_options.Streams`); a GEMM in ``r.hadamard`` multiplies its
    operands transformed along the contracted dimension (quantized with their own scales,
    shared with no other GEMM); with :func:`~lowprec.float8.gemm_options.shares_weight` the
    input gradient multiplies the forward's quantized weight, transposed.
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
        rng: Tensor | None = None,
    ) -> Tensor:
        r = spec.recipe
        ctx.sink = gemm_sink()
        # a forward recomputed in backward (activation checkpointing) was observed when it
        # first ran: its backward, not its forward, is observed again
        sink = None if recomputing(True) else ctx.sink
        ctx.x_hp = None
        ctx.streams = st = Streams(r, rng)
        ctx.w_fwd = None
        hp = r.high_precision_gemms
        if "forward" in r.hadamard:
            return _hadamard_forward(
                ctx, x, w, (x_scale, w_scale, go_scale, go_state), spec, out_dtype
            )
        if "forward" in hp:  # y = x Wᵀ on the unquantized operands
            xh = x.dequantize() if isinstance(x, ScaledTensor) else x
            wh = w.dequantize() if isinstance(w, ScaledTensor) else w
            if sink is not None:
                sink("forward", _hp("input", xh), _hp("weight", wh.t()))
            y_hp = torch.matmul(xh.to(out_dtype), wh.to(out_dtype).t())
            # The backward's quantized operands use the forward's tensor scales, as below.
            ctx.save_for_backward(xh, None, None, x_scale, w, w_scale)
            ctx.go_state, ctx.go_scale = go_state, go_scale
            ctx.spec, ctx.x_meta = spec, (None, x.dtype)
            return y_hp
        cf = r.for_gemm("forward")
        own_x, own_w = r.own_cast("forward", "input"), r.own_cast("forward", "weight")
        # The weight gradient reuses the forward's quantized input only where it quantizes
        # the input with the same cast (else it gets the high-precision input), and a
        # per-GEMM input cast only where it is tensor-wise (the same values; the double
        # rounding of a saved row/block-scaled input is the base cast's documented
        # option); a high-precision weight gradient needs the unquantized input.
        wg_hp = "weight_grad" in hp
        same_x = wg_hp or r.same_cast("input", "forward", "weight_grad")
        fp8_saved = (
            r.fp8_saved_activations
            and not wg_hp
            and "weight_grad" not in r.hadamard
            and same_x
            and (not own_x or cast_kind(cf.input) == "tensor")
        )
        # Under torch.compile a tensor-wise payload for the hardware GEMM (an emulated one
        # reads float32 values, which would be saved instead) is not pinned: the input
        # and its scale are saved, and the weight gradient quantizes the input again with
        # that scale and cast (the same bits). AOTAutograd's min-cut partitioner then keeps
        # whichever costs least: the 1-byte payload where the input is kept for nothing
        # else, nothing where backward recomputes the input from tensors it keeps anyway
        # (a norm's input and statistics, a SwiGLU's two projections). Pinning saved one
        # payload per layer on top of those (3 identical ones for q/k/v): 5 GiB more than
        # torchao on a 1.1B Llama (benchmarks/README.md, Llama section).
        if (
            fp8_saved
            and torch.compiler.is_compiling()
            and not own_x
            and not isinstance(x, ScaledTensor)
            and cast_kind(r.input) == "tensor"
            and not r.own_cast("weight_grad", "input")
            and not surely_emulated(x, r)
        ):
            fp8_saved = False
        # A ScaledTensor operand arrives quantized (tensor-wise, with the base cast) by the
        # distributed layer: an FP8-gathered FSDP2 weight, an FP8-gathered sequence-parallel
        # input. A GEMM with another cast quantizes its dequantized values again.
        x_st = isinstance(x, ScaledTensor)
        wg_h = "weight_grad" in r.hadamard
        xv = _hp_value(x) if x_st and (own_x or not same_x or wg_h) else x
        gx = st.gen("forward", "input", x.device)
        # The base input cast's tensor scale, for a weight gradient with the base cast.
        x_base = x.scale if isinstance(x, ScaledTensor) else x_scale
        xd: Tensor | None = None
        xs: Tensor | None = None
        xpad: Any = None
        if isinstance(x, ScaledTensor) and not own_x:
            xd, xs = x.qdata, x.scale
            xq: Operand = from_parts((xd, xs, None), cf.input, 1, x.dtype, cf)
        else:
            xsrc = _hp_value(x) if x_st else x
            xs_in = own_scale(cf.input, xsrc, spec.x_reduce) if own_x else x_scale
            if fp8_saved:  # the payload is saved for backward
                xd, xs, xpad = xp = quantize_parts(xsrc, cf.input, 1, xs_in, gx)
                xq = from_parts(xp, cf.input, 1, x.dtype, cf)
            else:
                xq, xs, _ = operand(xsrc, cf.input, 1, xs_in, cf, gx)
        if not own_x and cast_kind(r.input) == "tensor":
            x_base = xs
        ws_used: Tensor | None = None
        wq: Operand
        gw: torch.Generator | None = None  # (a weight quantized before, e.g. FP8 all-gather)
        if isinstance(w, ScaledTensor) and not own_w:
            wq = from_parts((w.qdata.t(), w.scale, None), cf.weight, 0, w.dtype, cf)
            ws_seen: Tensor | None = w.scale
        else:
            wsrc = _hp_value(w) if isinstance(w, ScaledTensor) else w
            ws_in = own_scale(cf.weight, wsrc, spec.w_reduce) if own_w else w_scale
            gw = st.gen("forward", "weight", w.device)
            wq, ws_used, wparts = operand(wsrc.t(), cf.weight, 0, ws_in, cf, gw)
            ws_seen = ws_used
            if shares_weight(r) and ctx.needs_input_grad[0]:  # dgrad: the same Q(W)
                ctx.w_fwd = transposed_weight(wq, wparts, r, w.dtype)
        if sink is not None:
            sink(
                "forward",
                observed("input", x, cf.input, 1, xs, None, gx),
                observed("weight", _hp_value(w).t(), cf.weight, 0, ws_seen, None, gw),
            )
            ctx.x_hp = _hp_value(x).detach()  # for the weight-gradient GEMM's observation
        y = gemm(xq, wq, out_dtype, cf)
        # The base weight cast's tensor scale, for an input gradient with the base cast.
        # (A ScaledTensor weight carries its scale; FSDP2 refills it in place on re-gather.)
        w_base: Tensor | None = None
        if cast_kind(r.weight) == "tensor" and not isinstance(w, ScaledTensor):
            w_base = w_scale if own_w else ws_used
        if fp8_saved or (x_st and not own_x and same_x and not wg_h):
            assert xd is not None
            kept = _keep_for_backward(xd) if torch.compiler.is_compiling() else xd
            ctx.save_for_backward(None, kept, xs, x_base, w, w_base)
        else:  # the base scale too: delayed/static scales must not become dynamic
            ctx.save_for_backward(xv, None, None, x_base, w, w_base)
        # The grad_output state is updated in place in backward, so it is held on ctx, not
        # saved: a saved tensor modified in place fails autograd's version check when a
        # layer's backward runs twice in one graph (weight sharing, retain_graph).
        ctx.go_state, ctx.go_scale = go_state, go_scale
        ctx.spec, ctx.x_meta = spec, (xpad, x.dtype)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        # read once: a non-reentrant checkpoint refuses a second unpack of a saved tensor
        saved = ctx.saved_tensors
        x, xq_data, xq_scale, x_base, w, w_base = saved
        go_state = ctx.go_state
        spec: GemmSpec = ctx.spec
        r = spec.recipe
        xpad, x_dtype = ctx.x_meta
        hp = r.high_precision_gemms
        st: Streams = ctx.streams
        dev = g.device
        fp8_dx = ctx.needs_input_grad[0] and "input_grad" not in hp
        fp8_dw = ctx.needs_input_grad[1] and "weight_grad" not in hp
        h_dx, h_dw = "input_grad" in r.hadamard, "weight_grad" in r.hadamard
        cdx, cdw = r.for_gemm("input_grad"), r.for_gemm("weight_grad")
        own_gdx = r.own_cast("input_grad", "grad_output") or h_dx
        own_gdw = r.own_cast("weight_grad", "grad_output") or h_dw
        # The base grad_output scale (its delayed/static state), where a GEMM uses it.
        g_scale = ctx.go_scale
        if g_scale is None and ((fp8_dx and not own_gdx) or (fp8_dw and not own_gdw)):
            g_scale = role_scale(
                spec.go_scaler,
                r.grad_output,
                g,
                update=spec.update,
                calibrating=spec.calibrating,
                state=go_state,
                reduce=spec.go_reduce,
            )
        # Each GEMM's scales, chosen once (a reduction across ranks runs once).
        gs_dx = gs_dw = ws_dx = xs_dw = None
        share_g = False
        if fp8_dx:
            gs_dx = own_scale(cdx.grad_output, g, spec.go_reduce) if own_gdx else g_scale
            if not isinstance(w, ScaledTensor) or r.own_cast("input_grad", "weight"):
                wsrc = _hp_value(w)
                own_w = r.own_cast("input_grad", "weight")
                ws_dx = own_scale(cdx.weight, wsrc, spec.w_reduce) if own_w else w_base
        if fp8_dw:
            g_tensor = cast_kind(cdw.grad_output) == "tensor"
            share_g = (
                fp8_dx
                and g_tensor
                and not (h_dx or h_dw)
                and r.same_cast("grad_output", "input_grad", "weight_grad")
                and same_operands(cdx, cdw)
            )
            if share_g:
                gs_dw = gs_dx
            elif g_tensor:
                gs_dw = own_scale(cdw.grad_output, g, spec.go_reduce) if own_gdw else g_scale
            if x is not None and cast_kind(cdw.input) == "tensor":
                own_x = r.own_cast("weight_grad", "input")
                xs_dw = own_scale(cdw.input, x, spec.x_reduce) if own_x else x_base
        sink: GemmSink | None = ctx.sink
        if sink is not None:
            scales = (gs_dx, ws_dx, gs_dw, xs_dw)
            observe_backward(ctx, saved, sink, g, fp8_dx, fp8_dw, scales, share_g)
        dx = dw = None
        if ctx.needs_input_grad[0] and not fp8_dx:  # dx = g W, unquantized
            wh = w.dequantize() if isinstance(w, ScaledTensor) else w
            dx = torch.matmul(g, wh.to(g.dtype)).to(x_dtype)
        if ctx.needs_input_grad[1] and not fp8_dw:  # dW = gᵀ x, unquantized
            xh = x if x is not None else dequantize_parts(xq_data, xq_scale, xpad, g.dtype)
            dw = torch.matmul(g.t(), xh.to(g.dtype)).to(w.dtype)
        gq: Operand | None = None
        gp: Parts | None = None
        if fp8_dx and h_dx:  # dx = Q(g Hᵀ) Q(H W)
            gh, wh = hadamard_pair(r, g, _hp_value(w))
            gg, gw = st.gen("input_grad", "grad_output", dev), st.gen("input_grad", "weight", dev)
            gs_h = own_scale(cdx.grad_output, gh, spec.go_reduce)
            gq = operand(gh, cdx.grad_output, 1, gs_h, cdx, gg)[0]
            wq_h = operand(wh, cdx.weight, 0, own_scale(cdx.weight, wh, spec.w_reduce), cdx, gw)
            dx = gemm(gq, wq_h[0], x_dtype, cdx)
        elif fp8_dx:  # dx = Q(g) Q(W)
            gq, _, gp = operand(
                g, cdx.grad_output, 1, gs_dx, cdx, st.gen("input_grad", "grad_output", dev)
            )
            wq: Operand
            if ctx.w_fwd is not None:  # the forward's Q(Wᵀ), transposed (2-D blocks)
                wq = ctx.w_fwd
            elif isinstance(w, ScaledTensor) and not r.own_cast("input_grad", "weight"):
                # tensor-wise: the forward's values, transposed
                wq = from_parts((w.qdata, w.scale, None), cdx.weight, 0, w.dtype, cdx)
            else:
                gw = st.gen("input_grad", "weight", dev)
                wq = operand(_hp_value(w), cdx.weight, 0, ws_dx, cdx, gw)[0]
            dx = gemm(gq, wq, x_dtype, cdx)
        gg_dw, gx_dw = (
            st.gen("weight_grad", "grad_output", dev),
            st.gen("weight_grad", "input", dev),
        )
        if fp8_dw and h_dw:  # dW = Q(gᵀ Hᵀ) Q(H x)
            xh = x if x is not None else dequantize_parts(xq_data, xq_scale, xpad, torch.float32)
            gh, xh = hadamard_pair(r, g.t(), xh)
            gs_h = own_scale(cdw.grad_output, gh, spec.go_reduce)
            gq_h = operand(gh, cdw.grad_output, 1, gs_h, cdw, gg_dw)[0]
            xq_h = operand(xh, cdw.input, 0, own_scale(cdw.input, xh, spec.x_reduce), cdw, gx_dw)
            dw = gemm(gq_h, xq_h[0], w.dtype, cdw)
        elif fp8_dw:  # dW = Q(g)ᵀ Q(x)
            gq_t: Operand
            xq: Operand
            cg = cdw.grad_output
            if share_g:  # the same values and scale, transposed
                assert gq is not None
                gq_t = transposed(gq, gp, cg, g.dtype)
            elif cast_kind(cg) == "tensor":
                g1, _, gp1 = operand(g, cg, 1, gs_dw, cdw, gg_dw)
                gq_t = transposed(g1, gp1, cg, g.dtype)
            else:
                gq_t = operand(g.t(), cg, 1, None, cdw, gg_dw)[0]
            if x is None:  # the forward's payload, quantized with this GEMM's cast
                if cast_kind(cdw.input) == "tensor":  # used transposed: same values, scale
                    xq = from_parts((xq_data, xq_scale, None), cdw.input, 0, x_dtype, cdw)
                else:  # re-quantize along the token dimension (documented double rounding)
                    deq = dequantize_parts(xq_data, xq_scale, xpad, torch.float32)
                    xq = operand(deq, cdw.input, 0, None, cdw, gx_dw)[0]
            else:  # tensor scale: the base role's (delayed/static/forward's) or its own
                xq = operand(x, cdw.input, 0, xs_dw, cdw, gx_dw)[0]
            dw = gemm(gq_t, xq, w.dtype, cdw)
        return dx, dw, None, None, None, None, None, None, None


def _hadamard_forward(
    ctx: Any,
    x: Tensor,
    w: Tensor,
    scales: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    spec: GemmSpec,
    out_dtype: torch.dtype,
) -> Tensor:
    """The forward GEMM of a recipe with ``"forward"`` in ``hadamard``:
    ``y = Q(x Hᵀ) Q(H Wᵀ)``, each operand quantized with its own (dynamic) scale; the
    high-precision input is saved for backward, with the roles' given scales
    (``x_scale``, ``w_scale``: ``None`` for a dynamic role, whose backward GEMM then takes
    the scale of its own operand)."""
    x_scale, w_scale, go_scale, go_state = scales
    r = spec.recipe
    cf, st = r.for_gemm("forward"), ctx.streams
    x_hp = _hp_value(x)
    xh, wh = hadamard_pair(r, x_hp, _hp_value(w).t())
    gx, gw = st.gen("forward", "input", x.device), st.gen("forward", "weight", w.device)
    xs = own_scale(cf.input, xh, spec.x_reduce)
    ws = own_scale(cf.weight, wh, spec.w_reduce)
    xq = operand(xh, cf.input, 1, xs, cf, gx)[0]
    wq = operand(wh, cf.weight, 0, ws, cf, gw)[0]
    if ctx.sink is not None and not recomputing(True):
        xo = observed("input", xh, cf.input, 1, xs, None, gx)
        ctx.sink("forward", xo, observed("weight", wh, cf.weight, 0, ws, None, gw))
        ctx.x_hp = x_hp.detach()
    y = gemm(xq, wq, out_dtype, cf)
    ctx.save_for_backward(x_hp, None, None, x_scale, w, w_scale)
    ctx.go_state, ctx.go_scale = go_state, go_scale
    ctx.spec, ctx.x_meta = spec, (None, x.dtype)
    return y
