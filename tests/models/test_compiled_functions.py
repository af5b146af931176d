"""``lowprec.core.autograd.apply_fn``: every lowprec autograd Function applied to a tensor
filled in place through views (``new_empty`` written by ``copy_`` into slices, as
DeepSeek-V3's attention builds its keys), under ``torch.compile``.

torch 2.13's Dynamo lost such a Function's backward when given the tensor itself:
``quantize_ste``'s gradient became the rounding's, ``scale_bwd``'s arrived unscaled,
``U.linear``'s never reached the slices' sources, scalify's entry failed to compile.
Each case compares the compiled loss and every gradient (the slices' sources and the
op's own parameters) with eager's bit for bit: the ``eager`` backend runs eager's kernels,
so the only difference can be the graph's autograd. ``_GatherFP8`` (lowprec.distributed)
needs a process group and is covered by its FSDP2 tests; it goes through the same
``apply_fn``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import lowprec.float8 as f8
from lowprec.core import autograd
from lowprec.core.casts import quantize_grad, quantize_ste
from lowprec.core.tensor import quantize_scaled
from lowprec.float8.attention import fp8_attention
from lowprec.float8.grouped import grouped_linear
from lowprec.scalify import ops as sops
from lowprec.unit import functional as U
from lowprec.unit import scale_bwd, scale_fwd

_W = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))  # a linear's weight


def _linear(preset: str) -> Callable[[Tensor], Tensor]:
    torch.manual_seed(3)
    m = f8.apply(torch.nn.Sequential(torch.nn.Linear(16, 8, bias=False)), preset)
    return lambda k: m(k)


def _attention(key: Tensor) -> Tensor:
    """One head: queries and keys from disjoint halves of ``key (8, 16)`` (a tensor used
    twice would sum its gradients in an order the compiled graph may change)."""
    q, k = key[:, :8].reshape(1, 1, 8, 8), key[:, 8:].reshape(1, 1, 8, 8)
    return fp8_attention(q, k, _V, is_causal=True)


_V = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(7))
_OFFS = torch.tensor([3, 3, 8])
_GROUPED_W = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(6))

# name -> (op on the (8, 16) tensor, parameters whose gradients are compared too). Each
# op hands the tensor itself to its Function where it can. ``*``: wrong before apply_fn
# (checked at db60320): quantize_ste, quantize_grad, quantize_scaled and U.softmax gave
# other gradients, scalify's compiled call failed ("element 0 of tensors does not require
# grad"), grouped_linear's failed in torch._grouped_mm's fake-tensor rule (bf16 only);
# scale_bwd and U.linear had taken a view since db60320. The others reshape first (a view,
# unaffected) and guard compile parity.
CASES: dict[str, tuple[Callable[[Tensor], Tensor], list[Tensor]]] = {
    "quantize_ste*": (lambda k: quantize_ste(k), []),
    "quantize_grad*": (lambda k: quantize_grad(k), []),
    "quantize_scaled*": (lambda k: quantize_scaled(k, "e4m3fn", "row").dequantize(), []),
    "scalify*": (lambda k: sops.unscale(sops.as_scaled(k) * 3.0), []),
    "scalify_rebalance": (lambda k: sops.unscale(sops.rebalance(sops.as_scaled(k), 2.0)), []),
    "float8_tensorwise": (_linear("tensorwise"), []),
    "float8_rowwise": (_linear("rowwise"), []),
    "float8_delayed": (_linear("delayed"), []),
    "float8_grouped*": (lambda k: grouped_linear(k, _GROUPED_W, _OFFS, "rowwise"), [_GROUPED_W]),
    "fp8_attention": (_attention, [_V]),
    "unit_scale_fwd": (lambda k: scale_fwd(k, 0.5), []),
    "unit_scale_bwd*": (lambda k: scale_bwd(k, 0.5), []),
    "unit_linear*": (lambda k: U.linear(k, _W), [_W]),
    "unit_softmax*": (lambda k: U.softmax(k, dim=-1), []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_function_on_a_tensor_filled_in_place_compiles_to_eagers_gradients(name: str) -> None:
    op, params = CASES[name]
    torch.manual_seed(0)
    a0 = torch.randn(8, 10, requires_grad=True)
    b0 = torch.randn(1, 10, requires_grad=True)
    leaves = [a0, b0, *params]
    for p in params:
        p.requires_grad_(True)

    def f(a: Tensor, b: Tensor) -> Tensor:
        key = a.new_empty(8, 16)
        key[:, :10].copy_(a)
        key[:, 10:].copy_(b.expand(8, -1)[:, :6])
        y = op(key)
        w = torch.linspace(-2.0, 3.0, y.numel()).reshape(y.shape)
        return (y * w).sum()

    def run(fn: Callable[[Tensor, Tensor], Tensor]) -> list[Tensor]:
        for t in leaves:
            t.grad = None
        out = fn(a0, b0)
        out.backward()
        grads = [t.grad for t in leaves]
        assert all(g is not None for g in grads), name
        return [out.detach(), *(g.clone() for g in grads if g is not None)]

    torch._dynamo.reset()
    try:
        eager, compiled = run(f), run(torch.compile(f, backend="eager"))
    finally:
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    assert eager[1].abs().sum() > 0
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c), name


def test_straight_through_gradient_by_hand() -> None:
    """The oracle for ``quantize_ste``'s case: its gradient is the upstream one unchanged."""
    x = torch.randn(6, requires_grad=True)
    w = torch.randn(6)

    def f(x: Tensor) -> Tensor:
        k = x.new_empty(6)
        k[:3].copy_(x[:3])
        k[3:].copy_(x[3:])
        return (quantize_ste(k * 5.0) * w).sum()

    torch._dynamo.reset()
    torch.compile(f, backend="eager")(x).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 5.0 * w, rtol=0, atol=0)


