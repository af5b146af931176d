"""Float8 grouped GEMMs: the three GEMMs of the experts of an MoE layer in a narrow format.

Tokens arrive grouped by expert: rows ``offs[e-1] ≤ i < offs[e]`` of ``x (M×K)`` belong to
expert ``e`` (``offs``: the cumulative row ends, as ``torch._grouped_mm`` takes them), whose
weight is ``W_e``, the ``e``-th matrix of ``w (E×N×K)``. :class:`GroupedFloat8Fn` computes,
for every expert at once,

=========  ===================================  ====================
GEMM       per expert ``e``                     contracted dimension
=========  ===================================  ====================
forward    ``y_e = Q(x_e) Q(W_e)ᵀ``             K
dgrad      ``dx_e = Q(g_e) Q(W_e)``             N
wgrad      ``dW_e = Q(g_e)ᵀ Q(x_e)``            ``M_e`` (its tokens)
=========  ===================================  ====================

**Per-expert semantics.** Each expert's operands are quantized as :class:`Float8Linear`
quantizes its own, with the cast :meth:`Float8Config.gemm_cast` gives the GEMM and role
(:func:`~lowprec.float8.quant.quantize_parts` of ``x_e``, ``W_e``, ``g_e``): a tensor-wise
cast has one scale per expert for the weight *and* one per expert's group of tokens for
``x`` and ``g``; row-wise scales are per token row (or per column of a group, where the
tokens are contracted); block, MX and NVFP4 blocks never straddle two experts (a group is
zero-padded to whole blocks, the core padding policy); NVFP4's tensor-level scale is one
per expert. So the grouped GEMM *is* the loop of per-expert GEMMs, without the loop:
:func:`~lowprec.float8.grouped_quant.quantize_grouped` quantizes all groups in one pass
(segment maxima for the per-group scales, a padded layout for blocks along the token dim)
and the GEMMs are ``torch._grouped_mm`` of the dequantized values (products of narrow
values are exact in float32, accumulated in float32: the emulation of
:mod:`lowprec.float8.mm`). An expert that receives no token gets ``dW_e = 0``.

Scaling: dynamic, ``static`` with a given ``static_scale`` (the same scale for every
expert), or per-expert scales chosen by the caller (:class:`GroupedScales`: delayed scaling
with one ``amax`` history per expert, which :class:`~lowprec.float8.experts.Float8Experts`
keeps). Calibrated static scaling, stochastic rounding and Hadamard transforms are refused
with a ``ValueError`` (:func:`grouped_linear`, which keeps no history, refuses delayed
scaling too); :func:`grouped_config` gives the dynamic, nearest-rounding config that
``Float8Experts`` runs instead (logging which change it made).
``high_precision_gemms`` multiply the unquantized operands; ``fp8_saved_activations`` does
not apply (the high-precision input is saved for the weight gradient, which quantizes it
with its own cast: the numerics of ``fp8_saved_activations=False``).

On CUDA (compute capability 9.0, ``emulate`` not ``True``) the forward GEMM of E4M3
tensor- or row-wise operands uses ``torch._scaled_grouped_mm`` (bf16 output): a tensor-wise
scale per group is the row-wise scale of each of its rows, the same values. (That path is
not exercised by the CPU test suite.)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lowprec.core.autograd import apply_outside_graph
from lowprec.core.formats import get_format
from lowprec.core.rounding import to_format
from lowprec.core.warn import warn_once
from lowprec.float8.config import GEMM_ROLES, GEMMS, ROLES, CastConfig, Float8Config
from lowprec.float8.grouped_quant import _groups, _segment_amax, group_amax, quantize_grouped
from lowprec.float8.mm import autocast_off
from lowprec.float8.operands import EMULATION_DTYPES

__all__ = ["GroupedFloat8Fn", "GroupedScales", "grouped_config", "grouped_linear", "run_grouped"]

log = logging.getLogger(__name__)


def _aligned(t: Tensor) -> Tensor:
    """``t`` itself where ``torch._grouped_mm`` takes its layout — one of its last two dims
    of stride 1, the other's stride a multiple of 16 bytes (and at least that dim's size),
    the data 16-byte aligned — else a copy of the same values in such a layout: the stride-1
    dim kept (row- or column-major), the other stride rounded up to 16 bytes (a view of a
    padded buffer; the padding is never read). An odd in- or out-features count (e.g. 21
    float32 columns: an 84-byte row) is what makes the copy necessary."""
    al = 16 // t.element_size()
    s, shape = t.stride(), t.shape
    if t.data_ptr() % 16 == 0:
        if s[-1] == 1 and s[-2] >= max(1, shape[-1]) and s[-2] % al == 0:
            return t
        if s[-2] == 1 and s[-1] >= max(1, shape[-2]) and s[-1] % al == 0:
            return t
    col = s[-2] == 1 and s[-1] != 1  # column-major (a transposed view): kept so
    u = t.transpose(-1, -2) if col else t
    n = u.shape[-1]
    buf = u.new_zeros(*u.shape[:-1], -(-max(n, 1) // al) * al)
    buf[..., :n] = u
    v = buf[..., :n]
    return v.transpose(-1, -2) if col else v


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Per group ``e``: ``a_e · b_e``. With a 3-D ``b (E×K×N)``, ``a (M×K)`` is grouped
    by rows and the result is ``(M×N)``; with a 2-D ``b (M×K)``, ``a (N×M)`` and ``b`` are
    grouped along the contracted ``M`` and the result is ``(E×N×K)`` (an empty group: 0).
    Any sizes and strides: ``torch._grouped_mm`` where it takes the dtype (float32,
    bfloat16), on operands laid out as its stride rules require (:func:`_aligned`: copied
    to 16-byte-aligned rows where they are not), else one ``bmm`` of the groups padded to
    the largest one (float64). The result is contiguous."""
    o = offs.to(torch.int32)
    a = a.contiguous() if 0 in a.stride() else a  # an expanded gradient (stride 0)
    b = b.contiguous() if 0 in b.stride() else b
    if a.dtype in (torch.float32, torch.bfloat16) and hasattr(torch, "_grouped_mm"):
        with autocast_off(a.device.type):
            out: Tensor = torch._grouped_mm(_aligned(a), _aligned(b), offs=o)
        return out.contiguous()  # an odd last dim comes back in a padded layout
    m = a.shape[0] if b.dim() == 3 else b.shape[0]
    gid, counts, starts = _groups(offs, m)
    e, c = offs.numel(), int(counts.max()) if offs.numel() else 0
    pos = torch.arange(m, device=a.device) - starts[gid]
    if b.dim() == 3:
        ap = a.new_zeros(e, c, a.shape[1])
        ap[gid, pos] = a
        return torch.bmm(ap, b)[gid, pos]
    at, bp = a.new_zeros(e, c, a.shape[0]), b.new_zeros(e, c, b.shape[1])
    at[gid, pos], bp[gid, pos] = a.t(), b
    return torch.bmm(at.transpose(1, 2), bp)


