"""Issue 14, defects 6 and 7 in the unit ops: zero-size dims, bad dims, overflowing
scales, non-finite numbers and non-float dtypes give a correct result or a clear error."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lowprec.unit import functional as U


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


# unit op vs the torch op it scales (forward factor given): zero-size dims included
ZERO_SIZE: list[tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]] = [
    ("linear K=0", lambda: U.linear(_r(3, 0), _r(4, 0)), lambda: torch.zeros(3, 4)),
    ("linear N=0", lambda: U.linear(_r(3, 4), _r(0, 4)), lambda: torch.zeros(3, 0)),
    ("linear B=0", lambda: U.linear(_r(0, 4), _r(2, 4), _r(2)), lambda: torch.zeros(0, 2)),
    ("matmul K=0", lambda: U.matmul(_r(3, 0), _r(0, 4)), lambda: torch.zeros(3, 4)),
    ("matmul N=0", lambda: U.matmul(_r(3, 2), _r(2, 0)), lambda: torch.zeros(3, 0)),
    ("readout K=0", lambda: U.linear_readout(_r(3, 0), _r(4, 0)), lambda: torch.zeros(3, 4)),
    ("softmax n=0", lambda: U.softmax(_r(3, 0)), lambda: torch.zeros(3, 0)),
    ("softmax rows=0", lambda: U.softmax(_r(0, 5)), lambda: torch.zeros(0, 5)),
    ("gelu empty", lambda: U.gelu(_r(0)), lambda: torch.zeros(0)),
    ("layer_norm rows=0", lambda: U.layer_norm(_r(0, 4), (4,)), lambda: torch.zeros(0, 4)),
    ("conv1d N=0", lambda: U.conv1d(_r(0, 2, 5), _r(3, 2, 2)), lambda: torch.zeros(0, 3, 4)),
    ("conv1d C=0", lambda: U.conv1d(_r(1, 0, 5), _r(3, 0, 2)), lambda: torch.zeros(1, 0, 4)),
    ("embedding none", lambda: U.embedding(torch.zeros(0, dtype=torch.long), _r(5, 4)),
     lambda: torch.zeros(0, 4)),
    ("sdpa L=0", lambda: U.scaled_dot_product_attention(_r(1, 0, 8), _r(1, 0, 8), _r(1, 0, 8)),
     lambda: torch.zeros(1, 0, 8)),
    ("sdpa E=0", lambda: U.scaled_dot_product_attention(_r(1, 3, 0), _r(1, 3, 0), _r(1, 3, 0)),
     lambda: torch.zeros(1, 3, 0)),
    ("sdpa causal L=0", lambda: U.scaled_dot_product_attention(
        _r(1, 0, 8), _r(1, 0, 8), _r(1, 0, 8), is_causal=True), lambda: torch.zeros(1, 0, 8)),
    ("cross_entropy sum N=0", lambda: U.cross_entropy(
        _r(0, 5), torch.zeros(0, dtype=torch.long), "sum"), lambda: torch.tensor(0.0)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "op", "ref"), ZERO_SIZE, ids=[c[0] for c in ZERO_SIZE])
def test_zero_size_dims_give_torchs_result(
    name: str, op: Callable[[], torch.Tensor], ref: Callable[[], torch.Tensor]
) -> None:
    y, want = op(), ref()
    assert y.shape == want.shape and torch.equal(y, want), name


def test_zero_size_backward_is_finite() -> None:
    x, w = _r(3, 0).requires_grad_(), _r(4, 0).requires_grad_()
    U.linear(x, w).sum().backward()
    assert x.grad is not None and x.grad.shape == (3, 0)
    assert w.grad is not None and w.grad.shape == (4, 0)


@pytest.mark.parametrize("dim", [5, -3, 2])
def test_softmax_bad_dim_names_dim(dim: int) -> None:
    for op in (U.softmax, U.log_softmax):
        with pytest.raises(ValueError, match=rf"dim={dim} is out of range"):
            op(_r(3, 4), dim=dim)
    with pytest.raises(TypeError, match="dim must be an int"):
        U.softmax(_r(3, 4), dim=1.0)  # type: ignore[arg-type]


def test_softmax_of_0_dim_tensor_is_torchs() -> None:
    x = torch.tensor(0.3)
    # one key: p = 1 exactly, already of unit rms (scale 1)
    assert torch.equal(U.softmax(x, dim=0), torch.softmax(x, dim=0))


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_large_logit_scale_does_not_overflow(causal: bool) -> None:
    """head dim 768 with scale=1: σ² = 768, e^{σ²} overflows a double. Rows are then
    nearly one-hot: E[Σp²] over 4 keys is 1 less the chance of two logits within a few
    units of each other (about 4% at σ = 27.7), so the output is torch's times one finite
    factor within 3% of 1 (1 for the causal first row, which has one key)."""
    q, k, v = (_r(1, 2, 4, 768) for _ in range(3))
    y = U.scaled_dot_product_attention(q, k, v, scale=1.0, is_causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, scale=1.0, is_causal=causal)
    assert torch.isfinite(y).all()
    factor = float(y.flatten()[0] / ref.flatten()[0])
    torch.testing.assert_close(y, ref * factor, rtol=1e-6, atol=1e-6)
    assert 1.0 <= factor < 1.03


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.0, -1.0])
def test_residual_taus_refuses_bad_weight(bad: float) -> None:
    with pytest.raises(ValueError, match="weight must be finite and > 0"):
        U.residual_taus(3, "weighted", weight=bad)


@pytest.mark.parametrize("bad", [math.nan, 0.0, 1.0, math.inf])
def test_tau_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="tau"):
        U.residual_taus(3, "fixed", tau=bad)
    with pytest.raises(ValueError, match="tau"):
        U.residual_add(_r(2), _r(2), bad)
    with pytest.raises(ValueError, match="tau"):
        U.residual_split(_r(2), bad)


NUMBERS: list[tuple[str, Callable[[float], Any]]] = [
    ("mult", lambda v: U.gelu(_r(3), mult=v)),
    ("mult", lambda v: U.silu(_r(3), mult=v)),
    ("mult", lambda v: U.softmax(_r(3), mult=v)),
    ("weights", lambda v: U.add(_r(3), _r(3), weights=(v, 1.0))),
    ("eps", lambda v: U.layer_norm(_r(2, 3), (3,), eps=v)),
    ("eps", lambda v: U.rms_norm(_r(2, 3), (3,), eps=v)),
    ("scale", lambda v: U.scaled_dot_product_attention(_r(1, 2, 4), _r(1, 2, 4), _r(1, 2, 4),
                                                       scale=v)),
    ("p", lambda v: U.dropout(_r(3), p=v)),
]  # fmt: skip


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize(
    ("name", "call"), NUMBERS, ids=[f"{n}{i}" for i, (n, _) in enumerate(NUMBERS)]
)
def test_non_finite_numbers_refused(name: str, call: Callable[[float], Any], value: float) -> None:
    with pytest.raises(ValueError, match=name):
        call(value)


DTYPES = [torch.int64, torch.int32, torch.bool, torch.complex64]
CALLS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("x", lambda t: U.linear(t, _r(2, 4))),
    ("weight", lambda t: U.linear(_r(3, 4), t)),
    ("a", lambda t: U.matmul(t, _r(4, 2))),
    ("b", lambda t: U.matmul(_r(3, 4), t)),
    ("x", lambda t: U.gelu(t)),
    ("x", lambda t: U.relu(t)),
    ("x", lambda t: U.silu(t)),
    ("gate", lambda t: U.silu_glu(_r(3, 4), t)),
    ("x", lambda t: U.softmax(t)),
    ("x", lambda t: U.log_softmax(t)),
    ("a", lambda t: U.add(t, _r(3, 4))),
    ("skip", lambda t: U.residual_add(_r(3, 4), t, 0.5)),
    ("x", lambda t: U.residual_split(t, 0.5)),
    ("x", lambda t: U.layer_norm(t, (4,))),
    ("x", lambda t: U.rms_norm(t, (4,))),
    ("x", lambda t: U.dropout(t, 0.1)),
    ("logits", lambda t: U.cross_entropy(t, torch.zeros(3, dtype=torch.long))),
    ("weight", lambda t: U.embedding(torch.zeros(2, dtype=torch.long), t)),
    ("q", lambda t: U.scaled_dot_product_attention(t, _r(3, 4), _r(3, 4))),
    ("x", lambda t: U.conv1d(t.reshape(1, 3, 4), _r(2, 3, 2))),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("arg", "call"), CALLS, ids=[f"{a}{i}" for i, (a, _) in enumerate(CALLS)])
def test_non_float_inputs_refused(
    arg: str, call: Callable[[torch.Tensor], Any], dtype: torch.dtype
) -> None:
    t = torch.ones(3, 4).to(dtype)
    with pytest.raises(TypeError, match=rf"^{arg} must be a floating-point tensor"):
        call(t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64])
def test_index_arguments_must_be_integer(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="idx"):
        U.embedding(torch.zeros(2).to(dtype), _r(5, 3))
    with pytest.raises(TypeError, match="targets"):
        U.cross_entropy(_r(2, 5), torch.zeros(2).to(dtype))


def test_cross_entropy_empty_mean_and_no_classes_refused() -> None:
    with pytest.raises(ValueError, match="targets: empty"):
        U.cross_entropy(_r(0, 5), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="logits: need at least one class"):
        U.cross_entropy(_r(3, 0), torch.zeros(3, dtype=torch.long))


def test_arguments_that_would_be_ignored_or_fail_late_are_refused() -> None:
    """Found by a new-user trial: an invalid tau list was accepted and failed only at the
    first forward; tau with a scheme other than "fixed", and output_mult/float8_readout
    with readout=None, were accepted and ignored (outputs bit-identical to the defaults)."""
    import torch.nn as nn

    from lowprec.unit import UnitConfig, unit_scale

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))

    for taus in ([0.1, 1.2], [-0.5], [float("nan")], [1.0]):
        with pytest.raises(ValueError, match="every tau must be a number in"):
            unit_scale(model(), residual=taus)
    with pytest.raises(ValueError, match="applies only to residual='fixed'"):
        unit_scale(model(), tau=0.3)
    with pytest.raises(ValueError, match="readout=None: output_mult"):
        unit_scale(model(), readout=None, config=UnitConfig(output_mult=5.0))
    unit_scale(model(), residual="fixed", tau=0.3)  # accepted where it acts
    unit_scale(model(), residual=[])  # no residual add in this model: no tau
    unit_scale(model(), readout=None)
