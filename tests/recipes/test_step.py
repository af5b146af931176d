"""lowprec.recipes.step: the one training step, its per-group learning rates, skipped steps,
and that ``lowprec train``, the demo and the benchmarks all run it.

Oracles: SGD updates computed by hand (``w - lr · lr_mult · grad``, exact in float32 for the
powers of two used), and the training job's own logged losses for the benchmark's step.
"""

from __future__ import annotations

import io
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import lowprec.jobs.train as train_mod
import lowprec.recipes.step as step_mod
from lowprec.amp import DynamicLossScaler
from lowprec.jobs.train import build, read_metrics, train
from lowprec.recipes.step import Plain, set_lr, train_step
from tests._helpers import TINY as JOB_TINY

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

TINY = replace(JOB_TINY, recipe="fp32-unit", steps=4, ckpt_every=4)


class _Lin(nn.Module):
    """``loss = sum(a · x) + sum(b · x)``: d loss / d a = d loss / d b = x."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(2, dtype=dtype))
        self.b = nn.Parameter(torch.ones(2, dtype=dtype))

    def forward(self, x: Tensor, y: Tensor) -> tuple[None, Tensor]:
        return None, (self.a * x).sum() + (self.b * x).sum()


def test_step_applies_each_groups_lr_mult() -> None:
    m = _Lin()
    opt = torch.optim.SGD(
        [{"params": [m.a]}, {"params": [m.b], "lr_mult": 0.25}], lr=123.0
    )  # the factory's lr is overwritten by the step's
    x = torch.tensor([1.0, 2.0])
    r = train_step(Plain(m, opt), x, x, lr=0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.125]
    # SGD: w ← w - lr_group · x; with x, lr powers of two every value is exact
    assert m.a.tolist() == [1 - 0.5 * 1, 1 - 0.5 * 2]
    assert m.b.tolist() == [1 - 0.125 * 1, 1 - 0.125 * 2]
    assert float(r.loss.detach()) == 6.0 and r.loss_scale == 1.0 and not r.skipped
    assert m.a.grad is None and m.b.grad is None  # zero_grad(set_to_none=True)
    # lr=None keeps the groups' rates
    train_step(Plain(m, opt), x, x)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.125]


def test_set_lr_rejects_non_numbers() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(TypeError, match="lr"):
        set_lr(opt, "0.1")  # type: ignore[arg-type]


def test_loss_scaled_step_with_overflow_is_skipped() -> None:
    """FP16 parameters, dynamic loss scale 2^16: the gradient ``x · 2^16`` with ``x = 1``
    is 65536 > 65504, Inf in FP16, so the step is skipped, the weights keep their values,
    the gradients are cleared and the scale halves. The next step (scale 2^15) applies."""
    m = _Lin(torch.float16)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    run = Plain(m, opt, DynamicLossScaler(2.0**16))
    x = torch.ones(2, dtype=torch.float16)
    r = train_step(run, x, x, lr=0.5, grad_stats=True)
    assert r.skipped and r.loss_scale == 2.0**16
    assert r.grad_stats is not None and r.grad_stats["grad_nonfinite_share"] == 1.0
    assert m.a.tolist() == [1.0, 1.0] and m.b.tolist() == [1.0, 1.0]
    assert m.a.grad is None
    assert run.scaler.loss_scale == 2.0**15
    r = train_step(run, x, x, lr=0.5, grad_stats=True)
    assert not r.skipped and r.loss_scale == 2.0**15
    assert r.grad_stats is not None and r.grad_stats["grad_norm"] == 2.0**15 * 2.0  # ‖x‖·S
    assert m.a.tolist() == [0.5, 0.5]  # unscaled gradient 1, lr 0.5


def _bench_recipes() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_recipes
    finally:
        sys.path.remove(str(BENCH))
    return bench_recipes


@pytest.mark.parametrize("recipe", ["fp32-unit", "fp16-dynamic-ls"])
def test_bench_recipes_trains_as_lowprec_train_does(tmp_path: Path, recipe: str) -> None:
    """The benchmark's step of a recipe gives exactly the losses ``lowprec train`` logs.
    For the unit recipe the groups' ``lr_mult`` differ from 1, so a step that ignored them
    would change the second loss."""
    cfg = replace(TINY, recipe=recipe)
    train(cfg, tmp_path / "run", progress=False)
    logged = [r["loss"] for r in read_metrics(tmp_path / "run")]
    bench = _bench_recipes()
    _, data = build(cfg)
    v = bench.Variant(recipe, "eager")
    bench._make_step(v, cfg, [data.batch("train", i) for i in range(cfg.steps)])
    got = []
    for _ in range(cfg.steps):
        v.step()
        got.append(float(v.loss.detach()))
    assert got == logged
    if recipe == "fp32-unit":
        prepared, _ = build(cfg)
        mults = {g["lr_mult"] for g in prepared.optimizer.param_groups}
        assert mults != {1.0}


def test_train_demo_and_lm_benchmarks_call_the_one_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train`` (and so the demo, which runs ``train`` per recipe) and the benchmarks'
    ``lm_step_fn`` go through :func:`train_step`: a spy counts the calls."""
    calls = {"n": 0}
    real = step_mod.train_step

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "train_step", spy)
    train(replace(TINY, recipe="fp32"), tmp_path / "run", progress=False)
    assert calls["n"] == TINY.steps

    from rich.console import Console

    from lowprec.jobs.demo import run_demo

    calls["n"] = 0
    run_demo(
        tmp_path / "demo",
        recipes=["fp32"],
        progress=False,
        console=Console(file=io.StringIO()),
        config=TINY,
    )
    assert calls["n"] == TINY.steps

    sys.path.insert(0, str(BENCH))
    try:
        import _common
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(step_mod, "train_step", spy)
    calls["n"] = 0
    m = _Lin()
    x = torch.ones(2)
    _common.lm_step_fn(m, torch.optim.SGD(m.parameters(), lr=0.5), [(x, x)])()
    assert calls["n"] == 1 and m.a.tolist() == [0.5, 0.5]


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, ((out.float() - y) ** 2).mean()