@dataclass(frozen=True, eq=False)
class GroupedScales:
    """Per-expert scales of the base roles, chosen outside :class:`GroupedFloat8Fn` (delayed
    scaling, :class:`~lowprec.float8.experts.Float8Experts`): ``input`` and ``weight``, ``(E,)``
    or ``None`` (the cast's own); ``grad_output``, a function of the gradient's per-expert
    :func:`~lowprec.float8.grouped_quant.group_amax` that returns its ``(E,)`` scales
    (recording them), or ``None``. A GEMM whose cast of a role is its own
    (:meth:`Float8Config.own_cast`) does not use them."""

    input: Tensor | None = None
    weight: Tensor | None = None
    grad_output: Callable[[Tensor], Tensor | None] | None = None


def _scale(r: Float8Config, gemm: str, role: str, base: Tensor | None) -> Tensor | None:
    """The given scale GEMM ``gemm`` quantizes ``role`` with: ``base`` (the role's
    per-expert scales) unless the GEMM has its own cast, else the cast's static scale."""
    if base is None or r.own_cast(gemm, role):
        return _given(r.gemm_cast(gemm, role))
    return base


def _unsupported(r: Float8Config, delayed: bool = False) -> list[str]:
    """What of ``r`` the grouped GEMMs do not implement (empty: supported); ``delayed``:
    the caller keeps per-expert histories (:class:`GroupedScales`)."""
    out = []
    for gemm in GEMMS:
        c = r.for_gemm(gemm)
        for role in GEMM_ROLES[gemm]:
            cast = c.cast(role)
            if (cast.scaling == "delayed" and not delayed) or (
                cast.scaling == "static" and cast.static_scale is None
            ):
                out.append(f"{gemm}/{role}: scaling={cast.scaling!r}")
            if cast.rounding != "nearest":
                out.append(f"{gemm}/{role}: rounding={cast.rounding!r}")
    if r.hadamard:
        out.append(f"hadamard={r.hadamard!r}")
    return sorted(set(out))


