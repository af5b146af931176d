"""Float8 grouped GEMMs (lowprec.float8.grouped) against an FP64 per-expert loop.

The reference quantizes each expert's operands with the functions ``Float8Linear`` uses
(:func:`~lowprec.float8.quant.quantize_parts`, :func:`~lowprec.float8.quant.dequantize_parts`)
and multiplies them in float64. The grouped quantization must give the same values bit for
bit; the GEMMs differ only by float32 accumulation (see ``_close``).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lowprec.float8 import CastConfig, Float8Config, grouped_linear
from lowprec.float8.grouped import GroupedFloat8Fn, GroupedScales, grouped_config
from lowprec.float8.grouped_quant import group_amax, quantize_grouped
from lowprec.float8.quant import dequantize_parts, quantize_parts

# Groups with an empty expert, one smaller and one larger than a 32/128 block along tokens.
COUNTS = [5, 0, 37, 3, 140]
K, N = 80, 48  # not multiples of 32 or 128: blocks are padded

CONFIGS = [
    "tensorwise",
    "rowwise",
    "blockwise",
    "mxfp8",
    "mxfp4",
    "nvfp4",
    "naive",
    "rowwise-gw-hp",
    "tensorwise-wgrad-nvfp4",
]


def _custom() -> Float8Config:
    """2-D blocks on activations too (rows of 128 tokens) and NVFP4 16x16 weight blocks."""
    return Float8Config(
        input=CastConfig(granularity="block:128x128"),
        weight=CastConfig("e2m1", granularity="nv:16x16"),
        grad_output=CastConfig("e5m2", granularity="mx:32", mx_scale="ceil"),
        emulate=True,
    )


def _config(name: str) -> Float8Config:
    return _custom() if name == "custom" else Float8Config.from_name(name)


def _data(
    seed: int, counts: list[int] = COUNTS, n: int = N, k: int = K
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    m = sum(counts)
    # rows of very different magnitudes: per-group scales matter
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen).mul(8).exp2()
    mags = torch.tensor([0.5, 1, 4, 16, 0.1])[torch.arange(len(counts)) % 5]
    w = torch.randn(len(counts), n, k, generator=gen) * mags[:, None, None]
    g = torch.randn(m, n, generator=gen) * 1e-3
    offs = torch.cumsum(torch.tensor(counts), 0)
    return x, w, g, offs


def _q(t: Tensor, cast: CastConfig, cd: int) -> Tensor:
    """One expert's operand as Float8Linear quantizes it, dequantized (float32 values)."""
    if t.numel() == 0:
        return t.float()
    scale = None if cast.static_scale is None else torch.tensor(float(cast.static_scale))
    return dequantize_parts(*quantize_parts(t, cast, cd, scale), torch.float32)


def _reference(
    x: Tensor, w: Tensor, g: Tensor, r: Float8Config, counts: list[int] = COUNTS
) -> tuple[list[tuple[Tensor, Tensor]], ...]:
    """Per expert, per GEMM: the (a, b) operands (float64) whose product is the GEMM."""
    fwd, dgrad, wgrad = [], [], []
    start = 0
    hp = r.high_precision_gemms
    for e, n in enumerate(counts):
        xe, ge, we = x[start : start + n], g[start : start + n], w[e]
        start += n
        c = r.for_gemm("forward")
        fwd.append(
            (xe, we.t()) if "forward" in hp else (_q(xe, c.input, 1), _q(we.t(), c.weight, 0))
        )
        c = r.for_gemm("input_grad")
        dgrad.append((_q(ge, c.grad_output, 1), _q(we, c.weight, 0)))
        c = r.for_gemm("weight_grad")
        if "weight_grad" in hp:
            wgrad.append((ge.t(), xe))
        else:
            wgrad.append((_q(ge.t(), c.grad_output, 1), _q(xe, c.input, 0)))
    as64 = [[(a.double(), b.double()) for a, b in gemm] for gemm in (fwd, dgrad, wgrad)]
    return tuple(as64)


