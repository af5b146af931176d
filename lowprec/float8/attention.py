"""FP8 attention: the two GEMMs of ``softmax(Q Kᵀ·τ + M) V`` and the four of its backward
in FP8 with dynamic scales, emulated; the softmax in FP32.

For one batch and head, ``Q (L×D)``, ``K (N×D)``, ``V (N×E)``, the scale ``τ`` (default
``1/√D``) and an additive mask ``M`` (``0`` or ``-inf`` for a boolean or causal mask)::

    S  = τ · Q₈ K₈ᵀ              forward,  contracted over D
    P  = softmax(S + M)           FP32 (a row with no allowed key gives P = 0)
    P̃  = P ⊙ Z / (1 − p)          dropout p, Z ~ Bernoulli(1 − p) (P̃ = P without dropout)
    O  = P̃₈ V₈                    forward,  contracted over N
    dP̃ = dO₈ V₈ᵀ                  backward, contracted over E
    dV = P̃₈ᵀ dO₈                  backward, contracted over L
    dS = P ⊙ (dP − rowsum(dP ⊙ P)),  dP = dP̃ ⊙ Z / (1 − p)      FP32
    dQ = τ · dS₈ K₈              backward, contracted over N
    dK = τ · dS₈ᵀ Q₈             backward, contracted over L

``X₈`` is ``X`` quantized for the GEMM it enters (:func:`~lowprec.float8.quant.quantize_values`,
else :func:`~lowprec.float8.quant.quantize_parts`: the linears' casts) with a dynamic scale
``s = amax / fmt.max`` over a group chosen by the ``scaling`` (:data:`ATTENTION_SCALINGS`):

* ``tensorwise``: one scale for the whole operand (all batches and heads);
* ``headwise``: one scale per batch and head (a ``L×D`` or ``L×N`` matrix);
* ``rowwise``: one scale per index of the operand's non-contracted dimension (per query
  row of ``Q`` and ``P``, per key of ``K``, per channel of ``V`` in ``P V``, ...): an
  operand is quantized again for each GEMM that contracts it along another dimension.

Each GEMM is the hardware formula of :func:`~lowprec.float8.mm.payload_mm`: the payloads'
products (exact in FP32), accumulated in FP32, times the row and column scales. ``Q, K, P,
V`` are in ``fmt``, ``dO`` and ``dS`` in ``grad_fmt`` (:data:`FP8_FORMATS`; by default E4M3
and E5M2, :func:`attention_formats` gives a config's: its linears' input and gradient
formats). Grouped-query attention repeats each key/value head for its query heads (the
quantized values equal those of the unrepeated head at every granularity); the repeated
heads' gradients are summed in FP32. The six GEMMs and the softmax are one op: they run
without autocast and without torch function handling, so a torch function mode around the
model (e.g. unit scaling's op rewriting) does not rewrite the ops inside it. Where it is
applied to models: :mod:`lowprec.float8.attention_apply`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lowprec.core.autograd import apply_fn
from lowprec.core.checks import check_flag, check_number
from lowprec.core.upcast import upcast
from lowprec.float8.config import ATTENTION_SCALINGS, CastConfig, Float8Config
from lowprec.float8.mm import autocast_off, payload_mm
from lowprec.float8.quant import quantize_parts, quantize_values

__all__ = [
    "ATTENTION_GEMMS",
    "ATTENTION_SCALINGS",
    "FP8_FORMATS",
    "FP8Attention",
    "attention_formats",
    "attention_gemms",
    "fp8_attention",
]

FP8_FORMATS = ("e4m3fn", "e5m2")
"""The formats of attention's operands."""
Quantized = tuple[Tensor, Tensor, str]  # payload values (FP32), broadcastable scale, kind


def _check_scaling(scaling: object) -> str:
    if scaling not in ATTENTION_SCALINGS:
        raise ValueError(f"scaling must be one of {ATTENTION_SCALINGS}, got {scaling!r}")
    return str(scaling)


def _check_fmt(name: str, fmt: object) -> str:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"{name} must be one of {FP8_FORMATS}, got {fmt!r}")
    return str(fmt)


