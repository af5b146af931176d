"""Issue 15 item 6: ``RunRecorder`` records a run directory from a hand-written loop, and
``lowprec report`` reads it.

Oracles: the values the loop itself computed (loss, the scaler's history, the share of
zero gradient values counted by hand before the update), read back from the files; the
report's page for the tracked steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lowprec import RunRecorder, prepare
from lowprec.cli.main import main
from lowprec.jobs.rundir import CONFIG, NUMERICS, SUMMARY, RunError, read_metrics, read_run

STEPS = 6


def _loop(out: Path, todo: range, **kw: Any) -> list[dict[str, Any]]:
    """A hand-written loop (torch's idioms on a prepared model); the values it saw."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    p = prepare(model, "fp16-dynamic-ls", lambda ps: torch.optim.SGD(ps, lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(p.optimizer, lambda t: 1.0 / (1 + t))
    seen = []
    with RunRecorder(
        out, p.model, recipe=p.recipe, config={"lr": 0.1}, scaler=p.scaler, **kw
    ) as rec:
        for step in todo:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            with p.compute():
                loss = (p.model(x.half()).float() - y).square().mean()
            p.scaler.scale(loss).backward()
            grads = [q.grad for q in p.model.parameters() if q.grad is not None]
            zeros = sum(int((gr == 0).sum()) for gr in grads) / sum(gr.numel() for gr in grads)
            p.scaler.unscale_(p.optimizer)
            torch.nn.utils.clip_grad_norm_(p.model.parameters(), 1.0)
            p.scaler.step(p.optimizer)
            p.scaler.update()
            p.optimizer.zero_grad()
            sched.step()
            extra = {"val_loss": float(loss.detach()) + 0.5} if step == STEPS - 1 else {}
            r = rec.log(step + 1, loss=loss, lr=sched.get_last_lr()[0], **extra)
            seen.append(
                {
                    "rec": r,
                    "loss": float(loss.detach()),
                    "zeros": zeros,
                    "scale": p.scaler.history[-1],
                }
            )
    return seen


@pytest.mark.slow
def test_own_loop_writes_a_run_dir_that_lowprec_report_reads(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    seen = _loop(out, range(STEPS), steps=STEPS)
    metrics = read_metrics(out)
    assert metrics == [s["rec"] for s in seen], "the records round-trip through the file"
    for r, s in zip(metrics, seen, strict=True):
        assert r["loss"] == s["loss"]
        assert r["loss_scale"] == s["scale"].scale and r["skipped"] == s["scale"].skipped
        assert r["grad_zero_share"] == pytest.approx(s["zeros"], abs=1e-12)
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    config, _, numerics = read_run(out)
    assert config["train"] == {"lr": 0.1, "recipe": "fp16-dynamic-ls", "steps": STEPS}
    assert config["recipe"]["name"] == "fp16-dynamic-ls"
    assert sorted({r["step"] for r in numerics}) == [0, STEPS - 1], "first and last step"
    kinds = {(r["name"], r["kind"]) for r in numerics if r["step"] == STEPS - 1}
    assert {("0", "input"), ("2", "grad_output"), ("0.weight", "weight_grad")} <= kinds
    assert all(r["dtype"] in ("float16", "float32") for r in numerics)
    assert json.loads((out / SUMMARY).read_text())["steps"] == STEPS
    page = tmp_path / "report.html"
    assert main(["report", str(out), "-o", str(page)]) == 0
    text = page.read_text()
    assert "fp16-dynamic-ls" in text and f"Tensor scales at the end (step {STEPS - 1})" in text


def test_refuses_existing_dir_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    m = nn.Linear(2, 1)
    with RunRecorder(out, m, numerics_every=None) as rec:
        for k in range(1, 5):
            rec.log(k, loss=1.0 / k, step_time=0.25)
    with pytest.raises(RunError, match="already exists"):
        RunRecorder(out, m)
    with pytest.raises(ValueError, match="resume_from"):
        RunRecorder(out, m, resume=True, resume_from=7)
    # restart from the checkpoint of step 2: steps 3 and 4 are dropped, then logged again
    with RunRecorder(out, m, resume=True, resume_from=2, numerics_every=None) as rec:
        with pytest.raises(ValueError, match="steps must increase"):
            rec.log(2, loss=0.0)
        rec.log(loss=0.125)  # step 3
    assert [(r["step"], r["loss"]) for r in read_metrics(out)] == [(1, 1.0), (2, 0.5), (3, 0.125)]
    assert read_metrics(out)[0]["step_time"] == 0.25
    assert json.loads((out / CONFIG).read_text())["train"]["recipe"] == "custom"


def test_exception_closes_cleanly(tmp_path: Path) -> None:
    """An exception in the loop: the hooks are removed, the records written stay, no
    summary is written, and the exception propagates."""
    out = tmp_path / "run"
    m = nn.Linear(3, 1)
    with pytest.raises(KeyError), RunRecorder(out, m, numerics_every=1) as rec:
        m(torch.randn(2, 3)).sum().backward()
        rec.log(1, loss=torch.tensor(2.0))
        m(torch.randn(2, 3)).sum().backward()
        raise KeyError("boom")
    assert not m._forward_pre_hooks and not m._forward_hooks
    assert not (out / SUMMARY).exists()
    assert [r["loss"] for r in read_metrics(out)] == [2.0]
    steps = {json.loads(line)["step"] for line in (out / NUMERICS).read_text().splitlines()}
    assert steps == {0, 1}, "the numerics of the interrupted step are written at close"
    with pytest.raises(RuntimeError, match="closed"):
        rec.log(2, loss=1.0)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"loss": 1.0, "lr": [1]}, TypeError, "lr"),
        ({"loss": "x"}, TypeError, "loss"),
        ({"loss": torch.ones(2)}, ValueError, "loss"),
        ({"loss": 1.0, "step_time": "fast"}, TypeError, "step_time"),
    ],
)
def test_bad_values_are_refused(
    tmp_path: Path, kwargs: dict[str, Any], err: type[Exception], match: str
) -> None:
    with RunRecorder(tmp_path / "r", nn.Linear(1, 1)) as rec, pytest.raises(err, match=match):
        rec.log(1, **kwargs)
    with pytest.raises(TypeError, match="config"):
        RunRecorder(tmp_path / "c", nn.Linear(1, 1), config={"f": object()})
    assert not (tmp_path / "c").exists(), "a refused config writes nothing"