def _close(
    got: Tensor, pairs: list[tuple[Tensor, Tensor]], stack: bool, extra: float = 0.0
) -> None:
    """``got`` equals the FP64 products ``a @ b`` up to float32 accumulation: any order of
    summing ``K`` float32 products (each rounded once) errs by at most ``(K+1)·2⁻²⁴·Σ|a||b|``
    (the standard bound γ_{K+1}); ``extra`` adds a relative term for rounded operands."""
    refs = [a @ b for a, b in pairs]
    bounds = [a.abs() @ b.abs() for a, b in pairs]
    ref = torch.stack(refs) if stack else torch.cat(refs)
    bound = torch.stack(bounds) if stack else torch.cat(bounds)
    kk = max(a.shape[1] for a, _ in pairs)
    tol = ((kk + 1) * 2.0**-24 + extra) * bound + 1e-30
    assert bool(((got.double() - ref).abs() <= tol).all()), float((got.double() - ref).abs().max())


@pytest.mark.parametrize("name", [*CONFIGS, "custom"])
def test_grouped_gemms_equal_the_fp64_per_expert_loop(name: str) -> None:
    """Forward, input gradient and weight gradient (an expert with 0 tokens: dW_e = 0)."""
    r = _config(name)
    x, w, g, offs = _data(0)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_linear(xr, wr, offs, r)
    y.backward(g)
    fwd, dgrad, wgrad = _reference(x, w, g, r)
    _close(y, fwd, stack=False)
    assert xr.grad is not None and wr.grad is not None
    _close(xr.grad, dgrad, stack=False)
    _close(wr.grad, wgrad, stack=True)
    assert bool((wr.grad[1] == 0).all())  # the expert without tokens


# (N, K): out- and in-features that are not multiples of 4 (a float32 row of 16-byte
# multiples: torch._grouped_mm's stride rule), in either role, or not of 8 (bf16).
ODD_NK = [(33, 20), (32, 21), (30, 22), (21, 33)]
ODD_COUNTS = [3, 0, 9, 4]  # an expert without tokens, groups shorter than any block


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "mxfp8", "nvfp4", "rowwise-gw-hp"])
@pytest.mark.parametrize(("n", "k"), ODD_NK)
def test_odd_feature_counts_equal_the_fp64_per_expert_loop(name: str, n: int, k: int) -> None:
    """In- or out-features not a multiple of 4: output, input gradient and every expert's
    weight gradient equal the FP64 per-expert loop of the dequantized operands up to
    float32 accumulation (``_close``'s bound), as for aligned sizes."""
    r = _config(name)
    x, w, g, offs = _data(5, ODD_COUNTS, n, k)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_linear(xr, wr, offs, r)
    assert y.shape == (sum(ODD_COUNTS), n) and y.is_contiguous()
    y.backward(g)
    fwd, dgrad, wgrad = _reference(x, w, g, r, ODD_COUNTS)
    _close(y, fwd, stack=False)
    assert xr.grad is not None and wr.grad is not None
    _close(xr.grad, dgrad, stack=False)
    _close(wr.grad, wgrad, stack=True)
    assert bool((wr.grad[1] == 0).all())  # the expert without tokens


