"""Fuzz: the entry points added after the first fuzz suite — ``Float8Conv1D`` (HF's
``Conv1D`` layout), :class:`lowprec.RunRecorder` (your own loop -> a run directory),
``unit_scale(reinit=...)`` and :mod:`lowprec.distributed` outside a process group.

Each call returns a correct result (``Float8Conv1D`` against ``x @ W + b`` in float64 within
FP8's rounding; the recorder's record against the logged values) or raises
``ValueError``/``TypeError`` naming the argument at fault.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import lowprec
from lowprec import distributed, float8
from lowprec.float8.conv1d import Float8Conv1D
from lowprec.unit import unit_scale
from tests.fuzz._support import (
    FUZZ,
    SPECIAL,
    Refused,
    attempt,
    f64,
    finite,
    mostly,
    names_st,
    tensors,
    values,
)


class Conv1D(nn.Module):
    """HF's ``Conv1D`` layout (transformers is not imported): ``y = x @ W + b``, ``W`` of
    shape ``(nx, nf)``."""

    def __init__(self, nf: int, nx: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf, dtype=dtype) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf, dtype=dtype) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


@FUZZ
@given(
    recipe=mostly(st.sampled_from(float8.recipe_names()), names_st()),
    x=tensors(shape=(3, 32), lo=1e-3, hi=1e3),
    nf=st.sampled_from([16, 32, 48]),
    wdtype=mostly(st.sampled_from([torch.float32, torch.bfloat16]), st.just(torch.int32)),
)
def test_float8_conv1d(recipe: Any, x: torch.Tensor, nf: int, wdtype: torch.dtype) -> None:
    """``Float8Conv1D(x) ≈ x @ W + b`` within FP8's rounding (the elementwise bound of
    test_techniques' Float8Linear test: ``2^-2 · |x|·|W|`` plus a scaled underflow term), its
    ``weight`` the Conv1D's own parameter in the ``(nx, nf)`` layout; or a named refusal."""
    torch.manual_seed(0)
    if wdtype == torch.int32:
        mod: nn.Module = Conv1D(nf, 32)
        mod.weight = nn.Parameter(torch.ones(32, nf, dtype=torch.int32), requires_grad=False)
    else:
        mod = Conv1D(nf, 32, wdtype)
    m = attempt(
        "float8.Float8Conv1D.from_conv1d",
        Float8Conv1D.from_conv1d,
        mod,
        recipe,
        names=("recipe", "name", "mod"),
    )
    if isinstance(m, Refused):
        return
    assert m.weight is mod.weight and tuple(m.weight.shape) == (32, nf)
    y = attempt("Float8Conv1D.forward", m, x, names=("x", "input", "dtype", "calibrat"))
    if isinstance(y, Refused) or not finite(x):
        return
    assert y.shape == (3, nf)
    w, b = f64(mod.weight), f64(mod.bias)
    ref = f64(x) @ w + b
    bound = (
        0.25 * (f64(x).abs() @ w.abs())
        + 1e-2 * float(f64(x).abs().max()) * float(w.abs().max()) * 32
    )
    assert bool(((f64(y) - ref).abs() <= bound + 1e-2).all()), "Float8Conv1D error too large"


def test_float8_conv1d_refuses_other_modules() -> None:
    """Not a Conv1D (an nn.Linear, a Conv1D with the wrong weight layout): TypeError naming
    ``mod``."""
    for bad in (nn.Linear(4, 4), Conv1D(4, 8)):
        if isinstance(bad, Conv1D):
            bad.weight = nn.Parameter(torch.zeros(4, 8))  # (nf, nx): the wrong layout
        r = attempt(
            "float8.Float8Conv1D.from_conv1d", Float8Conv1D.from_conv1d, bad, names=("mod",)
        )
        assert isinstance(r, Refused) and isinstance(r.exc, TypeError)


LOSSES = st.one_of(
    values(special=True, lo=1e-30, hi=1e30),
    st.sampled_from(SPECIAL),
    tensors(dtypes=[torch.float32, torch.float16, torch.int64, torch.bool], special=True),
    names_st(),
)