def test_apply_fn_eager_is_apply_and_rejects_non_functions() -> None:
    from lowprec.core.casts import _QuantizeSte
    from lowprec.core.formats import get_format

    x = torch.randn(3, requires_grad=True)
    y = autograd.apply_fn(_QuantizeSte, x, get_format("e4m3fn"), True)
    assert torch.equal(y, _QuantizeSte.apply(x, get_format("e4m3fn"), True))
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_QuantizeSteBackward"
    assert autograd._fresh_input(x) is x  # eagerly: the tensor itself, no view
    with pytest.raises(TypeError, match=r"fn must be a torch\.autograd\.Function subclass"):
        autograd.apply_fn(torch.nn.Linear, x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fn must be"):
        autograd.apply_fn(quantize_ste, x)  # type: ignore[arg-type]
    fmt = get_format("e4m3fn")
    for bad in ((3,), (-1,), [0], (0.0,)):
        with pytest.raises(TypeError, match="inputs must be a tuple of argument positions"):
            autograd.apply_fn(_QuantizeSte, x, fmt, True, inputs=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("inputs", [None, (0,), ()])
def test_apply_fn_inputs_selects_the_arguments_given_as_views(
    inputs: tuple[int, ...] | None,
) -> None:
    """``inputs`` names the arguments handed over as views under compile: with the filled
    tensor among them the straight-through gradient survives; with none (``()``) the
    Dynamo bug of the module doc shows (the gradient differs from eager's)."""
    from lowprec.core.casts import _QuantizeSte
    from lowprec.core.formats import get_format

    fmt = get_format("e4m3fn")
    x = torch.randn(6, requires_grad=True, generator=torch.Generator().manual_seed(2))
    w = torch.linspace(-1.0, 2.0, 6)

    def f(x: Tensor) -> Tensor:
        k = x.new_empty(6)
        k[:3].copy_(x[:3])
        k[3:].copy_(x[3:])
        return (autograd.apply_fn(_QuantizeSte, k, fmt, True, inputs=inputs) * w).sum()

    torch._dynamo.reset()
    torch.compile(f, backend="eager")(x).backward()
    assert x.grad is not None
    assert torch.equal(x.grad, w) == (inputs != ())


class _Recorder(torch.autograd.Function):
    """``2·x`` whose forward and backward record whether they run inside a compiled graph."""

    seen: list[tuple[str, bool]] = []  # noqa: RUF012  (a test's log)

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        _Recorder.seen.append(("forward", torch.compiler.is_compiling()))
        return x * 2.0

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: Tensor) -> Tensor:
        _Recorder.seen.append(("backward", torch.compiler.is_compiling()))
        return g * 3.0  # not the forward's derivative: a traced forward would give 2


@pytest.mark.parametrize("outside", [True, False])
def test_apply_outside_graph_runs_the_function_eagerly(outside: bool) -> None:
    """``apply_outside_graph``: under compile the Function's forward and backward both run
    eagerly (``is_compiling()`` false in each, once per call), its own backward giving the
    gradient (3 per element, not the forward's 2); through ``apply_fn`` the forward is
    traced. Both give eager's gradient, from the filled tensor of the module doc."""
    x = torch.randn(6, requires_grad=True, generator=torch.Generator().manual_seed(4))

    def f(x: Tensor) -> Tensor:
        k = x.new_empty(6)
        k[:3].copy_(x[:3])
        k[3:].copy_(x[3:])
        if outside:
            return autograd.apply_outside_graph(_Recorder, k).sum()
        return autograd.apply_fn(_Recorder, k).sum()

    torch._dynamo.reset()
    _Recorder.seen.clear()
    compiled = torch.compile(f, backend="eager")
    for _ in range(2):
        x.grad = None
        compiled(x).backward()
        assert x.grad is not None and torch.equal(x.grad, torch.full((6,), 3.0))
    if outside:
        assert _Recorder.seen == [("forward", False), ("backward", False)] * 2
    else:  # traced once, the traced forward not rerun in Python; backward compiled
        assert ("forward", True) in _Recorder.seen
        assert ("forward", False) not in _Recorder.seen
    _Recorder.seen.clear()
    with pytest.raises(TypeError, match=r"fn must be a torch\.autograd\.Function subclass"):
        autograd.apply_outside_graph(torch.nn.Linear, x)  # type: ignore[arg-type]
    x.grad = None
    autograd.apply_outside_graph(_Recorder, x).sum().backward()  # eagerly: fn.apply
    assert _Recorder.seen == [("forward", False), ("backward", False)]
    assert x.grad is not None and torch.equal(x.grad, torch.full((6,), 3.0))


@pytest.mark.parametrize("preset", ["mxfp8", "nvfp4"])
def test_block_scaled_linears_compile_to_eagers_bits(preset: str) -> None:
    """Block-scaled linears (run outside the graph through ``apply_outside_graph``) of five
    weight shapes under ``torch.compile`` (``eager`` backend): output and every gradient
    equal eager's bit for bit, within Dynamo's default recompile limit (hitting it fails
    here instead of warning)."""
    torch.manual_seed(0)
    dims = [32, 64, 96, 32, 128, 64]
    model = f8.apply(
        torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(dims))), preset
    )
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        compiled = torch.compile(model, backend="eager")
        outs = []
        for m in (model, compiled):
            model.zero_grad(set_to_none=True)
            y = m(x)
            y.square().mean().backward()
            outs.append((y.detach(), [p.grad.clone() for p in model.parameters()]))
    (ye, ge), (yc, gc) = outs
    assert torch.equal(yc, ye)
    assert len(ge) == 10 and all(torch.equal(a, b) for a, b in zip(gc, ge, strict=True))
