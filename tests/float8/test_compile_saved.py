"""What a compiled tensor-wise float8 layer keeps for backward on the hardware GEMM path.

The hardware path (``torch._scaled_mm``) is taken on the CPU here by declaring the device
FP8-capable: the CPU ``_scaled_mm`` kernel computes it at these tiny shapes. Under
``torch.compile`` a tensor-wise layer no longer pins its FP8 input payload: it saves the
input and its scale, and AOTAutograd's partitioner keeps the 1-byte payload only where the
input is kept for nothing else (a plain stack of linears), nothing where backward
recomputes the input from tensors it keeps anyway (a norm in front of the layer). The
partitioner may recompute the quantization because the traced tensor ``amax`` is written
with ops it may recompute (``abs``, ``amax``; not ``aminmax``). The bits are the same: the
weight gradient quantizes the input with the forward's scale and cast.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowprec.core.bits as bits
import lowprec.core.rounding as rounding
import lowprec.float8.mm as fmm
from lowprec.float8 import Float8Config, convert_to_float8

pytestmark = pytest.mark.slow  # torch.compile


@pytest.fixture
def hardware_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fmm, "hardware_fp8_available", lambda device: True)
    torch._dynamo.reset()


@pytest.fixture
def cuda_cast_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trace the float8 cast as on a CUDA device: torch's float8 conversion with
    ``torch.copysign`` for the signed NaN (on the CPU, compiled casts are
    :func:`~lowprec.core.bits.encode` and the NaN's sign is or'ed on the bits)."""
    monkeypatch.setattr(rounding, "_ENCODES", ())
    monkeypatch.setattr(bits, "_sign_by_bits", lambda device: False)


def _saved(m: nn.Module, x: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """``(dtype, shape, bytes)`` of each tensor saved for backward that is no parameter."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    seen: dict[int, tuple[torch.dtype, tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (t.dtype, tuple(t.shape), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x).float().sum().backward()
    return list(seen.values())


class _NormedPair(nn.Module):
    """RMS norm, then two linears on the normed input multiplied (a SwiGLU's shape)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        return self.a(h) * self.b(h)


@pytest.mark.parametrize("name", ["tensorwise", "delayed"])
def test_stack_keeps_one_byte_per_input(hardware_path: None, name: str) -> None:
    """A stack of linears: each layer's input is kept for the weight gradient only, so
    the partitioner keeps its 1-byte payload (plus two scalar scales), as eager does."""
    stack = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)]).bfloat16()
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    m = convert_to_float8(stack, Float8Config.from_name(name, emulate=False))
    eager = sum(n for _, _, n in _saved(m, x))
    assert eager == 3 * (64 * 256 + 2 * 4)
    assert sum(n for _, _, n in _saved(torch.compile(m, fullgraph=True), x)) == eager


def test_recomputable_input_keeps_no_payload(hardware_path: None) -> None:
    """A norm in front of two tensor-wise linears: backward keeps the norm's input and
    statistics anyway, so the compiled layer keeps no FP8 payload of the normed input
    (pinned, it kept one per linear: 2 × 1 byte per element more than torchao's)."""
    torch.manual_seed(0)
    cfg = Float8Config.from_name("tensorwise", emulate=False)
    m = convert_to_float8(_NormedPair(128).bfloat16(), cfg)
    x = torch.randn(256, 128, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved(torch.compile(m, fullgraph=True), x)
    payloads = [s for s in saved if s[0] == torch.float8_e4m3fn and s[1] == (256, 128)]
    assert payloads == [], saved
    eager = _saved(m, x)  # eager pins the payloads: one per linear
    assert len([s for s in eager if s[0] == torch.float8_e4m3fn and s[1] == (256, 128)]) == 2


def test_compiled_gradients_same_bits_with_and_without_fp8_saving(hardware_path: None) -> None:
    """Compiled, the weight gradient quantizes the saved input with the forward's scale
    and cast: the same bits as the high-precision-input recipe, output and gradients.
    (Checked by hand against the pinned payload of 4e670b7 on this model: equal bits.)"""
    x = torch.randn(256, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    results = []
    for saved in (True, False):
        torch.manual_seed(0)
        cfg = Float8Config.from_name("tensorwise", emulate=False, fp8_saved_activations=saved)
        m = convert_to_float8(_NormedPair(128).bfloat16(), cfg)
        xi = x.clone().requires_grad_(True)
        y = torch.compile(m, fullgraph=True)(xi)
        y.float().pow(2).sum().backward()
        results.append((y, xi.grad, m.a.weight.grad, m.b.weight.grad))
    for a, b in zip(*results, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a, b)


class _Attention(nn.Module):
    """RMS norm, then q, k and v projections of the normed input, causal attention, and
    the output projection, added to the input (a Llama block's first half)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        b, t, d = x.shape
        q, k, v = (
            m(h).view(b, t, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(o.transpose(1, 2).reshape(b, t, d))


def test_shared_input_keeps_no_payload_cuda_trace(
    hardware_path: None, cuda_cast_trace: None
) -> None:
    """Three tensor-wise linears sharing a normed input (q, k, v), the cast traced as on a
    CUDA device: no FP8 payload of the shared input is kept (backward recomputes it from
    the norm's input). With the sign bit or'ed on the NaN (bits.with_sign, the CPU's choice)
    the partitioner kept one: 1 GiB more than torchao on an 8-block Llama (H200)."""
    torch.manual_seed(0)
    cfg = Float8Config.from_name("tensorwise", emulate=False)
    m = convert_to_float8(_Attention(128, 4).bfloat16(), cfg)
    x = torch.randn(2, 128, 128, dtype=torch.bfloat16, requires_grad=True)
    saved = _saved(torch.compile(m, fullgraph=True), x)
    assert [s for s in saved if s[0] == torch.float8_e4m3fn] == [], saved