def test_skipped_step_is_no_static_calibration_batch() -> None:
    """fp8-static calibrates on its first 4 training batches. A non-finite batch among them
    (skipped with ``skip_nonfinite``) must not count as one nor enter the running maxima:
    the run with the bad batch inserted (at the 1st and at the 4th calibration batch)
    ends bit-identical to the run without it — the same frozen scales and weights."""
    from lowprec.recipes import prepare

    gen = torch.Generator().manual_seed(0)
    # growing magnitudes: every calibration batch raises the maxima, so each one counts
    batches = [
        (2.0**i * torch.randn(8, 32, generator=gen), torch.randn(8, 16, generator=gen))
        for i in range(6)
    ]
    bad = (torch.full((8, 32), float("nan")), torch.zeros(8, 16))

    def run(bad_at: int | None) -> tuple[Any, list[bool]]:
        torch.manual_seed(1)
        p = prepare(_Mlp(), "fp8-static", lambda ps: torch.optim.SGD(ps, lr=0.1))
        seq = list(batches)
        if bad_at is not None:
            seq.insert(bad_at, bad)
        skipped = [train_step(p, x, y, skip_nonfinite=True).skipped for x, y in seq]
        return p, skipped

    ref, ref_skipped = run(None)
    assert not any(ref_skipped) and not ref.calibrating
    for bad_at in (0, 3):
        p, skipped = run(bad_at)
        assert skipped == [i == bad_at for i in range(len(batches) + 1)]
        assert not p.calibrating
        theirs = p.model.state_dict()
        for name, a in ref.model.state_dict().items():
            assert torch.equal(a, theirs[name]), (bad_at, name)  # static maxima, histories, weights
        for m, n in zip(ref.model.modules(), p.model.modules(), strict=True):
            for r in ("input", "grad_output"):
                s, t = getattr(m, "scaler", lambda _: None)(r), getattr(n, "scaler", None)
                if s is not None and t is not None:
                    assert torch.equal(s.scale, t(r).scale), (bad_at, r)