def _dynamic(c: CastConfig, delayed: bool) -> CastConfig:
    keep = (c.scaling == "static" and c.static_scale is not None) or (
        delayed and c.scaling == "delayed"
    )
    if keep and c.rounding == "nearest":
        return c
    if keep:
        return dataclasses.replace(c, rounding="nearest")
    # made dynamic: the delayed-only fields back to their defaults (CastConfig refuses
    # a history length or algorithm on a cast that keeps no history)
    return dataclasses.replace(
        c,
        scaling="dynamic",
        rounding="nearest",
        history_len=CastConfig.history_len,  # the dataclass's defaults
        algo=CastConfig.algo,
    )


def grouped_config(r: Float8Config, delayed: bool = False) -> tuple[Float8Config, list[str]]:
    """``(config, changes)``: ``r`` as the grouped GEMMs run it — calibrated static casts
    (and delayed ones, unless ``delayed``: the caller keeps per-expert histories) made
    dynamic, stochastic rounding made nearest, no Hadamard transform — and what was
    changed (empty: ``r`` itself)."""
    changes = _unsupported(r, delayed)
    if not changes:
        return r, []
    casts = {role: _dynamic(r.cast(role), delayed) for role in ROLES}
    gemms = tuple(
        (g, c.replace(**{k: _dynamic(c.cast(k), delayed) for k in ROLES})) for g, c in r.gemms
    )
    return r.replace(**casts, gemms=gemms, hadamard=()), changes


def _hardware_ok(x: Tensor, r: Float8Config, gemm: str, roles: tuple[str, str]) -> bool:
    """``torch._scaled_grouped_mm`` applies: CUDA sm90, ``emulate`` not True, E4M3 tensor-
    or row-wise casts of both roles, dims multiples of 16 (checked by the caller)."""
    if r.emulate is True or x.device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    casts = [r.gemm_cast(gemm, role) for role in roles]
    return all(
        c.fmt == "e4m3fn"
        and c.scaling == "dynamic"
        and c.bound_granularity(1).kind in ("tensor", "axis")
        for c in casts
    )


def _hardware_gemm(a: Tensor, offs: Tensor, ca: CastConfig, b: Tensor, cb: CastConfig) -> Tensor:
    """``a_e · b_eᵀ`` for rows of ``a (M×K)`` grouped by ``offs`` and ``b (E×N×K)``, by
    ``torch._scaled_grouped_mm`` on row-wise E4M3 payloads (a per-group tensor-wise scale
    is the row-wise scale of each of its rows), bf16 output."""
    e, nn_, k = b.shape
    fmt = get_format("e4m3fn")

    def rows(t: Tensor, o: Tensor, cast: CastConfig) -> tuple[Tensor, Tensor]:
        gid, _, _ = _groups(o, t.shape[0])
        x = t.float()
        if cast.bound_granularity(1).kind == "tensor":
            s = cast.scale_for(_segment_amax(x.abs().amax(1), gid, o.numel()))[gid]
        else:
            s = cast.scale_for(x.abs().amax(1))
        return to_format(x / s.unsqueeze(1), fmt, saturate=True), s

    qa, sa = rows(a, offs, ca)
    bo = torch.arange(1, e + 1, device=b.device) * nn_
    qb, sb = rows(b.reshape(e * nn_, k), bo, cb)
    return torch._scaled_grouped_mm(  # type: ignore[attr-defined,no-any-return]
        qa,
        qb.reshape(e, nn_, k).transpose(1, 2),
        sa,
        sb.reshape(e, nn_),
        offs=offs.to(torch.int32),
        out_dtype=torch.bfloat16,
    )


