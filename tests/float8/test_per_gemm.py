"""Formats per GEMM (``Float8Config.gemms``) against hand computations.

Oracle: each GEMM's operands quantized by hand with :func:`quantize_parts` and the cast the
GEMM is configured with (``for_gemm``), dequantized with :func:`dequantize_parts` and
multiplied in float32 — what the emulation does: products of the dequantized values in
float32 for block-scaled operands; for tensor- and row-scaled ones it multiplies the
payloads and scales after (``(A_q·B_q)·s_A·s_B``), which differs from ``(A_q s_A)·(B_q
s_B)`` by float32 rounding only. Hence the tolerance: relative 1e-5 of the output's
largest magnitude (float32 has 2^-24 ≈ 6e-8 relative precision; a K ≤ 64 dot product
accumulates at most ~64 such roundings, ~4e-6). A format mix-up (E4M3 for E5M2, tensor for
NVFP4 scales) changes results by >= 1e-2 relative, far outside it.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
from torch import nn

from lowprec.float8 import CastConfig, Float8Config, Float8Linear
from lowprec.float8.config import GEMMS
from lowprec.float8.quant import dequantize_parts, quantize_operand, quantize_parts
from lowprec.recipes.serial import decode, encode

M, K, N = 40, 64, 48  # tokens (40: a partial NVFP4/MX block along M in the weight gradient)


def _q(t: torch.Tensor, cast: CastConfig, cd: int) -> torch.Tensor:
    """``t`` (contracted over ``cd``) quantized with ``cast`` and dequantized, float32."""
    data, s, pad = quantize_parts(t.detach().float(), cast, cd)
    return dequantize_parts(data, s, pad, torch.float32)


def _reference(
    cfg: Float8Config, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor
) -> dict[str, torch.Tensor]:
    """y = Q(x) Q(W)ᵀ, dx = Q(g) Q(W), dW = Q(gᵀ) Q(x), each GEMM with its own casts
    (all dynamic here, so every scale is the operand's own)."""
    f, di, dw = (cfg.for_gemm(n) for n in GEMMS)
    return {
        "y": _q(x, f.input, 1) @ _q(w.t(), f.weight, 0),
        "dx": _q(g, di.grad_output, 1) @ _q(w, di.weight, 0),
        "dw": _q(g.t(), dw.grad_output, 1) @ _q(x, dw.input, 0),
    }


def _run(
    cfg: Float8Config, seed: int = 0, bias: bool = True
) -> tuple[Float8Linear, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    layer = Float8Linear.from_linear(nn.Linear(K, N, bias=bias), cfg)
    x = torch.randn(M, K).requires_grad_()
    g = torch.randn(M, N)
    y = layer(x)
    y.backward(g)
    assert x.grad is not None and layer.weight.grad is not None
    out = {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad}
    if bias:
        assert layer.bias is not None and layer.bias.grad is not None
        out["db"] = layer.bias.grad
    return layer, out, x.detach(), g


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


NV = Float8Config.from_name("nvfp4")
MX4 = Float8Config.from_name("mxfp4")
CASES = [("tensorwise", NV), ("mxfp8", Float8Config.from_name("tensorwise")), ("rowwise", MX4)]


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize(("base", "override"), CASES, ids=["tw+nv", "mx8+tw", "row+mx4"])
def test_one_gemm_override_matches_hand_computation(
    gemm: str, base: str, override: Float8Config
) -> None:
    cfg = Float8Config.from_name(base, gemms={gemm: override})
    assert cfg.for_gemm(gemm) is override
    assert all(cfg.for_gemm(o) is cfg for o in GEMMS if o != gemm)
    layer, out, x, g = _run(cfg)
    ref = _reference(cfg, x, layer.weight.detach(), g)
    assert layer.bias is not None
    _close(out["y"], ref["y"] + layer.bias.detach())
    _close(out["dx"], ref["dx"])
    _close(out["dw"], ref["dw"])
    # The bias gradient is g summed over tokens in high precision (no GEMM quantizes it).
    torch.testing.assert_close(out["db"], g.sum(0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("preset", ["mxfp8-nvfp4-bwd", "tensorwise-wgrad-nvfp4"])
def test_presets_match_hand_computation(preset: str) -> None:
    cfg = Float8Config.from_name(preset)
    mx8, nv = Float8Config.from_name("mxfp8"), Float8Config.from_name("nvfp4")
    if preset == "mxfp8-nvfp4-bwd":
        assert (cfg.for_gemm("forward").input, cfg.for_gemm("forward").weight) == (
            mx8.input,
            mx8.weight,
        )
        assert cfg.gemm_cast("input_grad", "grad_output") == nv.grad_output
        assert cfg.gemm_cast("weight_grad", "input") == nv.input
    else:
        assert cfg.for_gemm("input_grad") is cfg and cfg.for_gemm("weight_grad").name == "nvfp4"
    layer, out, x, g = _run(cfg, bias=False)
    ref = _reference(cfg, x, layer.weight.detach(), g)
    for k in ("y", "dx", "dw"):
        _close(out[k], ref[k])


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4"])
def test_every_gemm_overridden_by_a_is_a(name: str) -> None:
    """Bit for bit: the same casts, emulation and sharing as config A itself (the base's
    fp8_saved_activations=True does not save a row/block-scaled override's input)."""
    a = Float8Config.from_name(name)
    cfg = Float8Config(gemms=tuple((gm, a) for gm in GEMMS))
    _, got, _, _ = _run(cfg)
    _, want, _, _ = _run(a)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_validation_and_normalisation() -> None:
    nv = Float8Config.from_name("nvfp4")
    c = Float8Config(gemms={"weight_grad": nv, "forward": "mxfp8"})  # dict, preset name
    assert [g for g, _ in c.gemms] == ["forward", "weight_grad"]  # GEMMS order, a tuple
    assert c == Float8Config(gemms=[("weight_grad", nv), ("forward", "mxfp8")])
    assert hash(c) == hash(Float8Config(gemms=(("forward", "mxfp8"), ("weight_grad", nv))))
    assert c.for_gemm("forward").name == "mxfp8" and c.for_gemm("input_grad") is c
    assert c.own_cast("weight_grad", "input") and not c.own_cast("input_grad", "weight")
    with pytest.raises(ValueError, match=r"gemms.*among.*'wgrad'"):
        Float8Config(gemms={"wgrad": nv})
    with pytest.raises(ValueError, match=r"gemms.*'forward' is given twice"):
        Float8Config(gemms=[("forward", nv), ("forward", nv)])
    with pytest.raises(ValueError, match=r"gemms.*'weight_grad' is also in high_precision_gemms"):
        Float8Config(high_precision_gemms=("weight_grad",), gemms={"weight_grad": nv})
    with pytest.raises(ValueError, match=r"gemms.*may have neither"):
        Float8Config(gemms={"forward": Float8Config(gemms={"forward": nv})})
    with pytest.raises(ValueError, match=r"gemms.*may have neither"):
        Float8Config(gemms={"forward": Float8Config.from_name("rowwise-gw-hp")})
    with pytest.raises(ValueError, match=r"gemms.*Float8Config or a preset name.*int"):
        Float8Config(gemms={"forward": 3})
    with pytest.raises(ValueError, match=r"gemms.*pair"):
        Float8Config(gemms=(("forward",),))
    with pytest.raises(ValueError, match=r"gemms.*must be pairs"):
        Float8Config(gemms="forward")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown float8 recipe"):
        Float8Config(gemms={"forward": "nope"})
    delayed = Float8Config.from_name("delayed")
    # A delayed cast that is not the base's: its state would belong to no role.
    with pytest.raises(ValueError, match=r"gemms: the grad_output cast of 'input_grad'.*dynamic"):
        Float8Config(gemms={"input_grad": delayed})
    # Equal to the base cast: allowed (it uses the base role's state), and a role the GEMM
    # does not use is not checked (input for input_grad).
    ok = Float8Config.from_name("delayed", gemms={"input_grad": delayed.replace(emulate=True)})
    assert not ok.own_cast("input_grad", "grad_output")
    Float8Config(gemms={"input_grad": Float8Config(input=CastConfig(scaling="delayed"))})
    with pytest.raises(ValueError, match="gemm must be one of"):
        c.for_gemm("dgrad")


@pytest.mark.parametrize("preset", ["mxfp8-nvfp4-bwd", "tensorwise-wgrad-nvfp4"])
def test_json_and_dict_round_trip(preset: str) -> None:
    cfg = Float8Config.from_name(preset, emulation_dtype="bf16")
    assert decode(Float8Config, json.loads(json.dumps(encode(cfg)))) == cfg
    assert Float8Config.from_dict(cfg.to_dict()) == cfg
    assert Float8Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_describe_and_repr_show_per_gemm_formats() -> None:
    layer = Float8Linear.from_linear(nn.Linear(K, N), "tensorwise-wgrad-nvfp4")
    s = repr(layer)
    assert "recipe=tensorwise-wgrad-nvfp4" in s and "input=dyn:tensor:e4m3fn" in s
    assert "weight_grad=[grad_output=dyn:nv:16:e2m1, input=dyn:nv:16:e2m1]" in s
    assert "weight_grad=high-precision" in Float8Config.from_name("rowwise-gw-hp").describe()


def test_delayed_base_with_dynamic_input_grad_override() -> None:
    """Base delayed, input_grad row-wise dynamic: the input gradient is the hand
    computation; the forward and weight gradient, and all three amax histories, are the
    plain delayed layer's bit for bit over several steps (the weight gradient's delayed
    gradient scale still records its history); state_dict carries and restores them."""
    row = Float8Config(
        grad_output=CastConfig("e5m2", granularity="axis"),
        weight=CastConfig("e4m3fn", granularity="axis"),
    )
    cfg = Float8Config.from_name("delayed", gemms={"input_grad": row})
    torch.manual_seed(3)
    base = nn.Linear(K, N, bias=False)
    a = Float8Linear.from_linear(base, cfg)
    b = Float8Linear.from_linear(nn.Linear(K, N, bias=False), "delayed")
    b.weight = nn.Parameter(base.weight.detach().clone())
    for step in range(3):
        x = (torch.randn(M, K) * (1 + step)).requires_grad_()
        xb = x.detach().clone().requires_grad_()
        g = torch.randn(M, N) * 10.0**-step
        ya, yb = a(x), b(xb)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(ya, yb)
        assert a.weight.grad is not None and b.weight.grad is not None
        assert torch.equal(a.weight.grad, b.weight.grad)
        want = _q(g, row.grad_output, 1) @ _q(a.weight, row.weight, 0)
        assert x.grad is not None
        _close(x.grad, want)
        a.weight.grad = b.weight.grad = None
    sa, sb = a.state_dict(), b.state_dict()
    for k in ("input_amax_history", "weight_amax_history", "grad_output_amax_history"):
        assert torch.equal(sa[k], sb[k]) and int((sa[k] > 0).sum()) == 3, k
    c = Float8Linear.from_linear(nn.Linear(K, N, bias=False), cfg)
    c.load_state_dict(sa)
    assert torch.equal(c.grad_output_amax_history, a.grad_output_amax_history)


@pytest.mark.parametrize("gemm", GEMMS)
def test_delayed_base_override_computes_its_own_scales(gemm: str) -> None:
    """An override (tensor-wise E2M1, dynamic) under a delayed base quantizes with its own
    scale amax/6, not the role's delayed E4M3/E5M2 scale (amax/448, amax/57344: used with
    E2M1 it would saturate nearly everything). First step: the delayed scales warm up on
    the tensors' own amax, so every GEMM is the dynamic hand computation."""
    e2 = CastConfig("e2m1")
    cfg = Float8Config.from_name(
        "delayed", gemms={gemm: Float8Config(input=e2, weight=e2, grad_output=e2)}
    )
    layer, out, x, g = _run(cfg, seed=11, bias=False)
    ref = _reference(cfg, x, layer.weight.detach(), g)
    for k in ("y", "dx", "dw"):
        _close(out[k], ref[k])
    assert all(int((b > 0).sum()) == 1 for b in layer.scaling_state().values())


def _saved_dtypes(cfg: Float8Config) -> tuple[set[torch.dtype], dict[str, torch.Tensor], Any]:
    seen: set[torch.dtype] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.add(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer, out, x, g = _run(cfg, seed=5, bias=False)
    return seen, out, (layer, x, g)


@pytest.mark.parametrize(
    "wgrad",
    [
        Float8Config(input=CastConfig("e5m2")),  # tensor-wise, another format
        Float8Config(input=CastConfig("e4m3fn", power_of_two=True)),  # another scale
        Float8Config(input=CastConfig("e2m1")),  # tensor-wise E2M1: its own scale amax/6
        Float8Config(input=CastConfig("e4m3fn", granularity="axis")),
        Float8Config(grad_output=CastConfig("e4m3fn")),  # the gradient only: x is shared
    ],
    ids=["e5m2", "pow2", "e2m1", "axis", "g-only"],
)
def test_saved_input_is_shared_only_with_an_equal_cast(wgrad: Float8Config) -> None:
    """Tensorwise base (fp8_saved_activations=True) with a weight_grad override: dW is the
    hand computation with the override's input cast, not the forward's saved E4M3
    payload; the payload (float8) is saved only where the two input casts are equal."""
    cfg = Float8Config.from_name("tensorwise", gemms={"weight_grad": wgrad})
    seen, out, (layer, x, g) = _saved_dtypes(cfg)
    ref = _reference(cfg, x, layer.weight.detach(), g)
    for k in ("y", "dx", "dw"):
        _close(out[k], ref[k])
    shared = wgrad.input == cfg.input
    assert (torch.float8_e4m3fn in seen) == shared
    plain, _, _ = _saved_dtypes(Float8Config.from_name("tensorwise"))
    assert torch.float8_e4m3fn in plain  # the base config alone saves the payload


def test_scaled_tensor_weight_is_requantized_for_another_cast() -> None:
    """An FP8-gathered weight (a ScaledTensor quantized with the base cast) is used as is
    by a GEMM with the base cast and dequantized then quantized with the GEMM's own cast
    otherwise (here an NVFP4 forward and a tensorwise input gradient)."""
    cfg = Float8Config.from_name("tensorwise", gemms={"forward": NV})
    torch.manual_seed(7)
    layer = Float8Linear.from_linear(nn.Linear(K, N, bias=False), cfg)
    w = layer.weight.detach()
    wst = quantize_operand(w, cfg.weight, 1)
    wdq = dequantize_parts(wst.qdata, wst.scale, None, torch.float32)
    x = torch.randn(M, K).requires_grad_()
    g = torch.randn(M, N)
    y = layer.gemm(x, wst)
    y.backward(g)
    _close(y.detach(), _q(x, NV.input, 1) @ _q(wdq.t(), NV.weight, 0))
    assert x.grad is not None
    # input_grad: the base cast, so the gathered payload itself at its scale.
    _close(x.grad, _q(g, cfg.grad_output, 1) @ wdq)


def _sqnr(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (y - ref).pow(2).sum().clamp_min(1e-30)))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cfg", "fullgraph"),
    [
        (
            Float8Config.from_name(
                "delayed",
                gemms={
                    "input_grad": Float8Config(
                        grad_output=CastConfig("e5m2", granularity="axis"),
                        weight=CastConfig("e4m3fn", granularity="axis"),
                    ),
                    "weight_grad": Float8Config(input=CastConfig("e5m2")),
                },
            ),
            True,
        ),
        (Float8Config.from_name("tensorwise-wgrad-nvfp4"), False),  # NVFP4: runs eagerly
        (Float8Config.from_name("mxfp8-nvfp4-bwd"), False),
    ],
    ids=["delayed+row-dgrad+e5m2-wgrad", "tensorwise-wgrad-nvfp4", "mxfp8-nvfp4-bwd"],
)
def test_compiled_matches_eager(cfg: Float8Config, fullgraph: bool) -> None:
    """torch.compile of per-GEMM configs trains like eager over three steps: the same
    scaling state (exact up to the amax's float32 value) and gradients equal up to float32
    reassociation (> 60 dB; a wrong cast or scale costs > 20 dB). Tensor- and row-scaled
    per-GEMM configs trace with fullgraph=True; a config with a block-scaled GEMM runs its
    linears outside the graph (block_scaled looks at the per-GEMM configs)."""
    from lowprec.float8 import convert_to_float8
    from lowprec.float8.gemms import block_scaled

    assert block_scaled(cfg) is not fullgraph
    torch._dynamo.reset()
    torch.manual_seed(8)
    base = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 8))
    eager = convert_to_float8(base, cfg)
    comp = copy.deepcopy(eager)
    cm = torch.compile(comp, fullgraph=fullgraph)
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        for mod in (eager, cm):
            mod(x).pow(2).mean().backward()
    for (n, a), (_, b) in zip(eager.state_dict().items(), comp.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=n)
    for a, b in zip(eager.parameters(), comp.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert _sqnr(b.grad, a.grad) > 60
