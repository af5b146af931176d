"""Issue 15 item 5: torch's idioms on what ``prepare`` returns. The optimizer is a
``torch.optim.Optimizer`` (LR schedulers, ``param_groups``, ``add_param_group``,
``state_dict``); ``scaler.unscale_`` then ``clip_grad_norm_(model.parameters())`` clips
the real update, also with FP32 master weights.

Oracles: SGD updates computed by hand in float64 from the model's scaled FP16 gradients
(``g = G_scaled / S``, exact: ``S`` is a power of two), and a second, uninterrupted run
for the resume."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from lowprec.amp import MasterWeights, StaticLossScaler
from lowprec.recipes import Prepared, prepare
from lowprec.recipes.presets import get_recipe
from lowprec.recipes.step import Plain, train_step


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def _backward(p: Prepared, seed: int) -> None:
    x, y = _batch(seed)
    dtype = next(p.model.parameters()).dtype
    with p.compute():
        loss = (p.model(x.to(dtype)).float() - y).square().mean()
    p.scaler.scale(loss).backward()


def _sgd(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda ps: torch.optim.SGD(ps, lr=lr)


def _masters(p: Prepared) -> list[Tensor]:
    return [m.detach().double().clone() for m in p.optimizer.master_params]


def test_scheduler_drives_the_real_update() -> None:
    """LambdaLR accepts the optimizer and its lr reaches the FP32 masters' update:
    step t moves each master by ``-lr · 0.5^t · g`` (SGD)."""
    p = prepare(_model(), "fp16-static-ls", _sgd(0.5))
    assert isinstance(p.optimizer, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(p.optimizer, lambda t: 0.5**t)
    scale = p.scaler.get_scale()
    for t in range(3):
        _backward(p, t)
        g = [q.grad.double() / scale for q in p.model.parameters()]  # type: ignore[union-attr]
        before = _masters(p)
        assert p.scaler.step(p.optimizer)
        p.scaler.update()
        p.optimizer.zero_grad()
        sched.step()
        for m, m0, gi in zip(_masters(p), before, g, strict=True):
            ref = m0 - 0.5 * 0.5**t * gi
            # one FP32 multiply-add per element: relative 2^-23 of the larger term
            tol = 2.0**-22 * (m0.abs() + (0.5 * gi).abs())
            assert bool(((m - ref).abs() <= tol).all()), t
    assert p.optimizer.param_groups[0]["lr"] == 0.5 * 0.5**3


def test_unscale_then_clip_grad_norm_clips_the_real_update() -> None:
    """``unscale_`` + ``clip_grad_norm_(model.parameters(), c)`` with FP16 parameters and
    FP32 masters: the masters move by ``-lr · min(1, c / ‖g‖) · g``, ``g`` the unscaled
    gradient, ``‖g‖`` over all parameters in float64. Tolerance 2^-8 relative: the clip
    coefficient is computed by torch from the FP16 gradients (their rounding, the FP16
    norms and the FP16 coefficient: ≤ 4 roundings of 2^-11 each) and the edit reaches the
    masters through one more FP16 rounding of ``g · c``."""
    p = prepare(_model(), "fp16-static-ls", _sgd(0.5))
    _backward(p, 0)
    scale = p.scaler.get_scale()
    g = [q.grad.double() / scale for q in p.model.parameters()]  # type: ignore[union-attr]
    norm = math.sqrt(sum(float(gi.square().sum()) for gi in g))
    c = 0.1 * norm  # clipping shrinks the update 10×: an ignored clip fails the check
    coef = min(1.0, c / (norm + 1e-6))
    before = _masters(p)
    p.scaler.unscale_(p.optimizer)
    total = torch.nn.utils.clip_grad_norm_(p.model.parameters(), c)
    assert abs(float(total) - norm) <= 2.0**-8 * norm, "the model's gradients are unscaled"
    assert p.scaler.step(p.optimizer)
    p.scaler.update()
    num = den = 0.0
    for m, m0, gi in zip(_masters(p), before, g, strict=True):
        ref = -0.5 * coef * gi
        num += float((m - m0 - ref).square().sum())
        den += float(ref.square().sum())
    assert math.sqrt(num / den) <= 2.0**-8


def test_clip_grad_value_edits_reach_the_masters() -> None:
    """An elementwise edit (clip_grad_value_) reaches the FP32 update element by element:
    ``-lr · clamp(g, -v, v)`` within 2^-10 relative (FP16 rounding of g and of v)."""
    p = prepare(_model(), "fp16-dynamic-ls", _sgd(1.0))
    _backward(p, 1)
    scale = p.scaler.get_scale()
    g = [q.grad.double() / scale for q in p.model.parameters()]  # type: ignore[union-attr]
    v = 0.5 * max(float(gi.abs().max()) for gi in g)
    before = _masters(p)
    p.scaler.unscale_(p.optimizer)
    torch.nn.utils.clip_grad_value_(p.model.parameters(), v)
    assert p.scaler.step(p.optimizer)
    for m, m0, gi in zip(_masters(p), before, g, strict=True):
        ref = -gi.clamp(-v, v)
        assert bool(((m - m0 - ref).abs() <= 2.0**-10 * ref.abs() + 1e-7).all())


def test_add_param_group_gives_fp32_masters() -> None:
    """A group added after ``prepare`` (a head unfrozen later) trains with its own lr."""
    model = _model()
    model[2].requires_grad_(False)
    p = prepare(model, "bf16", _sgd(0.5))
    assert len(p.optimizer.master_params) == 2
    model[2].requires_grad_(True)
    p.optimizer.add_param_group({"params": list(model[2].parameters()), "lr": 0.25})
    assert len(p.optimizer.master_params) == 4
    assert all(m.dtype == torch.float32 for m in p.optimizer.master_params)
    assert p.optimizer.param_groups[1]["lr"] == 0.25
    _backward(p, 2)
    g = model[2].weight.grad
    assert g is not None
    g = g.double()
    w0 = p.optimizer.master_params[2].detach().double().clone()
    p.scaler.step(p.optimizer)
    p.optimizer.zero_grad()
    assert model[2].weight.grad is None
    w1 = p.optimizer.master_params[2].detach().double()
    assert torch.allclose(w1, w0 - 0.25 * g, rtol=0, atol=2.0**-22 * float(w0.abs().max()))
    assert torch.equal(model[2].weight, w1.to(torch.bfloat16))


def _run(p: Prepared, sched: torch.optim.lr_scheduler.LRScheduler, steps: range) -> None:
    for t in steps:
        _backward(p, t)
        p.scaler.unscale_(p.optimizer)
        torch.nn.utils.clip_grad_norm_(p.model.parameters(), 1.0)
        p.scaler.step(p.optimizer)
        p.scaler.update()
        p.optimizer.zero_grad()
        sched.step()


def _prepared(seed: int) -> tuple[Prepared, torch.optim.lr_scheduler.LRScheduler]:
    recipe = get_recipe("bf16", stochastic_rounding=True)
    p = prepare(
        _model(seed),
        recipe,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        generator=torch.Generator().manual_seed(seed),
    )
    return p, torch.optim.lr_scheduler.LambdaLR(p.optimizer, lambda t: 1.0 / (1 + t))


def test_state_dict_resume_is_bit_exact() -> None:
    """Save after 3 steps, resume into a fresh model (other weights, other generator):
    3 more steps give the uninterrupted run's weights bit for bit (stochastic rounding,
    AdamW state, scheduler, clipping)."""
    ref, ref_sched = _prepared(0)
    _run(ref, ref_sched, range(3))
    saved = copy.deepcopy((ref.state_dict(), ref_sched.state_dict()))
    _run(ref, ref_sched, range(3, 6))
    p, sched = _prepared(1)
    p.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    _run(p, sched, range(3, 6))
    for a, b in zip(p.model.parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(p.optimizer.master_params, ref.optimizer.master_params, strict=True):
        assert torch.equal(a, b)


def test_lr_mult_groups_follow_train_step() -> None:
    """u-μP groups (``lr_mult``) under MasterWeights: ``train_step(lr=...)`` sets each
    inner group's lr to ``lr · lr_mult`` and the update uses it (exact: powers of two)."""

    class Lin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.ones(2, dtype=torch.float16))
            self.b = nn.Parameter(torch.ones(2, dtype=torch.float16))

        def forward(self, x: Tensor, y: Tensor) -> tuple[None, Tensor]:
            return None, (self.a.float() * x).sum() + (self.b.float() * x).sum()

    m = Lin()
    opt = MasterWeights(
        [{"params": [m.a], "lr_mult": 0.5}, {"params": [m.b], "lr_mult": 0.25}], _sgd(1.0)
    )
    r = train_step(Plain(m, opt, StaticLossScaler(8.0)), torch.ones(2), torch.zeros(2), lr=0.5)
    assert not r.skipped
    assert [g["lr"] for g in opt.optimizer.param_groups] == [0.25, 0.125]
    assert torch.equal(m.a, torch.full((2,), 0.75, dtype=torch.float16))
    assert torch.equal(m.b, torch.full((2,), 0.875, dtype=torch.float16))


