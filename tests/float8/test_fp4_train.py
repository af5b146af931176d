"""FP4 training as published (issue 31): stochastic rounding per role, Hadamard GEMMs,
2-D weight blocks, and the presets nvfp4-train, mxfp4-train, fp8-deepseek.

Oracles: ml_dtypes' value grids (each format's representable values) with the documented
stochastic-rounding rule applied in float64 to the very draws the cast took; an explicit
NumPy/ml_dtypes NVFP4 16x16 quantizer; FP64 products."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import Tensor, nn

import lowprec.float8 as f8
from lowprec.core.bits import counter_bits
from lowprec.core.granularity import apply_scale
from lowprec.core.hadamard import block_hadamard, fqn_key, generator, stream_seed
from lowprec.core.observe import CastOperand, observing
from lowprec.float8 import CastConfig, Float8Config, Float8Linear
from lowprec.float8.quant import dequantize_parts, quantize_parts
from lowprec.recipes import Recipe

GRIDS = {"e2m1": ml_dtypes.float4_e2m1fn, "e4m3fn": ml_dtypes.float8_e4m3fn}


def _grid(fmt: str) -> np.ndarray:
    """The non-negative finite values of ``fmt``: every code decoded by ml_dtypes."""
    n = 16 if fmt == "e2m1" else 256  # ml_dtypes keeps a 4-bit code in one byte
    v = np.arange(n, dtype=np.uint8).view(GRIDS[fmt]).astype(np.float64)
    return np.unique(v[np.isfinite(v) & (v >= 0)])


def _sr_oracle(v: Tensor, rand: Tensor, fmt: str, mant: int, min_normal: float) -> Tensor:
    """Stochastic rounding of float32 ``v`` with the int32 draws ``rand`` (uniform on
    [0, 2^23)), by the contract of lowprec.core.rounding.quantize: ``|v|`` between grid
    neighbours ``lo < |v| < hi`` goes up with probability ``(|v| − lo)/(hi − lo)``,
    realised as: normal range, up iff ``(rand >> M) + F >= 2^(23−M)`` with
    ``F = 2^(23−M)·(|v| − lo)/(hi − lo)`` (an integer: the dropped mantissa bits);
    subnormal range, up iff ``rand·2^-23 < (|v| − lo)/(hi − lo)``. Saturates at the
    largest value; computed in float64 from the grid."""
    grid = _grid(fmt)
    a = v.double().abs().numpy().ravel()
    r = rand.numpy().astype(np.int64).ravel()
    out = np.empty_like(a)
    d = 23 - mant
    for i, (x, ri) in enumerate(zip(a, r, strict=True)):
        j = np.searchsorted(grid, x, side="right") - 1
        lo = grid[j]
        if x == lo or j == len(grid) - 1:
            out[i] = min(x, grid[-1]) if x == lo else grid[-1]
            continue
        hi = grid[j + 1]
        f = (x - lo) / (hi - lo)
        up = (ri >> mant) + f * 2**d >= 2**d if x >= min_normal else ri * 2.0**-23 < f
        out[i] = hi if up else lo
    return torch.from_numpy(np.copysign(out, v.double().numpy().ravel())).reshape(v.shape)


@pytest.mark.parametrize(
    ("fmt", "gran", "mant", "min_normal"),
    [("e2m1", "nv:16", 1, 1.0), ("e2m1", "mx:32", 1, 1.0), ("e4m3fn", "tensor", 3, 2.0**-6)],
)
def test_stochastic_cast_is_bit_exact_with_the_oracle(
    fmt: str, gran: str, mant: int, min_normal: float
) -> None:
    torch.manual_seed(0)
    t = torch.randn(32, 48) * torch.logspace(-3, 2, 48)
    cast = CastConfig(fmt, granularity=gran, rounding="stochastic")
    near = CastConfig(fmt, granularity=gran)
    data, s, _ = quantize_parts(t, cast, 1, gen=generator(stream_seed(7)))
    _, s_near, _ = quantize_parts(t, near, 1)
    assert torch.equal(s, s_near)  # the scales of the nearest cast
    from lowprec.core.granularity import pad_to_blocks

    xp = pad_to_blocks(t, cast.bound_granularity(1)) if gran != "tensor" else t
    v = apply_scale(xp, s if s.dim() else s.reshape(1, 1), op="div")
    # the cast's draws: one key from its generator, then the counter-based draw of each
    # element's row-major index
    key = int(torch.randint(0, 2**62, (1,), generator=generator(stream_seed(7))))
    keys = torch.tensor([key & 0xFFFFFFFF, key >> 32])
    rand = counter_bits(keys, torch.arange(v.numel()).view(v.shape))
    ref = _sr_oracle(v, rand, fmt, mant, min_normal)
    assert torch.equal(data.double(), ref)
    assert not torch.equal(data.float(), quantize_parts(t, near, 1)[0].float())


def test_stochastic_rounding_is_unbiased_in_the_mean() -> None:
    """Over n independent draws the mean of Q(v) is v: each element rounds to lo or hi
    with variance (hi − v)(v − lo); the sum over elements of (mean − v) is ~N(0, Σvar/n)
    (CLT over 2048·n independent draws), so |z| < 5 (false alarm ~6e-7)."""
    torch.manual_seed(1)
    t = torch.rand(32, 64) * 5.5  # within E2M1's range: no saturation
    cast = CastConfig("e2m1", granularity="tensor", rounding="stochastic")
    s = torch.tensor(1.0)
    n = 400
    acc = torch.zeros(32, 64, dtype=torch.float64)
    for i in range(n):
        acc += quantize_parts(t, cast, 1, s, generator(stream_seed(3, i)))[0].double()
    grid = torch.tensor(_grid("e2m1"))
    j = torch.searchsorted(grid, t.double(), right=True) - 1
    lo, hi = grid[j], grid[(j + 1).clamp(max=len(grid) - 1)]
    var = (hi - t.double()) * (t.double() - lo)
    sigma = math.sqrt(float(var.sum()) / n)
    z = float((acc / n - t.double()).sum()) / sigma
    assert abs(z) < 5


def _run(model: nn.Module, x: Tensor, steps: int, opt: torch.optim.Optimizer) -> list[Tensor]:
    out = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        opt.step()
        opt.zero_grad()
    return out


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def test_resume_continues_bit_for_bit() -> None:
    x = torch.randn(48, 64)
    m = f8.apply(_mlp(), "nvfp4-train")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _run(m, x, 3, opt)
    ckpt = copy.deepcopy((m.state_dict(), opt.state_dict()))
    assert m[0].rng_state.tolist() == [fqn_key("0"), 3]
    cont = _run(m, x, 2, opt)
    m2 = f8.apply(_mlp(), "nvfp4-train")
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    m2.load_state_dict(ckpt[0])
    opt2.load_state_dict(ckpt[1])
    resumed = _run(m2, x, 2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(cont, resumed, strict=True))
    m3 = f8.apply(_mlp(), "nvfp4-train")  # the same weights, the counter not restored
    m3.load_state_dict({k: v for k, v in ckpt[0].items() if "rng" not in k}, strict=False)
    fresh = _run(m3, x, 1, torch.optim.SGD(m3.parameters(), lr=0.1))
    assert not torch.equal(fresh[0], cont[0])  # the draws depend on the step counter


class _Seen:
    """An observer that keeps the last operands of each GEMM."""

    def __init__(self) -> None:
        self.ops: dict[str, tuple[CastOperand, CastOperand]] = {}

    def capture(self) -> Callable[[str, CastOperand, CastOperand], None]:
        return lambda gemm, a, b: self.ops.__setitem__(gemm, (a, b))


def _observe(m: nn.Module, x: Tensor) -> dict[str, tuple[CastOperand, CastOperand]]:
    seen = _Seen()
    with observing(seen):  # x needs a gradient: the input-gradient GEMM runs
        m(x.detach().requires_grad_()).pow(2).mean().backward()
    return seen.ops


@pytest.mark.parametrize("name", ["nvfp4-train", "mxfp4-train"])
def test_forward_and_input_grad_use_one_quantized_weight(name: str) -> None:
    torch.manual_seed(2)
    lin = nn.Linear(96, 64)
    with torch.no_grad():  # magnitudes that vary along both dims: blocks matter
        lin.weight.copy_(torch.randn(64, 96) * torch.logspace(-2, 1, 96) * torch.rand(64, 1))
    layer = Float8Linear.from_linear(lin, name)
    seen = _observe(layer, torch.randn(40, 96))
    w_fwd, w_dx = seen["forward"][1].cast, seen["input_grad"][1].cast  # (K×N), (N×K)
    assert torch.equal(w_fwd, w_dx.t())
    plain = Float8Linear.from_linear(lin, name.removesuffix("-train"))
    seen = _observe(plain, torch.randn(40, 96))  # 1-D blocks: two different weights
    assert not torch.equal(seen["forward"][1].cast, seen["input_grad"][1].cast.t())


def test_the_input_gradient_multiplies_the_forward_weight() -> None:
    """dx of nvfp4-train (SR gradient, 16x16 weight) equals Q_sr(g)·Q(W) computed from the
    forward's observed Q(W) and the input gradient's stream: FP32 accumulation bound."""
    torch.manual_seed(3)
    layer = Float8Linear.from_linear(nn.Linear(64, 48), "nvfp4-train")
    x = torch.randn(32, 64, requires_grad=True)
    obs = _Seen()
    with observing(obs):
        y = layer(x)
    seen = obs.ops
    g = torch.randn_like(y)
    y.backward(g)
    # seed 0, layer key 0 (made directly, not by apply), step 0, GEMM input_grad, role g
    gen = generator(stream_seed(0, 0, 0, 1, 2))
    cast = layer.recipe.grad_output
    gq = dequantize_parts(*quantize_parts(g, cast, 1, gen=gen), torch.float32)
    ref = gq.double() @ seen["forward"][1].cast.double().t()
    bound = 64 * 2.0**-24 * (gq.abs().double() @ seen["forward"][1].cast.abs().double().t())
    assert bool(((x.grad.double() - ref).abs() <= bound).all())


def _nv_2d_oracle(w: np.ndarray) -> np.ndarray:
    """NVFP4 with 16x16 blocks by NumPy and ml_dtypes: s_t = max amax / (6·448) in
    float32, s_b = E4M3(amax / (6·s_t)), scale = float32(s_b·s_t), value =
    E2M1(clip(w / scale, ±6)) · scale."""
    r, c = w.shape
    blocks = w.reshape(r // 16, 16, c // 16, 16)
    amax = np.abs(blocks).max(axis=(1, 3)).astype(np.float32)
    s_t = np.float32(amax.max()) / np.float32(6.0 * 448.0)
    s_b = (amax / (np.float32(6.0) * s_t)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = (s_b * s_t).astype(np.float32)[:, None, :, None]
    v = np.clip((blocks / s).astype(np.float32), -6, 6)
    q = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return (q * s).astype(np.float32).reshape(r, c)


def test_nv_16x16_weight_matches_an_independent_oracle() -> None:
    torch.manual_seed(4)
    w = torch.randn(64, 96) * torch.logspace(-2, 1, 96)
    cast = Float8Config.from_name("nvfp4-train").weight
    for t, cd in ((w.t(), 0), (w, 0), (w, 1)):
        got = dequantize_parts(*quantize_parts(t, cast, cd), torch.float32)
        ref = _nv_2d_oracle(t.numpy())
        assert np.array_equal(got.numpy(), ref)


def test_hadamard_weight_gradient_against_fp64() -> None:
    """With a Hadamard weight-gradient GEMM (nearest rounding here), dW equals
    Q(gᵀHᵀ)·Q(Hx) multiplied in FP64 within the FP32 accumulation bound, and the
    product of the transformed FP64 operands is the plain product."""
    cfg = Float8Config.from_name("nvfp4-train", grad_output=CastConfig("e2m1", granularity="nv:16"))
    torch.manual_seed(5)
    layer = Float8Linear.from_linear(nn.Linear(32, 48), cfg)
    x = torch.randn(40, 32)  # 40 tokens: padded to 48 for the blocks of 16
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    gh, xh = block_hadamard(g.t(), 1, 16, 0), block_hadamard(x, 0, 16, 0)
    assert float((gh.double() @ xh.double() - g.t().double() @ x.double()).norm()) < 1e-4
    gq = dequantize_parts(*quantize_parts(gh, cfg.grad_output, 1), torch.float32).double()
    xq = dequantize_parts(*quantize_parts(xh, cfg.input, 0), torch.float32).double()
    ref = gq @ xq
    bound = 48 * 2.0**-24 * (gq.abs() @ xq.abs())
    assert bool(((layer.weight.grad.double() - ref).abs() <= bound).all())


def test_streams_differ_per_layer_and_step_and_follow_the_keys() -> None:
    m = f8.apply(_mlp(), "nvfp4-train")
    assert m[0].rng_state[0] != m[2].rng_state[0]
    x = torch.randn(16, 64)
    a = _observe(m, x)["input_grad"][0].cast
    b = _observe(m, x)["input_grad"][0].cast  # next step: other draws, same gradient
    assert not torch.equal(a, b)
    m.eval()
    c0 = _observe(m, x)["input_grad"][0].cast  # eval: the counter does not move
    assert torch.equal(c0, _observe(m, x)["input_grad"][0].cast)


def test_parts_switch_on_and_off_alone_and_validation() -> None:
    base = Float8Config.from_name("nvfp4-train")
    assert base.stochastic and base.hadamard == ("weight_grad",)
    assert not base.replace(grad_output=CastConfig("e2m1", granularity="nv:16")).stochastic
    assert base.replace(hadamard=()).hadamard == ()
    assert (
        base.replace(weight=CastConfig("e2m1", granularity="nv:16")).weight.granularity == "nv:16"
    )
    with pytest.raises(ValueError, match="rounding must be 'nearest' or 'stochastic'"):
        CastConfig(rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hadamard must be distinct names"):
        Float8Config(hadamard=("wgrad",))
    with pytest.raises(ValueError, match="hadamard_block must be a power of two"):
        Float8Config(hadamard_block=12)
    with pytest.raises(ValueError, match=r"hadamard: the input cast of 'forward'.*dynamic"):
        Float8Config.from_name("delayed", hadamard=["forward"])
    t = torch.randn(4, 16)  # no generator: the reproducible stream of seed 0
    assert torch.equal(*(quantize_parts(t, base.grad_output, 1)[0] for _ in range(2)))
    d = Float8Config.from_name("fp8-deepseek")
    assert d.input.power_of_two and d.weight.granularity == "block:128x128"
    assert d.grad_output.fmt == "e4m3fn"


@pytest.mark.parametrize("name", ["nvfp4-train", "mxfp4-train", "fp8-deepseek"])
def test_presets_round_trip_through_json(name: str) -> None:
    c = Float8Config.from_name(name)
    assert Float8Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    r = Recipe(name=name, technique=c)  # (as a Recipe preset would hold it)
    assert r.float8 == c
    assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
