"""The GEMM observation of :class:`~lowprec.float8.gemms.Float8MatmulFn`: each GEMM's two
operands as :class:`~lowprec.core.observe.CastOperand`\\ s, quantized again exactly as the
GEMM quantized them (its cast, its tensor-wise scale, its stochastic-rounding stream, its
Hadamard transform) and dequantized: the values the GEMM multiplied. An operand of a
Hadamard-transformed GEMM is observed transformed (``hp`` is the transformed operand; the
product of the two is the GEMM's product in exact arithmetic).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lowprec.core.formats import get_format
from lowprec.core.granularity import apply_scale
from lowprec.core.observe import CastOperand, GemmSink
from lowprec.core.tensor import ScaledTensor
from lowprec.float8.config import CastConfig, Float8Config
from lowprec.float8.gemm_options import Streams, hadamard_pair
from lowprec.float8.operands import cast_kind
from lowprec.float8.quant import dequantize_parts, quantize_parts

__all__ = ["hp_operand", "hp_value", "observe_backward", "observed", "transposed_operand"]


def hp_value(t: Tensor) -> Tensor:
    """``t``'s high-precision value: a ScaledTensor operand (FP8-gathered) dequantized."""
    if isinstance(t, ScaledTensor):
        return dequantize_parts(t.qdata, t.scale, None, torch.float32)
    return t


def hp_operand(role: str, t: Tensor) -> CastOperand:
    """An operand a high-precision GEMM multiplies as it is."""
    t = hp_value(t).detach()
    return CastOperand(role, t, t, get_format(t.dtype).name)


def observed(
    role: str,
    t: Tensor,
    cast: CastConfig,
    cd: int,
    scale: Tensor | None,
    src: Tensor | None = None,
    gen: torch.Generator | None = None,
) -> CastOperand:
    """The operand ``t`` (contracted over ``cd``) as the GEMM multiplies it: quantized with
    ``cast`` (at ``scale`` where the cast is tensor-wise, as the GEMM was; a stochastic cast
    with the GEMM's stream ``gen``) and dequantized. ``src``: the tensor the GEMM actually
    quantized, where it is not ``t`` itself (the dequantized saved input, re-quantized along
    the token dimension)."""
    hp = hp_value(t).detach()
    tensor = cast_kind(cast) == "tensor"
    data, s, pad = quantize_parts(
        hp if src is None else src, cast, cd, scale if tensor else None, gen
    )
    deq = dequantize_parts(data, s, pad, torch.float32)
    if s.dim() == 0 or s.numel() == 1:
        elem = s.reshape(())
    else:
        elem = apply_scale(torch.ones(data.shape, device=data.device), s)
        if pad is not None:
            elem = elem[: pad[0], : pad[1]]
    return CastOperand(role, hp, deq, cast.fmt, elem, s, cast.granularity)


def transposed_operand(o: CastOperand) -> CastOperand:
    """An observed operand used transposed by its GEMM (the same values)."""

    def t(v: Tensor | None) -> Tensor | None:
        return v.t() if v is not None and v.dim() == 2 else v

    hp, cast = o.hp.t(), o.cast.t()
    return CastOperand(o.role, hp, cast, o.fmt, t(o.scale), t(o.scales), o.granularity)


