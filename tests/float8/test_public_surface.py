"""What distributed and composing code may use of ``Float8Linear`` (its public surface):
``gemm`` with an amax reducer over sharded roles, ``role_scale``, the scaling state
(``scaling_state`` / ``bind_scaling_state`` / ``refresh_static_scales``),
``register_weight_forward`` and the injected ``linear_fn``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lowprec.core.scales import amax as tensor_amax
from lowprec.float8 import Float8Linear
from lowprec.float8.linear import _WEIGHT_FORWARDS, register_weight_forward


def _layer(recipe: str, seed: int = 0) -> Float8Linear:
    torch.manual_seed(seed)
    return Float8Linear.from_linear(nn.Linear(32, 16, bias=False), recipe)


def _data(seed: int, rows: int, mult: float) -> Tensor:
    return torch.randn(rows, 32, generator=torch.Generator().manual_seed(seed)) * mult


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_gemm_of_token_shards_with_a_reducer_equals_the_whole_gemm(recipe: str) -> None:
    """Two simulated ranks hold halves of the tokens (rows of x): with ``sharded="xg"`` and
    a reducer that returns the max over both halves' amax, each half is quantized with the
    scale of the whole x (and its gradient with the scale of the whole gradient), so the
    halves' outputs and input gradients are the rows of the one-process result, bit for
    bit, and the delayed state is the one-process state. Without the reducer they differ
    (the halves have different amax: the control)."""
    x0, x1 = _data(1, 6, 1.0), _data(2, 6, 5.0)
    g0, g1 = _data(3, 6, 0.1)[:, :16], _data(4, 6, 2.0)[:, :16]
    whole = _layer(recipe)
    xw = torch.cat([x0, x1]).requires_grad_()
    yw = whole.gemm(xw, whole.weight)
    yw.backward(torch.cat([g0, g1]))
    assert xw.grad is not None

    def run(reduced: bool) -> tuple[list[Tensor], list[Tensor], list[dict[str, Tensor]]]:
        layers = [_layer(recipe), _layer(recipe)]
        xs = [x0.clone().requires_grad_(), x1.clone().requires_grad_()]
        gs = [g0, g1]
        # Each simulated rank's reducer is called for x in forward, then for g in backward:
        # it returns the max with the other rank's local amax of that tensor.
        queues = {0: [tensor_amax(x1), tensor_amax(g1)], 1: [tensor_amax(x0), tensor_amax(g0)]}
        ys = []
        for r in (0, 1):

            def reduce(a: Tensor, r: int = r) -> Tensor:
                return torch.maximum(a, queues[r].pop(0))

            sharded = "xg" if reduced else ""
            ys.append(layers[r].gemm(xs[r], layers[r].weight, reduce if reduced else None, sharded))
        for y, g in zip(ys, gs, strict=True):
            y.backward(g)
        assert not reduced or queues == {0: [], 1: []}  # reduced once for x, once for g
        return ys, [x.grad for x in xs], [m.scaling_state() for m in layers]  # type: ignore[misc]

    ys, gxs, states = run(True)
    assert torch.equal(torch.cat(ys), yw.detach())
    assert torch.equal(torch.cat(gxs), xw.grad)
    for k, v in whole.scaling_state().items():
        assert torch.equal(states[0][k], v) and torch.equal(states[1][k], v), k
    ys_local, _, _ = run(False)
    assert not torch.equal(torch.cat(ys_local), yw.detach())


def test_gemm_refuses_sharded_roles_without_a_reducer() -> None:
    m = _layer("tensorwise")
    with pytest.raises(ValueError, match="no reduce is given"):
        m.gemm(torch.randn(2, 32), m.weight, None, "x")
    with pytest.raises(ValueError, match="letters of 'xwg'"):
        m.gemm(torch.randn(2, 32), m.weight, lambda a: a, "q")


def test_role_scale_records_as_the_gemm_does() -> None:
    a, b = _layer("delayed"), _layer("delayed")
    x = _data(5, 4, 3.0)
    a.gemm(x, a.weight)
    s = b.role_scale("input", x)
    assert torch.equal(a.input_amax_history, b.input_amax_history)
    assert float(b.input_amax_history[0]) == float(x.abs().max())
    assert s is not None and float(s) == pytest.approx(float(x.abs().max()) / 448.0, rel=1e-6)
    b.eval()  # eval: the scale, and no record
    before = b.input_amax_history.clone()
    b.role_scale("input", amax=torch.tensor(896.0))
    assert torch.equal(b.input_amax_history, before)
    dyn = _layer("tensorwise")
    assert dyn.role_scale("input", x) is None  # dynamic: the GEMM computes it
    assert float(dyn.role_scale("input", amax=torch.tensor(896.0))) == 2.0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="role must be one of"):
        dyn.role_scale("bias", x)
    with pytest.raises(TypeError, match="give the tensor t or its amax="):
        dyn.role_scale("input")


def test_bind_scaling_state_rebinds_and_refreshes_static_scales() -> None:
    m = _layer("static")
    from lowprec.float8 import calibrate

    with calibrate(m):
        m(_data(6, 4, 1.0)).sum().backward()
    sc = m.scaler("input")
    assert sc is not None and sc.frozen
    new = m.input_static_amax * 4
    m.bind_scaling_state({"input_static_amax": new})
    assert m.input_static_amax is new and sc.calib_amax is new  # type: ignore[union-attr]
    assert float(sc.scale) == pytest.approx(float(new) / 448.0, rel=1e-6)  # type: ignore[union-attr]
    m.input_static_amax.mul_(2)  # changed in place (a cross-rank MAX reduction)
    m.refresh_static_scales()
    assert float(sc.scale) == pytest.approx(float(new) / 448.0, rel=1e-6)  # type: ignore[union-attr]
    assert set(m.scaling_state()) == {
        "input_static_amax",
        "weight_static_amax",
        "grad_output_static_amax",
    } & set(m.scaling_buffers())
    with pytest.raises(ValueError, match="is not a scaling buffer"):
        m.bind_scaling_state({"weight": torch.zeros(())})
    with pytest.raises(ValueError, match="expected a tensor of shape"):
        m.bind_scaling_state({"input_static_amax": torch.zeros(3)})


class _Marked(Tensor):
    """A tensor subclass standing for a sharded weight type."""


def test_register_weight_forward_routes_a_subclass_weight() -> None:
    m = _layer("tensorwise")
    seen: list[Any] = []

    def forward(layer: Float8Linear, x: Tensor, w: Tensor) -> Tensor:
        seen.append((layer, type(w)))
        return layer.gemm(x, w.as_subclass(Tensor)) * 0 + 7

    register_weight_forward(_Marked, forward)
    try:
        m.weight = nn.Parameter(m.weight.detach().as_subclass(_Marked))
        y = m(torch.randn(3, 32))
        assert seen == [(m, _Marked)] and bool((y == 7).all())
        m.linear_fn = lambda x, w, b, *, matmul: matmul(x, w)
        with pytest.raises(TypeError, match="runs its own forward"):
            m(torch.randn(3, 32))
    finally:
        _WEIGHT_FORWARDS[:] = [(c, f) for c, f in _WEIGHT_FORWARDS if c is not _Marked]
    with pytest.raises(TypeError, match=r"subclass of torch\.Tensor"):
        register_weight_forward(int, forward)
    with pytest.raises(TypeError, match="forward must be callable"):
        register_weight_forward(_Marked, 3)  # type: ignore[arg-type]


def test_linear_fn_gets_the_layers_gemm() -> None:
    m = _layer("delayed")
    m.bias = nn.Parameter(torch.randn(16))
    x = torch.randn(4, 32)
    ref = _layer("delayed")
    ref.bias = m.bias
    calls: list[Any] = []

    def doubled(x: Tensor, w: Tensor, b: Tensor | None, *, matmul: Any) -> Tensor:
        calls.append(matmul)
        return 2 * matmul(x, w) + (0 if b is None else b)

    m.linear_fn = doubled
    y = m(x)
    assert calls and calls[0] == m.gemm
    assert torch.equal(y, 2 * ref.gemm(x, ref.weight) + m.bias)
    assert torch.equal(m.input_amax_history, ref.input_amax_history)  # the layer's state ran
