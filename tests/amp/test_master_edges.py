"""MasterWeights where a loop leaves torch's happy path (found by a new user's trial against
``torch.amp``): gradients cleared on the model after a skipped step, closures (LBFGS) that
evaluate trial points, model weights changed after ``prepare``, a clip whose FP16 norm
overflows, and GradScaler's ``unscale_`` + ``update`` without ``step``.

Oracles: torch's optimizers on FP32 copies driven by ``torch.amp.GradScaler`` (bit for bit
where the arithmetic is the same), plain LBFGS on FP32 parameters, and hand-computed
updates."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import lowprec
from lowprec.amp import DynamicLossScaler, MasterWeights, StaticLossScaler

Zero = Callable[[nn.Module, torch.optim.Optimizer], None]
ZEROS: dict[str, Zero] = {
    "optimizer.zero_grad": lambda m, o: o.zero_grad(),
    "model.zero_grad": lambda m, o: m.zero_grad(),
    "model.zero_grad(set_to_none=False)": lambda m, o: m.zero_grad(set_to_none=False),
    "p.grad = None": lambda m, o: [setattr(p, "grad", None) for p in m.parameters()],
}


def _batches(n: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


@pytest.mark.parametrize("zero", list(ZEROS), ids=list(ZEROS))
def test_gradients_cleared_any_way_after_a_skipped_step(zero: str) -> None:
    """An Inf at step 2 skips that step; every later step must update from its own
    gradients, however the loop clears them. Reference: torch's GradScaler driving SGD
    on FP32 copies of the FP16 weights, the FP16 gradients upcast each step (the same
    arithmetic as MasterWeights: equal to the bit). Before, after the skip the masters
    kept the skipped step's gradients and divided them by the scale again: every later
    step was skipped and the scale fell 512 → 16 in 8 steps."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3).half()
    ref_params = [p.detach().float().clone().requires_grad_() for p in m.parameters()]
    opt = MasterWeights(m.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    sc = DynamicLossScaler(init_scale=1024.0, growth_interval=1000)
    ref_sc = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    scales, ref_scales = [], []
    for t, x in enumerate(_batches(8)):
        ZEROS[zero](m, opt)
        ref_opt.zero_grad()
        ref_sc.scale(torch.zeros(()))  # (its scale starts at the first scale())
        sc.scale(m(x.half()).float().pow(2).mean()).backward()
        if t == 2:
            assert m.weight.grad is not None
            m.weight.grad[0, 0] = float("inf")
        for p, r in zip(m.parameters(), ref_params, strict=True):
            assert p.grad is not None
            r.grad = p.grad.float()
        sc.step(opt)
        sc.update()
        ref_sc.step(ref_opt)
        ref_sc.update()
        scales.append(sc.get_scale())
        ref_scales.append(ref_sc.get_scale())
        for p, r in zip(m.parameters(), ref_params, strict=True):
            torch.testing.assert_close(p, r.detach().half(), rtol=0, atol=0)
    assert scales == ref_scales == [1024.0, 1024.0, 512.0] + [512.0] * 5


def test_unscaled_then_not_stepped_then_cleared_on_the_model() -> None:
    """``unscale_``, no step (the loop decides against it), ``update``, ``model.zero_grad()``
    and another backward: the next unscale_ shows the new gradient, not the old one divided
    by the scale twice (it read 2.0/S² before), and ``update`` backs off on an Inf found by
    an ``unscale_`` without ``step``, as torch's does (1024 → 512; lowprec kept 1024)."""
    m = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        m.weight.fill_(1.0)
    opt = MasterWeights(m.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    sc = StaticLossScaler(16.0)
    x = torch.ones(1, 1, dtype=torch.float16)
    sc.scale(m(x).float().sum()).backward()  # ∂w = 1
    sc.unscale_(opt)
    sc.update()
    m.zero_grad()
    sc.scale(2.0 * m(x).float().sum()).backward()  # ∂w = 2
    sc.unscale_(opt)
    assert m.weight.grad is not None and float(m.weight.grad) == 2.0
    assert sc.step(opt)
    sc.update()
    assert float(m.weight) == pytest.approx(1.0 - 0.1 * 2.0, abs=1e-3)

    dyn = DynamicLossScaler(init_scale=1024.0)
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    m.zero_grad()
    dyn.scale(m(x).float().sum() * float("inf")).backward()
    dyn.unscale_(opt)
    dyn.update()
    w = torch.ones(1, requires_grad=True)
    ref_opt = torch.optim.SGD([w], lr=0.1)
    (ref.scale(w.sum() * float("inf"))).backward()
    ref.unscale_(ref_opt)
    ref.update()
    assert dyn.get_scale() == ref.get_scale() == 512.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lbfgs_closure_sees_its_trial_points(dtype: torch.dtype) -> None:
    """LBFGS evaluates the loss at each trial point: the closure must see the model at the
    masters the optimizer moved. FP32 parameters: equal to plain LBFGS on the same
    parameters (same arithmetic, 1e-12 allowed for the copies). Before, the closure saw
    the old weights twice and LBFGS stopped at a loss of 6.7e-3 (plain: 5e-13)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g, dtype=torch.float64)
    y = x @ torch.randn(8, 1, generator=g, dtype=torch.float64)

    def fit(master: bool) -> tuple[float, list[float]]:
        torch.manual_seed(1)
        m = nn.Linear(8, 1).to(dtype)

        def lbfgs(ps: list[Tensor]) -> torch.optim.Optimizer:
            return torch.optim.LBFGS(ps, lr=1, max_iter=20, history_size=10)

        opt = MasterWeights(m.parameters(), lbfgs) if master else lbfgs(list(m.parameters()))
        seen: list[float] = []

        def closure() -> Tensor:
            opt.zero_grad()
            loss = (m(x.to(dtype)).float() - y.float()).pow(2).mean()
            loss.backward()
            seen.append(float(loss))
            return loss

        for _ in range(3):
            opt.step(closure)
        return float((m(x.to(dtype)).double() - y).pow(2).mean()), seen

    final, seen = fit(True)
    assert all(a != b for a, b in itertools.pairwise(seen[:6])), seen[:6]
    if dtype == torch.float32:
        ref, ref_seen = fit(False)
        assert seen == pytest.approx(ref_seen, rel=1e-6, abs=1e-12)
        assert final == pytest.approx(ref, abs=1e-9)
        assert final < 1e-8
    else:  # BF16 weights: the loss floor is their rounding (2^-8 relative per weight)
        assert final < 1e-3


def test_weights_changed_after_prepare_are_kept() -> None:
    """``load_state_dict`` into the prepared model and a bias zeroed under ``no_grad``,
    then one SGD step at lr 1e-3: the weights move by about lr·∂w from the loaded ones
    (they went back to the pre-load masters, 0.86 away, before); the masters take the
    loaded values exactly (FP16 values are FP32 values)."""
    torch.manual_seed(0)
    pretrained = nn.Linear(4, 4).half().state_dict()
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-3)  # noqa: E731
    run = lowprec.prepare(nn.Linear(4, 4), "fp16-dynamic-ls", sgd)
    run.model.load_state_dict(pretrained)
    with torch.no_grad():
        run.model.bias.zero_()
    w0, b0 = run.model.weight.float().clone(), run.model.bias.float().clone()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    with run.compute():
        run.scaler.scale(run.model(x).float().pow(2).mean()).backward()
    assert run.model.weight.grad is not None and run.model.bias.grad is not None
    gw, gb = run.model.weight.grad.float() / run.scaler.get_scale(), run.model.bias.grad.float()
    gb = gb / run.scaler.get_scale()
    assert run.scaler.step(run.optimizer)
    run.scaler.update()
    masters = run.optimizer.master_params
    torch.testing.assert_close(masters[0], w0 - 1e-3 * gw, rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(masters[1], b0 - 1e-3 * gb, rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(run.model.weight, masters[0].half(), rtol=0, atol=0)


def test_untouched_parameters_keep_their_master_precision() -> None:
    """A step after which nothing touched the model keeps the masters' FP32 values (not
    re-read from the rounded model), also with stochastic rounding, whose written value
    differs from the master by up to one BF16 ulp: 40 steps of lr 1e-4 on BF16 weights
    move the masters by 40·1e-4·∂w, far below BF16's spacing at 1.0 (2^-7)."""
    torch.manual_seed(0)
    m = nn.Linear(8, 8).bfloat16()
    opt = MasterWeights(
        m.parameters(), lambda ps: torch.optim.SGD(ps, lr=1e-4), stochastic_rounding=True,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    start = [p.detach().float().clone() for p in opt.master_params]
    for _ in range(40):
        opt.zero_grad()
        m.weight.grad = torch.ones_like(m.weight)
        m.bias.grad = torch.ones_like(m.bias)
        opt.step()
        opt.state_dict()  # reads the model's edits too: there are none
    for s, mp in zip(start, opt.master_params, strict=True):
        torch.testing.assert_close(mp, s - 40 * 1e-4, rtol=0, atol=1e-6)


def test_an_overflowed_fp16_clip_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """``clip_grad_norm_`` of the model's FP16 gradients whose norm (81920) passes 65504
    computes ``inf`` and scales them by 0: the update is zero, as torch's for FP16
    parameters, and lowprec now says so and how to clip instead (it was silent);
    ``optimizer.clip_grad_norm_`` clips by the FP32 norm: update norm lr·1. A clip that
    leaves values (``clip_grad_value_``) is carried as before, without the message."""
    m = nn.Linear(512, 512, bias=False).half()
    opt = MasterWeights(m.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    sc = StaticLossScaler(1.0)
    x = torch.full((1, 512), 8.0, dtype=torch.float16)

    def step(clip: Callable[[], object]) -> float:
        w0 = opt.master_params[0].detach().clone()
        opt.zero_grad()
        sc.scale((m(x).float() * 20.0).sum()).backward()  # ∂w = 160 everywhere
        sc.unscale_(opt)
        clip()
        assert sc.step(opt)
        sc.update()
        return float((opt.master_params[0] - w0).norm())

    with caplog.at_level(logging.WARNING, logger="lowprec.amp.master"):
        assert step(lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)) == 0.0
    assert "overflows FP16" in caplog.text and "8.192e+04" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowprec.amp.master"):
        assert step(lambda: opt.clip_grad_norm_(1.0)) == pytest.approx(0.1, rel=1e-4)
        clipped = step(lambda: torch.nn.utils.clip_grad_value_(m.parameters(), 1.0))
    assert clipped == pytest.approx(0.1 * 512, rel=1e-4)  # every element clipped to 1
    assert "overflows" not in caplog.text


def test_a_static_scale_that_overflows_every_step_warns(caplog: pytest.LogCaptureFixture) -> None:
    """StaticLossScaler(2^30) on FP16 gradients skips every step; it used to say nothing.
    The WARNING comes at the 10th skip in a row (not at 9), once; a finite step resets
    the count."""
    from lowprec.amp.loss_scaling import STATIC_SKIP_WARNING
    from lowprec.core.warn import reset_warnings

    reset_warnings("static-loss-scale:")
    m = nn.Linear(4, 1).half()
    opt = MasterWeights(m.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    sc = StaticLossScaler(2.0**30)
    x = torch.full((2, 4), 100.0, dtype=torch.float16)
    with caplog.at_level(logging.WARNING, logger="lowprec.amp.loss_scaling"):
        for i in range(STATIC_SKIP_WARNING + 3):
            opt.zero_grad()
            sc.scale(m(x).float().sum()).backward()
            assert not sc.step(opt)
            sc.update()
            if i == STATIC_SKIP_WARNING - 2:
                assert "skipped the last" not in caplog.text
    assert caplog.text.count("the static loss scale 1.07374e+09 skipped the last 10 steps") == 1