def _small_gradient_run(loss_mult: float) -> tuple[Prepared, list[Tensor], float]:
    """fp16-dynamic-ls, SGD; one backward of a loss times ``loss_mult`` (unscaled
    gradients in FP16's subnormal range at 1e-3, below it at 1e-5), unscaled; the FP32
    gradients and their norm."""
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(128, 128, bias=False), nn.Tanh(), nn.Linear(128, 128, bias=False)
    )
    run = prepare(base, "fp16-dynamic-ls", lambda ps: torch.optim.SGD(ps, lr=1e-2 / loss_mult))
    with run.compute():
        loss = run.model(torch.randn(64, 128).half()).float().pow(2).mean() * loss_mult
        run.scaler.scale(loss).backward()
    run.scaler.unscale_(run.optimizer)
    opt = run.optimizer
    assert isinstance(opt, MasterWeights)
    g32 = [m.grad.clone() for m in opt.master_params if m.grad is not None]
    return run, g32, math.sqrt(sum(float((g.double() ** 2).sum()) for g in g32))


@pytest.mark.parametrize("loss_mult", [1e-3, 1e-5])
def test_clip_of_the_fp32_gradients_where_fp16_ones_underflow(
    loss_mult: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Unscaled gradients below FP16's normal range: a clip of the model's FP16 gradients
    measured their rounded norm (0 at 1e-5: no clip, an update 4x the clipped one; 0.21
    off at 1e-3), and a WARNING now says so. ``optimizer.clip_grad_norm_`` clips the FP32
    gradients as torch clips FP32 ones: the update is ``-lr·c/(‖g32‖ + 1e-6)·g32``
    (torch's clip coefficient), up to one float32 rounding of the weight it is added to
    (2^-23 of the largest weight)."""
    run, g32, n32 = _small_gradient_run(loss_mult)
    opt = run.optimizer
    assert isinstance(opt, MasterWeights)
    assert "optimizer.clip_grad_norm_" in caplog.text  # the model's FP16 norm is off
    before = [m.detach().clone() for m in opt.master_params]
    total = opt.clip_grad_norm_(n32 / 4)
    assert float(total) == pytest.approx(n32, rel=1e-5)
    run.scaler.step(opt)
    lr = 1e-2 / loss_mult
    for b, m, g in zip(before, opt.master_params, g32, strict=True):
        want = -lr * (n32 / 4) / (n32 + 1e-6) * g
        ulp = 2.0**-23 * float(b.abs().max())
        torch.testing.assert_close(m.detach() - b, want, rtol=1e-5, atol=ulp)
        assert float((m.detach() - b).norm()) == pytest.approx(float(want.norm()), rel=1e-3)


@pytest.mark.parametrize("recipe", ["fp16-dynamic-ls", "bf16"])
def test_rounded_norm_check_runs_for_fp16_until_it_warns(
    recipe: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rounded-norm check costs two norms and a host sync per ``unscale_``: it runs
    only where the model's gradients are FP16 (BF16 has FP32's range), and not again once
    it has warned. Three steps of underflowing gradients: one check for FP16, none for
    BF16."""
    calls: list[int] = []
    check = MasterWeights._check_rounded_norm

    def counted(self: MasterWeights, pairs: list[tuple[Tensor, Tensor]]) -> None:
        calls.append(len(pairs))
        check(self, pairs)

    monkeypatch.setattr(MasterWeights, "_check_rounded_norm", counted)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Tanh(), nn.Linear(32, 32))
    run = prepare(base, recipe, lambda ps: torch.optim.SGD(ps, lr=1e-3))
    dtype = torch.float16 if recipe.startswith("fp16") else torch.bfloat16
    for _ in range(3):
        with run.compute():
            loss = run.model(torch.randn(16, 32, dtype=dtype)).float().pow(2).mean() * 1e-5
            run.scaler.scale(loss).backward()
        run.scaler.unscale_(run.optimizer)
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.zero_grad()
    assert calls == ([3] if dtype == torch.float16 else [])


def _static_run(evaluate: bool) -> tuple[float, dict[str, Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    run = prepare(model, "fp8-static", lambda ps: torch.optim.SGD(ps, lr=0.1))
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(16, 32, generator=g, dtype=torch.bfloat16)
        run.model.train()
        with run.compute():
            loss = run.model(x).float().pow(2).mean()
            run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.zero_grad()
        if evaluate and step == 0:  # a validation pass inside the 4 calibration batches
            run.model.eval()
            with torch.no_grad(), run.compute():
                x_val = torch.randn(16, 32, generator=torch.Generator().manual_seed(9))
                run.model(100 * x_val.bfloat16())
    return float(loss), {k: v.clone() for k, v in run.model.state_dict().items()}


def test_an_evaluation_during_static_calibration_changes_nothing() -> None:
    """fp8-static calibrates on its first 4 training batches; an evaluation between them
    (HF's eval_steps, Lightning's val_check_interval) recorded its amax into the static
    maxima (0.83 -> 86 with inputs 100x larger) and changed every later step. Training
    with and without the evaluation is now bit-identical. An explicit ``calibrate(model)``
    block still records eval-mode passes (calibration on held-out data)."""
    from lowprec.float8 import Float8Linear, calibrate

    loss_a, state_a = _static_run(False)
    loss_b, state_b = _static_run(True)
    assert loss_a == loss_b
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), k
    m = Float8Linear.from_linear(nn.Linear(16, 16), "static")
    m.eval()
    with calibrate(m):
        m(torch.full((4, 16), 3.0)).sum().backward()
    assert float(m.input_static_amax) == 3.0