def attention_formats(config: Float8Config) -> tuple[str, str]:
    """``(fmt, grad_fmt)`` of FP8 attention under ``config``: its ``input`` and
    ``grad_output`` formats, each where it is one of :data:`FP8_FORMATS`, else E4M3 and
    E5M2 (a recipe whose linears run FP4 keeps attention in FP8)."""
    f, g = config.input.fmt, config.grad_output.fmt
    return (f if f in FP8_FORMATS else "e4m3fn", g if g in FP8_FORMATS else "e5m2")


def _cast(fmt: str, scaling: str) -> CastConfig:
    return CastConfig(fmt, granularity="tensor" if scaling == "tensorwise" else "axis")


def _values(m: Tensor, cast: CastConfig) -> tuple[Tensor, Tensor]:
    """The FP32 payload values and scale of the 2-D ``m`` quantized with ``cast`` along its
    dim 1 (one kernel where :func:`quantize_values` applies, else :func:`quantize_parts`)."""
    vs = quantize_values(m, cast, 1, torch.float32)
    if vs is None:
        data, s, _ = quantize_parts(m, cast, 1)
        vs = (upcast(data, torch.float32), s)
    return vs


def _quant(x: Tensor, cast: CastConfig, scaling: str, last: bool) -> Quantized:
    """``x (..., R, C)`` quantized for a GEMM that contracts its last dim (``last``) or its
    dim -2: the payload values in ``x``'s layout and a scale broadcastable to it."""
    *lead, r, c = x.shape
    if scaling == "tensorwise":
        v, s = _values(x.reshape(-1, c), cast)
        return v.view(x.shape), s.reshape((1,) * x.dim()), "tensor"
    if scaling == "headwise":
        v, s = _values(x.reshape(-1, r * c), cast)
        return v.view(x.shape), s.reshape(*lead, 1, 1), "axis"
    if last:
        v, s = _values(x.reshape(-1, c), cast)
        return v.view(x.shape), s.reshape(*lead, r, 1), "axis"
    v, s = _values(x.transpose(-1, -2).reshape(-1, r), cast)
    return v.view(*lead, c, r).transpose(-1, -2), s.reshape(*lead, c, 1).transpose(-1, -2), "axis"


def _t(a: Quantized) -> Quantized:
    return a[0].transpose(-1, -2), a[1].transpose(-1, -2), a[2]


def _mm(a: Quantized, b: Quantized) -> Tensor:
    """``a · b`` by the hardware formula (payload products, FP32 sums, then the scales)."""
    return payload_mm(a[0], a[1], a[2], b[0], b[1], b[2], torch.float32)


def _softmax(s: Tensor) -> Tensor:
    """FP32 softmax over the last dim; a row whose every entry is ``-inf`` gives zeros
    (NaN inputs still give NaN)."""
    dead = s.amax(-1, keepdim=True) == -math.inf
    return torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)


