"""Fused eager kernels of scalify's rules (lowprec.scalify.fused).

A kernel computes the rule's float32 result from the stored data and rounds it once to the
storage format, as the rule's eager ops do; inductor's float32 arithmetic (its erf, exp,
a row's summation order) may differ from aten's in the last float32 bit, so a stored
value may be the other neighbour of the exact value in a rare tie. The checks: every
result at most one storage unit further from the float64 value than the eager ops'
result, NaN/Inf where they give them, and their bits in all but a small fraction of
elements.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lowprec.core import kernels
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.scalify import ScalifyConfig, apply, scaled
from lowprec.scalify.config import set_config
from lowprec.scalify.fused import run_fp32

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _small_tensors_use_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "1")
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS_MIN_NUMEL", "1")
    monkeypatch.setenv("LOWPREC_SCALIFY_FUSED", "1")
    set_config(ScalifyConfig())


def _data(shape: tuple[int, ...], store: torch.dtype, seed: int, special: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    if special:
        x.view(-1)[:5] = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0])
        x[1] = -math.inf  # a fully masked softmax row
    return x.to(store)


def _cases(store: torch.dtype, special: bool) -> list[tuple[str, Any, list[Any], tuple[Any, ...],
                                                             dict[str, Any], Any]]:  # fmt: skip
    shape = (6, 100)  # rows not a multiple of the vector width: the tails too
    x, g = _data(shape, store, 0, special), _data(shape, store, 1, False)
    y = torch.softmax(x.float(), -1).to(store)
    ly = torch.log_softmax(x.float(), -1).to(store)
    s, p = torch.tensor(0.375), torch.tensor(2.0**-3)
    return [
        ("gelu", aten.gelu.default, [(x, s)], (), {}, p),
        ("gelu tanh", aten.gelu.default, [(x, None)], (), {"approximate": "tanh"}, None),
        ("gelu_backward", aten.gelu_backward.default, [(g, None), (x, s)], (),
         {"approximate": "none"}, None),
        ("softmax", aten._softmax.default, [(x, s)], (-1, False), {}, None),
        ("log_softmax", aten._log_softmax.default, [(x, None)], (1, False), {}, None),
        ("softmax_backward", aten._softmax_backward_data.default, [(g, None), (y, None)],
         (-1, torch.float32), {}, None),
        ("log_softmax_backward", aten._log_softmax_backward_data.default,
         [(g, s), (ly, None)], (-1, torch.float32), {}, p),
    ]  # fmt: skip


def _eager(func: Any, ops: list[Any], consts: tuple[Any, ...], kw: dict[str, Any],
           post: Any, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    vals = [d.to(dtype) * s.to(dtype) if s is not None else d.to(dtype) for d, s in ops]
    consts = tuple(torch.float64 if c is torch.float32 and dtype == torch.float64 else c
                   for c in consts)  # fmt: skip
    r = func(*vals, *consts, **kw)
    return r / post.to(dtype) if post is not None else r


@pytest.mark.parametrize("store", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("special", [False, True])
def test_kernels_round_the_float32_result_once(store: torch.dtype, special: bool) -> None:
    for name, func, ops, consts, kw, post in _cases(store, special):
        got = run_fp32(func, ops, store, consts, kw, post)
        assert got is not None and got.dtype == store and got.shape == ops[0][0].shape, name
        want = _eager(func, ops, consts, kw, post, torch.float32).to(store)
        exact = _eager(func, ops, consts, kw, post, torch.float64)
        # non-finite where the eager ops' are: ±Inf the same; for NaN, NaN or the float64
        # value (aten's vectorised float32 GELU gives NaN at +Inf, float64's gives +Inf)
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin), name
        nan = torch.isnan(want)
        assert torch.equal(got[~fin & ~nan], want[~fin & ~nan]), name
        odd = nan & ~torch.isnan(got)
        assert torch.equal(got[odd], exact[odd].to(store)), name
        # at most one storage unit further from the float64 value than the eager result
        # (which carries aten's own float32 error: large where float32 cancels, as in a
        # tanh-GELU's tail)
        mant = {torch.float16: 10, torch.bfloat16: 7}[store]
        emin = int(math.log2(torch.finfo(store).smallest_normal))
        e = exact[fin]
        _, ex = torch.frexp(e.abs())
        unit = torch.pow(2.0, (ex - 1 - mant).clamp_min(emin - mant))
        err_got = (got[fin].double() - e).abs()
        err_eager = (want[fin].double() - e).abs()
        assert bool((err_got <= err_eager + unit).all()), name
        same = (got == want) | (nan & torch.isnan(got))
        assert float(same.float().mean()) > 0.99, name  # one unit apart in rare ties only


def test_kernels_decline_what_they_do_not_compute() -> None:
    x = torch.randn(8, 16).half()
    assert run_fp32(aten.gelu.default, [(x, None)], torch.float32) is None  # fp32 storage
    assert run_fp32(aten.gelu.default, [(x.float(), None)], torch.float16) is None
    assert run_fp32(aten.gelu.default, [(x, torch.ones(1))], torch.float16) is None  # 1-d
    assert run_fp32(aten.gelu.default, [], torch.float16) is None


def _train_grads(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    m.zero_grad(set_to_none=True)
    _, loss = m(x, y)
    loss.backward()
    return [p.grad.detach().clone() for p in m.parameters() if p.grad is not None]


def test_scalified_model_uses_them_and_trains_like_the_eager_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scalify'd CharGPT's gradients with the fused kernels (forced on these small
    tensors) against the same model with every kernel off: the same maths, so agreeing
    far within FP16's model-level tolerance (5e-3); and the kernels did run."""
    cfg = ModelConfig(width=32, depth=1, heads=2, seq_len=16, vocab_size=20)
    torch.manual_seed(0)
    model = apply(CharGPT(cfg), "fp16")
    x = torch.randint(0, 20, (4, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 20, (4, 16), generator=torch.Generator().manual_seed(2))
    used: set[str] = set()
    run = kernels.run_kernel

    def spy(key: tuple[object, ...], *args: Any) -> Any:
        if key[0] == "scalify":
            used.add(str(key[1]))
        return run(key, *args)

    monkeypatch.setattr(kernels, "run_kernel", spy)
    fused = _train_grads(model, x, y)
    assert {"aten._softmax.default", "aten.gelu.default", "aten.add.Tensor"} <= used, used
    monkeypatch.setenv("LOWPREC_EAGER_KERNELS", "0")
    plain = _train_grads(model, x, y)
    assert len(fused) == len(plain) > 0
    for a, b in zip(fused, plain, strict=True):
        assert float((a - b).norm() / b.norm().clamp_min(1e-30)) < 1e-3
    assert not kernels._BROKEN, kernels._BROKEN


def test_unscaled_gelu_matches_plain_torch() -> None:
    """Through the rule: a scalify'd GELU of FP16 data at scale 0.5, against torch's FP32
    GELU of the same values rounded once to FP16."""
    x = scaled(torch.randn(64, 100).half(), 0.5)
    got = F.gelu(x)
    ref = F.gelu(x.dequantize(torch.float32))
    assert (
        float(((got.dequantize(torch.float32) - ref).abs() / ref.abs().clamp_min(1e-3)).max())
        < 2.0**-10
    )


def test_rules_leave_the_kernels_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without LOWPREC_SCALIFY_FUSED the rules run their eager ops (results that depend on
    the inputs only, not on which shapes compiled a cached kernel); a bad value is an error
    naming the variable."""
    monkeypatch.delenv("LOWPREC_SCALIFY_FUSED")
    x = scaled(torch.randn(64, 100).half(), 0.5)
    calls: list[object] = []
    run = kernels.run_kernel

    def spy(key: tuple[object, ...], *args: Any) -> Any:
        calls.append(key[0])
        return run(key, *args)

    monkeypatch.setattr(kernels, "run_kernel", spy)
    y = F.gelu(x).softmax(-1)
    assert "scalify" not in calls and isinstance(y.qdata, torch.Tensor)
    monkeypatch.setenv("LOWPREC_SCALIFY_FUSED", "maybe")
    with pytest.raises(ValueError, match="LOWPREC_SCALIFY_FUSED"):
        F.gelu(x)
