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
from lowprec.jobs.rundir import (
    CONFIG,
    NUMERICS,
    SUMMARY,
    RunError,
    RunNote,
    read_metrics,
    read_run,
)

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


def test_a_resume_records_its_steps_and_extra_entries(tmp_path: Path) -> None:
    """A resume with another ``steps`` (a run extended) or other ``extra`` entries (a
    ``--parallel`` run resumed on another process count) records them in ``config.json``;
    the ``train`` settings and the recipe stay the run's. The same values rewrite nothing."""
    out = tmp_path / "run"
    m = nn.Linear(2, 1)
    extra = {"parallel": {"mode": "ddp", "world_size": 2}}
    with RunRecorder(out, m, config={"lr": 0.5}, steps=4, extra=extra, numerics_every=None) as rec:
        for k in range(1, 5):
            rec.log(k, loss=1.0)
    wider = {"parallel": {"mode": "ddp", "world_size": 4}}
    with RunRecorder(out, m, steps=6, extra=wider, resume=True, resume_from=4) as rec:
        rec.log(loss=0.5)
    saved = json.loads((out / CONFIG).read_text())
    assert saved["train"] == {"lr": 0.5, "recipe": "custom", "steps": 6}
    assert saved["parallel"] == {"mode": "ddp", "world_size": 4}
    mtime = (out / CONFIG).stat().st_mtime_ns
    RunRecorder(out, m, steps=6, extra=wider, resume=True, resume_from=5).close(summary=False)
    RunRecorder(out, m, resume=True, resume_from=5).close(summary=False)  # no steps: kept
    assert (out / CONFIG).stat().st_mtime_ns == mtime
    assert json.loads((out / CONFIG).read_text()) == saved


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


# ---- issue 29, item 6: one writer, one counting --------------------------------------------


def test_gradient_shares_are_grad_stats_of_the_update(tmp_path: Path) -> None:
    """The recorder's hooks count as lowprec.amp.grad_stats does (analysis.stats): equal
    to grad_stats of the gradients the optimizer used, NaN gradients included."""
    from lowprec.amp import grad_stats

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen = []
    with RunRecorder(tmp_path / "r", m, numerics_every=None) as rec:
        for k in range(3):
            x = torch.randn(8, 6)
            x[:, 5] = 0  # zero gradients: column 5 of the first weight
            if k == 1:
                x[0, 0] = float("nan")  # NaN into some gradients
            m(x).square().mean().backward()
            seen.append(grad_stats(m.parameters()))
            opt.step()
            opt.zero_grad()
            rec.log(k + 1, loss=1.0)
    recs = read_metrics(tmp_path / "r")
    for r, s in zip(recs, seen, strict=True):
        assert r["grad_zero_share"] == s["grad_zero_share"]
        assert r["grad_nonfinite_share"] == s["grad_nonfinite_share"]
    assert recs[0]["grad_zero_share"] >= 16 / 146 and recs[0]["grad_nonfinite_share"] == 0
    assert recs[1]["grad_nonfinite_share"] > 0, "the NaN step is counted"
    assert json.loads((tmp_path / "r" / SUMMARY).read_text())["grad_zero_share"] > 0


def test_count_grads_off_writer_off_and_extra(tmp_path: Path) -> None:
    m = nn.Linear(2, 1)
    with RunRecorder(tmp_path / "a", m, count_grads=False, extra={"model": {"w": 2}}) as rec:
        m(torch.ones(1, 2)).sum().backward()
        with pytest.raises(ValueError, match="grad_zero_share: with count_grads=False"):
            rec.log(1, loss=1.0)
        r = rec.log(1, loss=1.0, grad_zero_share=0.5)
    assert r["grad_zero_share"] == 0.5 and "grad_nonfinite_share" not in r
    assert not m._forward_pre_hooks and not any(
        p._post_accumulate_grad_hooks for p in m.parameters()
    )
    assert json.loads((tmp_path / "a" / CONFIG).read_text())["model"] == {"w": 2}
    with pytest.raises(ValueError, match="extra: 'train' is an entry the recorder writes"):
        RunRecorder(tmp_path / "b", m, extra={"train": {}})
    # writer=False: measures, writes and reads nothing (the other ranks of a process group)
    with RunRecorder(tmp_path / "c", m, writer=False, resume=True, resume_from=4) as rec:
        r = rec.log(loss=2.0)
        assert r["step"] == 5 and rec.records() == [] and rec.write_summary() == {}
    assert not (tmp_path / "c").exists()


def test_a_refused_resume_from_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    m = nn.Linear(2, 1)
    with RunRecorder(out, m, numerics_every=1) as rec:
        for k in (2, 4, 6):
            m(torch.ones(1, 2)).sum().backward()
            rec.log(k, loss=float(k))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RunError, match=r"resume_from: step 5 is not recorded in .*metrics\.jsonl"):
        RunRecorder(out, m, resume=True, resume_from=5)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "numerics.jsonl").write_text((out / "numerics.jsonl").read_text() + '{"step": 9')
    with pytest.warns(RunNote, match="torn last line"):
        RunRecorder(out, m, resume=True, resume_from=4, numerics_every=1).close()
    assert [r["step"] for r in read_metrics(out)] == [2, 4]
    steps = [json.loads(line)["step"] for line in (out / NUMERICS).read_text().splitlines()]
    assert sorted(set(steps)) == [0, 2], "numerics of the step indices below 4 stay"
    assert json.loads((out / SUMMARY).read_text())["steps"] == 4


def test_lowprec_train_writes_through_the_recorder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every record of lowprec train goes through RunRecorder.log, the summary through
    write_summary, the config through its constructor; the training module itself holds
    no writer of records."""
    import lowprec.jobs.train as train_mod
    from lowprec.jobs.recorder import RunRecorder as Real
    from tests._helpers import TINY

    calls: list[str] = []

    class Spy(Real):
        def log(self, step: int | None = None, **kw: Any) -> dict[str, Any]:
            calls.append("log")
            return super().log(step, **kw)

        def write_summary(self) -> dict[str, Any]:
            calls.append("summary")
            return super().write_summary()

    monkeypatch.setattr(train_mod, "RunRecorder", Spy)
    from dataclasses import replace

    summary = train_mod.train(replace(TINY, steps=3), tmp_path / "r", progress=False)
    assert calls == ["log", "log", "log", "summary"]
    assert json.loads((tmp_path / "r" / SUMMARY).read_text()) == summary
    config = json.loads((tmp_path / "r" / CONFIG).read_text())
    assert config["recorder"] is True and config["train"]["steps"] == 3
    assert set(config) == {"train", "recipe", "torch", "recorder", "model", "parallel"}
    for name in ("append_jsonl", "write_atomic", "json", "Tracker"):
        assert not hasattr(train_mod, name), name