class GroupedFloat8Fn(torch.autograd.Function):
    """The forward, input-gradient and weight-gradient GEMMs of grouped experts
    (module docstring): ``apply(x, w, offs, config, out_dtype, scales)`` with ``x (M×K)``
    grouped by ``offs``, ``w (E×N×K)``, ``scales`` a :class:`GroupedScales` or ``None``;
    returns ``y (M×N)`` in ``out_dtype``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        w: Tensor,
        offs: Tensor,
        r: Float8Config,
        out_dtype: torch.dtype,
        scales: GroupedScales | None = None,
    ) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        ctx.r, ctx.scales = r, scales or GroupedScales()
        sc: GroupedScales = ctx.scales
        if "forward" in r.high_precision_gemms:
            return _grouped_mm(x.to(out_dtype), w.to(out_dtype).transpose(1, 2), offs)
        cf = r.for_gemm("forward")
        _, n, k = w.shape
        hw = _hardware_ok(x, r, "forward", ("input", "weight"))
        if hw and sc.input is None and sc.weight is None and n % 16 == k % 16 == 0:
            return _hardware_gemm(x, offs, cf.input, w, cf.weight).to(out_dtype)
        if r.emulate is False:
            warn_once(
                log,
                "float8:grouped-hw-missing",
                "float8: emulate=False but the hardware grouped FP8 GEMM does not apply to "
                "these expert GEMMs (needs CUDA sm90, dynamic E4M3 tensor/row scales, dims "
                "% 16 == 0); emulating (reported once)",
            )
        ed = EMULATION_DTYPES[cf.emulation_dtype]
        xq = quantize_grouped(x, offs, cf.input, 1, ed, _scale(r, "forward", "input", sc.input))
        wq = _quantize_weight(w, cf.weight, 1, ed, _scale(r, "forward", "weight", sc.weight))
        return _grouped_mm(xq, wq.transpose(1, 2), offs).to(out_dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w, offs = ctx.saved_tensors
        r: Float8Config = ctx.r
        sc: GroupedScales = ctx.scales
        hp = r.high_precision_gemms
        dx = dw = None
        fp8 = [gm for i, gm in ((0, "input_grad"), (1, "weight_grad")) if ctx.needs_input_grad[i]]
        base = [gm for gm in fp8 if gm not in hp and not r.own_cast(gm, "grad_output")]
        gs = sc.grad_output(group_amax(g, offs)) if sc.grad_output and base else None
        if ctx.needs_input_grad[0]:
            if "input_grad" in hp:
                dx = _grouped_mm(g.to(x.dtype), w.to(x.dtype), offs)
            else:
                c = r.for_gemm("input_grad")
                ed = EMULATION_DTYPES[c.emulation_dtype]
                gq = quantize_grouped(
                    g, offs, c.grad_output, 1, ed, _scale(r, "input_grad", "grad_output", gs)
                )
                ws = _scale(r, "input_grad", "weight", sc.weight)
                dx = _grouped_mm(gq, _quantize_weight(w, c.weight, 0, ed, ws), offs).to(x.dtype)
        if ctx.needs_input_grad[1]:
            if "weight_grad" in hp:
                dw = _grouped_mm(g.to(w.dtype).t(), x.to(w.dtype), offs)
            else:
                c = r.for_gemm("weight_grad")
                ed = EMULATION_DTYPES[c.emulation_dtype]
                gq = quantize_grouped(
                    g, offs, c.grad_output, 0, ed, _scale(r, "weight_grad", "grad_output", gs)
                )
                xs = _scale(r, "weight_grad", "input", sc.input)
                xq = quantize_grouped(x, offs, c.input, 0, ed, xs)
                dw = _grouped_mm(gq.t(), xq, offs).to(w.dtype)
        return dx, dw, None, None, None, None


def _given(cast: CastConfig) -> Tensor | None:
    """The given static scale of ``cast`` (``None``: dynamic)."""
    return None if cast.static_scale is None else torch.tensor(float(cast.static_scale))


def _quantize_weight(
    w: Tensor, cast: CastConfig, cd: int, dtype: torch.dtype, scale: Tensor | None
) -> Tensor:
    """The dequantized values of each ``W_e`` of ``w (E×N×K)`` quantized for a GEMM that
    contracts its dim ``cd`` (1: K, forward; 0: N, input gradient), ``(E×N×K)``: the
    experts are groups of equal size of one matrix (contracted over its columns);
    ``scale``: given scales (one, or one per expert)."""
    e = w.shape[0]
    wt = w if cd == 1 else w.transpose(1, 2)  # the contracted dim last
    rows = wt.shape[1]
    offs = torch.arange(1, e + 1, device=w.device) * rows
    v = quantize_grouped(wt.reshape(e * rows, -1), offs, cast, 1, dtype, scale)
    v = v.reshape(e, rows, -1)
    return v if cd == 1 else v.transpose(1, 2)


def grouped_linear(
    x: Tensor,
    weight: Tensor,
    offs: Tensor,
    config: str | Float8Config = "tensorwise",
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``y_e = x_e W_eᵀ`` for the rows ``x_e`` of ``x (M×K)`` that ``offs`` (``(E,)``
    cumulative row ends, ``offs[-1] == M``) gives expert ``e``, ``weight (E×N×K)``, with
    the float8 GEMMs of ``config`` (a :class:`Float8Config` or a preset name) in forward
    and backward (:class:`GroupedFloat8Fn`). ``out_dtype``: the output's dtype (default
    ``x.dtype``).

    Example:
        >>> x, w = torch.randn(6, 32), torch.randn(3, 16, 32)
        >>> grouped_linear(x, w, torch.tensor([2, 2, 6]), "rowwise").shape
        torch.Size([6, 16])
    """
    r = Float8Config.from_name(config) if isinstance(config, str) else config
    if not isinstance(r, Float8Config):
        raise TypeError(f"config must be a Float8Config or a preset name, got {type(r).__name__}")
    for name, t in (("x", x), ("weight", weight), ("offs", offs)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(
            f"x: expected a floating-point (M, K) matrix, got {x.dtype} {tuple(x.shape)}"
        )
    if weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"weight: expected (E, N, K={x.shape[1]}) expert weights, got {tuple(weight.shape)}"
        )
    if offs.dim() != 1 or offs.numel() != weight.shape[0] or offs.dtype.is_floating_point:
        raise ValueError(
            f"offs: expected ({weight.shape[0]},) integer cumulative row ends, got "
            f"{offs.dtype} {tuple(offs.shape)}"
        )
    if not torch.compiler.is_compiling() and offs.numel():
        o = offs.long()
        if int(o[-1]) != x.shape[0] or bool((torch.diff(o, prepend=o.new_zeros(1)) < 0).any()):
            raise ValueError(
                f"offs: expected non-decreasing row ends ending at M={x.shape[0]}, got "
                f"{offs.tolist()}"
            )
    bad = _unsupported(r)
    if bad:
        raise ValueError(
            f"config: the grouped GEMMs do not implement {'; '.join(bad)} (grouped_config "
            "gives the dynamic, nearest-rounding config)"
        )
    if out_dtype is not None and not (
        isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point
    ):
        raise TypeError(f"out_dtype must be a floating-point torch.dtype, got {out_dtype!r}")
    y = run_grouped(x, weight, offs, r, out_dtype or x.dtype)
    return y


def run_grouped(
    x: Tensor,
    weight: Tensor,
    offs: Tensor,
    config: Float8Config,
    out_dtype: torch.dtype,
    scales: GroupedScales | None = None,
) -> Tensor:
    """:class:`GroupedFloat8Fn` applied to ``(x, weight, offs, config, out_dtype, scales)``
    (its docstring gives the shapes), eagerly or under ``torch.compile`` (then outside the
    graph); no checks (:func:`grouped_linear` checks a user's arguments).

    Outside the graph because torch 2.13's fake-tensor rule for ``torch._grouped_mm``
    accepts bf16 operands only, while the emulation multiplies the dequantized float32
    values (the CPU kernel takes float32), and the per-expert row counts are
    data-dependent."""
    y: Tensor = apply_outside_graph(GroupedFloat8Fn, x, weight, offs, config, out_dtype, scales)
    return y