@FUZZ
@given(
    steps=mostly(st.one_of(st.none(), st.integers(1, 5)), names_st()),
    every=mostly(st.one_of(st.none(), st.integers(1, 3)), names_st()),
    recipe=mostly(st.sampled_from([None, "fp32", "fp16-dynamic-ls"]), names_st()),
    log_steps=st.lists(mostly(st.integers(1, 6), names_st()), min_size=1, max_size=3),
    loss=LOSSES,
    metric=mostly(st.one_of(values(), st.booleans(), st.text(max_size=4)), names_st()),
)
def test_run_recorder(
    steps: Any, every: Any, recipe: Any, log_steps: list[Any], loss: Any, metric: Any
) -> None:
    """RunRecorder from a user's loop: every accepted ``log`` is the record written to
    ``metrics.jsonl`` (the loss as given, NaN/Inf kept as the run's history), steps strictly
    increase; anything else is a named refusal. The directory stays readable by the
    report's loader."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        rec = attempt(
            "RunRecorder",
            lowprec.RunRecorder,
            out,
            model,
            recipe=recipe,
            steps=steps,
            numerics_every=every,
            names=("recipe", "steps", "numerics_every", "unknown", "name"),
        )
        if isinstance(rec, Refused):
            assert not out.exists() or not any(out.iterdir())  # nothing half-written
            return
        logged: list[dict[str, Any]] = []
        with rec:
            for step in log_steps:
                model(torch.ones(3, 4)).sum().backward()
                r = attempt(
                    "RunRecorder.log",
                    rec.log,
                    step,
                    loss=loss,
                    extra=metric,
                    names=("step", "loss", "extra", "metrics"),
                )
                if isinstance(r, Refused):
                    continue
                assert r["step"] == step and (not logged or step > logged[-1]["step"])
                want = float(loss.item() if isinstance(loss, torch.Tensor) else loss)
                assert r["loss"] == want or (math.isnan(r["loss"]) and math.isnan(want))
                logged.append(r)
        lines = (out / "metrics.jsonl").read_text().splitlines() if logged else []
        assert [json.loads(line)["step"] for line in lines] == [r["step"] for r in logged]
        if logged:
            from lowprec.jobs.report import load_run

            run = load_run(out)
            assert [r["step"] for r in run.metrics] == [r["step"] for r in logged]


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h + self.fc(h))


@FUZZ
@given(
    reinit=mostly(st.booleans(), names_st()),
    tau=mostly(st.floats(0.05, 0.95), st.one_of(st.sampled_from(SPECIAL), names_st())),
    readout=mostly(st.sampled_from(["auto", None, "head"]), names_st()),
    residual=mostly(st.sampled_from(["running-mean", "fixed"]), names_st()),
)
def test_unit_scale_arguments(reinit: Any, tau: Any, readout: Any, residual: Any) -> None:
    """``unit_scale`` with drawn arguments: a unit-scaled copy whose forward is finite and
    leaves the given model unchanged, or a refusal naming the bad argument (``reinit``
    must be a bool: ``True``, the default, re-initialises, ``False`` keeps the weights)."""
    torch.manual_seed(0)
    model = _Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    u = attempt(
        "unit.unit_scale",
        unit_scale,
        model,
        reinit=reinit,
        tau=tau,
        readout=readout,
        residual=residual,
        names=("reinit", "tau", "readout", "residual"),
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"unit_scale changed the given model's {k}"
    if isinstance(u, Refused):
        return
    assert isinstance(reinit, bool)  # anything else is refused, naming reinit
    y = u(torch.randint(0, 16, (2, 5)))
    assert y.shape == (2, 5, 16) and finite(y)


@FUZZ
@given(
    parallel=mostly(st.sampled_from(["fsdp", "ddp"]), names_st()),
    recipe=mostly(st.sampled_from(["fp32", "bf16", "fp8-tensorwise"]), names_st()),
)
def test_distributed_prepare_without_process_group(parallel: Any, recipe: Any) -> None:
    """``lowprec.distributed.prepare`` outside ``torchrun``: a bad ``parallel`` is a
    ValueError/TypeError naming it; a good one is refused with a ``RuntimeError`` that says
    to start with torchrun (a missing process group is the program's state, not a bad
    argument) — never an obscure error from inside torch.distributed."""
    assert not torch.distributed.is_initialized()
    try:
        r = attempt(
            "distributed.prepare",
            distributed.prepare,
            nn.Linear(16, 16),
            recipe,
            parallel,
            names=("parallel",),
        )
    except RuntimeError as e:
        assert parallel in ("fsdp", "ddp") and "torchrun" in str(e), e
        return
    assert isinstance(r, Refused) and parallel not in ("fsdp", "ddp")