def observe_backward(
    ctx: Any,
    saved: tuple[Tensor, ...],
    sink: GemmSink,
    g: Tensor,
    fp8_dx: bool,
    fp8_dw: bool,
    scales: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    share_g: bool,
) -> None:
    """Hand the backward GEMMs' operands to ``sink`` as
    :class:`~lowprec.float8.gemms.Float8MatmulFn` quantizes them: each GEMM's casts
    (``recipe.for_gemm``), streams and transforms, and the tensor-wise scales it uses
    (``scales``: ``gs_dx``, ``ws_dx``, the input gradient's; ``gs_dw``, ``xs_dw``, the
    weight gradient's; ``None``: computed from the operand); ``share_g``: the weight
    gradient multiplies the input gradient's quantized gradient, transposed. ``saved``:
    ``ctx.saved_tensors`` as the backward read them (a non-reentrant checkpoint refuses a
    second read)."""
    gs_dx, ws_dx, gs_dw, xs_dw = scales
    x, xq_data, xq_scale, _, w, _ = saved
    r: Float8Config = ctx.spec.recipe
    st: Streams = ctx.streams
    dev = g.device
    xpad, _ = ctx.x_meta
    if ctx.needs_input_grad[0]:
        if not fp8_dx:
            sink("input_grad", hp_operand("grad_output", g), hp_operand("weight", w))
        elif "input_grad" in r.hadamard:
            cdx = r.for_gemm("input_grad")
            gh, wh = hadamard_pair(r, g, hp_value(w))
            go = observed(
                "grad_output",
                gh,
                cdx.grad_output,
                1,
                None,
                None,
                st.gen("input_grad", "grad_output", dev),
            )
            wo = observed(
                "weight", wh, cdx.weight, 0, None, None, st.gen("input_grad", "weight", dev)
            )
            sink("input_grad", go, wo)
        else:
            cdx = r.for_gemm("input_grad")
            if isinstance(w, ScaledTensor) and not r.own_cast("input_grad", "weight"):
                ws_dx = w.scale
            go = observed(
                "grad_output",
                g,
                cdx.grad_output,
                1,
                gs_dx,
                None,
                st.gen("input_grad", "grad_output", dev),
            )
            if ctx.w_fwd is not None:  # the forward's quantized weight, transposed
                wf = observed(
                    "weight",
                    hp_value(w).t(),
                    cdx.weight,
                    0,
                    None,
                    None,
                    st.gen("forward", "weight", dev),
                )
                wo = transposed_operand(wf)
            else:
                wo = observed(
                    "weight", w, cdx.weight, 0, ws_dx, None, st.gen("input_grad", "weight", dev)
                )
            sink("input_grad", go, wo)
    if not ctx.needs_input_grad[1]:
        return
    x_hp = ctx.x_hp if ctx.x_hp is not None else x
    if x_hp is None:  # only the quantized input was kept (no observation in forward)
        x_hp = dequantize_parts(xq_data, xq_scale, xpad, torch.float32)
    if not fp8_dw:
        sink("weight_grad", hp_operand("grad_output", g.t()), hp_operand("input", x_hp))
        return
    cdw = r.for_gemm("weight_grad")
    cg = cdw.grad_output
    if "weight_grad" in r.hadamard:
        gh, xh = hadamard_pair(r, g.t(), hp_value(x_hp))
        gt = observed(
            "grad_output", gh, cg, 1, None, None, st.gen("weight_grad", "grad_output", dev)
        )
        xo = observed("input", xh, cdw.input, 0, None, None, st.gen("weight_grad", "input", dev))
        sink("weight_grad", gt, xo)
        return
    if cast_kind(cg) == "tensor":  # quantized as g (shared or not), used transposed
        g_gemm = "input_grad" if share_g else "weight_grad"
        gt = transposed_operand(
            observed("grad_output", g, cg, 1, gs_dw, None, st.gen(g_gemm, "grad_output", dev))
        )
    else:
        gt = observed(
            "grad_output", g.t(), cg, 1, gs_dw, None, st.gen("weight_grad", "grad_output", dev)
        )
    x_tensor = cast_kind(cdw.input) == "tensor"
    src = None
    x_gen = st.gen("weight_grad", "input", dev)
    if x is None and not x_tensor:  # the saved input, dequantized and re-quantized
        src = dequantize_parts(xq_data, xq_scale, xpad, torch.float32)
    elif x is None:  # the forward's payload: the forward's draws
        x_gen = st.gen("forward", "input", dev)
    xs = (xq_scale if x is None else xs_dw) if x_tensor else None
    sink("weight_grad", gt, observed("input", x_hp, cdw.input, 0, xs, src, x_gen))