@pytest.mark.parametrize(("n", "k"), [(32, 20), (36, 24), (30, 22)])
def test_odd_feature_counts_bf16_emulation(n: int, k: int) -> None:
    """bf16 operands need rows of multiples of 8 elements for ``torch._grouped_mm``: with
    ``emulation_dtype="bf16"`` and ``out_dtype=bf16`` the GEMMs stay within the bound of
    ``test_bf16_emulation_and_out_dtype`` (operands 2⁻⁹ each, output 2⁻⁹) of the loop."""
    r = Float8Config.from_name("rowwise", emulation_dtype="bf16")
    x, w, g, offs = _data(6, ODD_COUNTS, n, k)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_linear(xr, wr, offs, r, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    y.backward(g.bfloat16())
    fwd, dgrad, wgrad = _reference(x, w, g.bfloat16().float(), r, ODD_COUNTS)
    extra = 2.0**-8 + 2.0**-8
    _close(y, fwd, stack=False, extra=extra)
    assert xr.grad is not None and wr.grad is not None
    _close(xr.grad, dgrad, stack=False, extra=extra)
    _close(wr.grad, wgrad, stack=True, extra=extra)


@pytest.mark.parametrize("name", [*CONFIGS, "custom"])
@pytest.mark.parametrize("role", ["input", "weight", "grad_output"])
@pytest.mark.parametrize("cd", [0, 1])
def test_quantize_grouped_is_bitwise_the_per_group_quantization(
    name: str, role: str, cd: int
) -> None:
    cast = _config(name).cast(role)
    x, _, _, offs = _data(1)
    scale = None if cast.static_scale is None else torch.tensor(float(cast.static_scale))
    got = quantize_grouped(x, offs, cast, cd, scale=scale)
    want = torch.cat([_q(xe, cast, cd) for xe in torch.split(x, COUNTS)])
    assert torch.equal(got, want)
    xb = x.bfloat16()  # 16-bit inputs: divided in float32, as quantize_parts does
    want = torch.cat([_q(xe, cast, cd) for xe in torch.split(xb, COUNTS)])
    assert torch.equal(quantize_grouped(xb, offs, cast, cd, scale=scale), want)


def test_bf16_emulation_and_out_dtype() -> None:
    """``emulation_dtype="bf16"`` rounds both dequantized operands to bf16 (2⁻⁹ each) and
    ``out_dtype=bf16`` the output (2⁻⁹): a relative ``2⁻⁸ + 2⁻⁹`` on top of the fp32 bound."""
    r = Float8Config.from_name("rowwise", emulation_dtype="bf16")
    x, w, g, offs = _data(2)
    y = grouped_linear(x, w, offs, r, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    _close(y, _reference(x, w, g, r)[0], stack=False, extra=2.0**-8 + 2.0**-8)


def test_float64_inputs_use_the_padded_fallback() -> None:
    """A float64 high-precision GEMM (no ``torch._grouped_mm`` kernel) runs on the padded
    bmm, equal to the loop to float64 rounding."""
    r = Float8Config.from_name("tensorwise", high_precision_gemms=("forward",))
    x, w, _, offs = _data(3)
    y = grouped_linear(x.double(), w.double(), offs, r)
    ref = torch.cat(
        [xe.double() @ w[e].double().t() for e, xe in enumerate(torch.split(x, COUNTS))]
    )
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


def test_grouped_config_makes_unsupported_casts_dynamic() -> None:
    for name in ("delayed", "static"):
        r, changes = grouped_config(Float8Config.from_name(name))
        assert changes and all(
            r.cast(role).scaling == "dynamic" for role in ("input", "grad_output")
        )
    r, changes = grouped_config(Float8Config.from_name("nvfp4-train"))
    assert changes and not r.hadamard and not r.stochastic
    r0 = Float8Config.from_name("naive")
    assert grouped_config(r0) == (r0, [])  # a given static scale is supported
    rd = Float8Config.from_name("delayed")
    assert grouped_config(rd, delayed=True) == (rd, [])  # the caller keeps the histories


def test_nv_scale_per_tensor_maxima() -> None:
    """``nv_scale(tensor_amax=)``: the blocks of two tensors side by side, each with its own
    tensor maximum, get the scales each tensor gets alone."""
    from lowprec.core.scales import nv_scale

    a, b = torch.rand(4, 3) * 5, torch.rand(2, 3) * 1e-3
    t_amax = torch.cat([a.amax().expand(4, 1), b.amax().expand(2, 1)])
    both = nv_scale(torch.cat([a, b]), "e2m1", tensor_amax=t_amax)
    assert torch.equal(both, torch.cat([nv_scale(a, "e2m1"), nv_scale(b, "e2m1")]))


def test_bad_input_names_the_argument() -> None:
    x, w, _, offs = _data(4)
    with pytest.raises(ValueError, match="offs"):
        grouped_linear(x, w, offs - 1, "tensorwise")
    with pytest.raises(ValueError, match="offs"):
        grouped_linear(x, w, offs.float(), "tensorwise")
    with pytest.raises(ValueError, match="weight"):
        grouped_linear(x, w[:, :, :8], offs, "tensorwise")
    with pytest.raises(ValueError, match="x"):
        grouped_linear(x[0], w, offs, "tensorwise")
    with pytest.raises(TypeError, match="config"):
        grouped_linear(x, w, offs, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_linear(x, w, offs, "tensorwise", out_dtype=torch.int32)
    with pytest.raises(ValueError, match="config"):
        grouped_linear(x, w, offs, "delayed")
    with pytest.raises(ValueError, match="cd"):
        quantize_grouped(x, offs, CastConfig(), 2)


def test_per_expert_scales_given_by_the_caller() -> None:
    """Delayed scaling's per-expert scales (:class:`GroupedScales`): expert ``e``'s
    operands are quantized with the given scale ``s_e`` (``quantize_parts(t, cast, cd,
    scale=s_e)`` per expert), the gradient's scales computed in backward from its
    per-expert ``amax`` (handed to the callback)."""
    r = Float8Config.from_name("tensorwise")
    x, w, g, offs = _data(5)
    e = len(COUNTS)
    sx, sw, sg = (
        torch.rand(e, generator=torch.Generator().manual_seed(i)) + 0.5 for i in (1, 2, 3)
    )
    sx, sw, sg = sx * 8, sw * 0.05, sg * 1e-4  # some values saturate: the scales are used
    seen: list[Tensor] = []

    def go(a: Tensor) -> Tensor:
        seen.append(a)
        return sg

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = GroupedFloat8Fn.apply(xr, wr, offs, r, torch.float32, GroupedScales(sx, sw, go))
    y.backward(g)
    assert torch.equal(seen[0], group_amax(g, offs))
    assert torch.equal(group_amax(g, offs)[1], torch.tensor(0.0))  # the expert with no token

    def q(t: Tensor, cast: CastConfig, cd: int, s: Tensor) -> Tensor:
        if t.numel() == 0:
            return t.float()
        return dequantize_parts(*quantize_parts(t, cast, cd, s), torch.float32)

    fwd, dgrad, wgrad = [], [], []
    for i, (xe, ge) in enumerate(zip(torch.split(x, COUNTS), torch.split(g, COUNTS), strict=True)):
        fwd.append((q(xe, r.input, 1, sx[i]).double(), q(w[i].t(), r.weight, 0, sw[i]).double()))
        dgrad.append(
            (q(ge, r.grad_output, 1, sg[i]).double(), q(w[i], r.weight, 0, sw[i]).double())
        )
        wgrad.append(
            (q(ge.t(), r.grad_output, 1, sg[i]).double(), q(xe, r.input, 0, sx[i]).double())
        )
    _close(y, fwd, stack=False)
    assert xr.grad is not None and wr.grad is not None
    _close(xr.grad, dgrad, stack=False)
    _close(wr.grad, wgrad, stack=True)
    with pytest.raises(ValueError, match="scale"):
        quantize_grouped(x, offs, r.input, 1, scale=torch.ones(e + 1))


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "mxfp8"])
def test_large_operands_take_the_kernels_with_the_same_bits(name: str) -> None:
    """Above the kernels' size threshold (2^19 elements) the tensor- and row-wise casts run
    one compiled pass (``kernels.run_round_trip``): the same values as the eager path and
    as the per-group quantization."""
    from lowprec.core import layout

    counts = [700, 0, 400, 33]
    gen = torch.Generator().manual_seed(6)
    x = (
        torch.randn(sum(counts), 512, generator=gen)
        * torch.rand(sum(counts), 1, generator=gen).mul(8).exp2()
    )
    offs = torch.cumsum(torch.tensor(counts), 0)
    for role in ("input", "grad_output"):
        cast = Float8Config.from_name(name).cast(role)
        for cd in (0, 1):
            got = quantize_grouped(x, offs, cast, cd)
            with layout.reference_paths():
                assert torch.equal(got, quantize_grouped(x, offs, cast, cd))
            want = torch.cat([_q(xe, cast, cd) for xe in torch.split(x, counts)])
            assert torch.equal(got, want)