class _FP8Attention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        tau: float,
        p: float,
        scaling: str,
        fmts: tuple[str, str],
    ) -> Tensor:
        fwd = _cast(fmts[0], scaling)
        with autocast_off(q.device.type), torch._C.DisableTorchFunction():
            s = _mm(_quant(q, fwd, scaling, True), _t(_quant(k, fwd, scaling, True))) * tau
            if bias is not None:
                s = s + bias
            prob = _softmax(s)
            keep = None
            pd = prob
            if p > 0.0:
                keep = torch.empty_like(prob).bernoulli_(1.0 - p).bool()
                pd = prob * keep / (1.0 - p)
            out = _mm(_quant(pd, fwd, scaling, True), _quant(v, fwd, scaling, False))
        ctx.save_for_backward(q, k, v, prob, keep)
        ctx.tau, ctx.p, ctx.scaling, ctx.fmts = tau, p, scaling, fmts
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, do: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, prob, keep = ctx.saved_tensors
        tau, p, scaling = ctx.tau, ctx.p, ctx.scaling
        fwd, bwd = _cast(ctx.fmts[0], scaling), _cast(ctx.fmts[1], scaling)
        with autocast_off(q.device.type), torch._C.DisableTorchFunction():
            g = do.float()
            pd = prob if keep is None else prob * keep / (1.0 - p)
            dp = _mm(_quant(g, bwd, scaling, True), _t(_quant(v, fwd, scaling, True)))
            dv = _mm(_t(_quant(pd, fwd, scaling, False)), _quant(g, bwd, scaling, False))
            if keep is not None:
                dp = dp * keep / (1.0 - p)
            ds = prob * (dp - (dp * prob).sum(-1, keepdim=True))
            dq = _mm(_quant(ds, bwd, scaling, True), _quant(k, fwd, scaling, False)) * tau
            dk = _mm(_t(_quant(ds, bwd, scaling, False)), _quant(q, fwd, scaling, False)) * tau
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _float(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point or x.dim() < 2:
        what = f"shape {tuple(x.shape)}, dtype {x.dtype}" if isinstance(x, Tensor) else type(x)
        raise ValueError(f"{name}: expected a floating-point (..., L, E) tensor, got {what}")
    return x


def _check_mask(attn_mask: object, q: Tensor, k: Tensor) -> None:
    """``TypeError`` unless ``attn_mask`` is a boolean or floating-point tensor (as
    ``F.scaled_dot_product_attention``: an integer 0/1 mask is neither a keep mask nor a
    bias), ``ValueError`` unless it broadcasts to the scores' shape ``(..., H, L, N)``
    (``k`` with the query heads already)."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"attn_mask must be a bool (True = may attend) or floating-point (additive) "
            f"tensor, got {attn_mask.dtype} (a 0/1 keep mask: pass attn_mask.bool())"
        )
    # the scores' batch dims: q's and k's broadcast (a mismatch is matmul's error)
    batch = [b if a == 1 else a for a, b in zip(q.shape[:-2], k.shape[:-2], strict=True)]
    target = (*batch, q.shape[-2], k.shape[-2])
    shape = tuple(attn_mask.shape)
    ok = len(shape) <= len(target) and all(
        m in (1, t) for m, t in zip(reversed(shape), reversed(target), strict=False)
    )
    if not ok:
        raise ValueError(
            f"attn_mask: shape {shape} does not broadcast to the attention "
            f"scores' shape {target} (..., H, L, N)"
        )


def fp8_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    scaling: str = "tensorwise",
    fmt: str = "e4m3fn",
    grad_fmt: str = "e5m2",
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, ...)`` with its GEMMs in FP8 (module
    docstring), ``scaling`` one of :data:`ATTENTION_SCALINGS`, operands in ``fmt`` and
    gradients in ``grad_fmt`` (:data:`FP8_FORMATS`); output in ``q``'s dtype.

    ``q (..., H, L, D)``, ``k (..., H_kv, N, D)``, ``v (..., H_kv, N, E)``; ``attn_mask``
    broadcastable to ``(..., H, L, N)`` (else ``ValueError``): boolean (``True`` = may
    attend) or additive (floating-point, no gradient); any other dtype, an integer 0/1
    mask included, raises ``TypeError`` (as torch); ``is_causal``: query ``i`` attends
    keys ``j ≤ i`` (top-left aligned, as torch); ``enable_gqa``: ``H`` a multiple of
    ``H_kv``. Dropout ``p`` draws from torch's global generator.

    Example:
        >>> q = torch.randn(2, 4, 16, 8); kv = torch.randn(2, 2, 16, 8)
        >>> y = fp8_attention(q, kv, kv, is_causal=True, enable_gqa=True, scaling="rowwise")
        >>> ref = torch.nn.functional.scaled_dot_product_attention(
        ...     q, kv, kv, is_causal=True, enable_gqa=True)
        >>> bool((y - ref).norm() < 0.1 * ref.norm())
        True
    """
    scaling = _check_scaling(scaling)
    fmts = (_check_fmt("fmt", fmt), _check_fmt("grad_fmt", grad_fmt))
    q, k, v = _float("q", q), _float("k", k), _float("v", v)
    if (
        not (q.dim() == k.dim() == v.dim())
        or k.shape[:-1] != v.shape[:-1]
        or q.shape[-1] != k.shape[-1]
    ):
        raise ValueError(
            f"q, k, v: shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not "
            "form (..., H, L, D), (..., H_kv, N, D), (..., H_kv, N, E)"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    is_causal = check_flag("is_causal", is_causal)
    enable_gqa = check_flag("enable_gqa", enable_gqa)
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask, is_causal: give one of them, not both (as torch)")
    if scale is not None:  # a finite number (a string, NaN or Inf was taken as it came)
        scale = check_number("scale", scale)
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        if not enable_gqa or k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
            raise ValueError(
                f"q, k: {q.shape[-3]} query heads and {k.shape[-3]} key/value heads need "
                "enable_gqa=True and a whole number of query heads per key/value head"
            )
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    tau = q.shape[-1] ** -0.5 if scale is None else float(scale)
    n, length = k.shape[-2], q.shape[-2]
    bias: Tensor | None = None
    if is_causal:
        allowed = torch.ones(length, n, dtype=torch.bool, device=q.device).tril()
        bias = torch.zeros(length, n, device=q.device).masked_fill(~allowed, -math.inf)
    elif attn_mask is not None:
        _check_mask(attn_mask, q, k)
        if attn_mask.requires_grad:
            raise ValueError("attn_mask: a mask that requires grad is not supported")
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, device=q.device).masked_fill(~attn_mask, -math.inf)
        else:
            bias = attn_mask.float()
    out: Tensor = apply_fn(_FP8Attention, q, k, v, bias, tau, float(dropout_p), scaling, fmts)
    return out


ATTENTION_GEMMS = ("qk", "pv", "dp", "dv", "dq", "dk")
"""The GEMMs of :func:`attention_gemms`: ``S = Q Kᵀ``, ``O = P V``, ``dP = dO Vᵀ``,
``dV = Pᵀ dO``, ``dQ = dS K``, ``dK = dSᵀ Q`` (without the factor ``τ``)."""


def attention_gemms(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, bias: Tensor | None = None,
    scale: float | None = None, *, scaling: str = "tensorwise", fmt: str = "e4m3fn",
    grad_fmt: str = "e5m2",
) -> dict[str, tuple[Tensor, Tensor]]:  # fmt: skip
    """Each GEMM of :data:`ATTENTION_GEMMS` on the operands of FP32 attention (``P`` and
    ``dS`` from FP32 ``q, k, v`` and output gradient ``do``, all ``(..., H, L, D)`` with
    as many key/value heads as query heads; ``bias`` an additive mask), as
    ``(FP8 product, FP32 product)``: the FP8 one quantizes both operands as
    :func:`fp8_attention` does with ``scaling``, ``fmt`` and ``grad_fmt``, so the pair
    measures that GEMM's quantization error alone (e.g. its SQNR)."""
    scaling = _check_scaling(scaling)
    fwd = _cast(_check_fmt("fmt", fmt), scaling)
    bwd = _cast(_check_fmt("grad_fmt", grad_fmt), scaling)
    q, k, v, g = (t.detach().float() for t in (q, k, v, do))
    tau = q.shape[-1] ** -0.5 if scale is None else scale
    s = q @ k.transpose(-1, -2) * tau
    prob = _softmax(s if bias is None else s + bias)
    dp = g @ v.transpose(-1, -2)
    ds = prob * (dp - (dp * prob).sum(-1, keepdim=True))
    pairs = {  # (a, a's cast, b, b's cast, b transposed): a · (bᵀ if transposed else b)
        "qk": (q, fwd, k, fwd, True), "pv": (prob, fwd, v, fwd, False),
        "dp": (g, bwd, v, fwd, True), "dv": (prob.transpose(-1, -2), fwd, g, bwd, False),
        "dq": (ds, bwd, k, fwd, False), "dk": (ds.transpose(-1, -2), bwd, q, fwd, False),
    }  # fmt: skip
    out = {}
    for name, (a, ca, b, cb, bt) in pairs.items():
        qa = _quant(a, ca, scaling, True)
        qb = _t(_quant(b, cb, scaling, True)) if bt else _quant(b, cb, scaling, False)
        out[name] = (_mm(qa, qb), a @ (b.transpose(-1, -2) if bt else b))
    return out


@dataclass(frozen=True)
class FP8Attention:
    """The attention hook's function (:mod:`lowprec.float8.attention_apply`):
    :func:`fp8_attention` with ``scaling``, ``fmt`` and ``grad_fmt``, called with
    ``F.scaled_dot_product_attention``'s arguments."""

    scaling: str = "tensorwise"
    fmt: str = "e4m3fn"
    grad_fmt: str = "e5m2"

    def __post_init__(self) -> None:
        _check_scaling(self.scaling)
        _check_fmt("fmt", self.fmt)
        _check_fmt("grad_fmt", self.grad_fmt)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        return fp8_attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            scaling=self.scaling, fmt=self.fmt, grad_fmt=self.grad_fmt,
        )  # fmt: skip
