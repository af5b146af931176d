"""Tests for the training job: metrics, checkpoints, bit-exact resume, bad input, CLI."""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import lowprec.jobs.train as train_mod
from lowprec.cli import main
from lowprec.jobs import checkpoints
from lowprec.jobs.train import (
    Interrupted,
    NonFiniteError,
    RunError,
    read_metrics,
    train,
)
from lowprec.recipes import get_recipe
from tests._helpers import TINY


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out)]


def _model_state(out: Path) -> dict[str, torch.Tensor]:
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    model: dict[str, torch.Tensor] = state["run"]["model"]
    return model


@pytest.mark.parametrize(
    "recipe",
    ["fp32", "bf16", "fp16-dynamic-ls", "amp-bf16", "fp8-delayed", "fp8-static", "fp16-scalify",
     "bf16-unit", "fp8-lean"],
)  # fmt: skip
def test_resume_is_bit_exact(tmp_path: Path, recipe: str, caplog: pytest.LogCaptureFixture) -> None:
    """N steps straight == N/2 steps, stop, resume, N/2 steps: identical losses and weights.
    Then a kill after two steps past a checkpoint (the checkpoint of step 4 put back after
    steps 5 and 6 were logged): the resumed run redoes them, and its restored state and its
    redone steps equal what was saved and logged (no warning, no ``resume_mismatch``)."""
    cfg = replace(TINY, recipe=recipe)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(cfg, straight, progress=False)
    assert train(cfg, split, progress=False, stop_after=4) == {"stopped_at": 4}
    assert len(read_metrics(split)) == 4
    ck4 = (split / "checkpoint.pt").read_bytes()
    caplog.set_level("WARNING", logger="lowprec.jobs")
    train(cfg, split, resume=True, progress=False, stop_after=6)
    (split / "checkpoint.pt").write_bytes(ck4)  # killed after step 6, before its checkpoint
    train(cfg, split, resume=True, progress=False)
    assert not [r for r in caplog.records if r.name.startswith("lowprec.jobs")], caplog.text
    recs = read_metrics(split)
    assert not any("resume_mismatch" in r for r in recs)
    assert _losses(straight) == _losses(split)
    assert [r.get("val_loss") for r in read_metrics(straight)] == [r.get("val_loss") for r in recs]
    a, b = _model_state(straight), _model_state(split)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_redone_step_that_differs_is_marked_and_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a kill past the checkpoint (steps 5 and 6 logged, checkpoint of step 4), the
    resumed run compares each redone step with the interrupted process's record: a record
    that differs (here: step 5's loss edited by one unit in the last place, as a machine
    that computes the same step differently would log it) marks that step
    ``resume_mismatch`` with the earlier loss, and warns once; step 6, equal, is not
    marked. A restored state that differs from the saved fingerprint warns too."""
    from lowprec.core.warn import reset_warnings

    reset_warnings("train:")
    out = tmp_path / "r"
    cfg = replace(TINY, recipe="fp16-dynamic-ls")
    train(cfg, out, progress=False, stop_after=4)
    ck4 = torch.load(out / "checkpoint.pt", weights_only=True)
    train(cfg, out, resume=True, progress=False, stop_after=6)
    recs = read_metrics(out)
    before = recs[4]["loss"]
    recs[4]["loss"] = math.nextafter(before, math.inf)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    key = next(k for k in ck4["fingerprint"] if k.startswith("optimizer."))
    ck4["fingerprint"][key] = "0" * 32  # a saved entry the restored state will not match
    torch.save(ck4, out / "checkpoint.pt")
    caplog.set_level("WARNING", logger="lowprec.jobs")
    train(cfg, out, resume=True, progress=False)
    recs = read_metrics(out)
    assert recs[4]["resume_mismatch"] is True
    assert recs[4]["resume_loss_before"] == math.nextafter(before, math.inf)
    assert recs[4]["loss"] == before  # the step itself is computed as before
    assert not any("resume_mismatch" in r for r in recs[:4] + recs[5:])
    text = caplog.text
    assert "step 5, redone from the checkpoint" in text
    assert f"the restored state differs from the checkpoint's in 1 entries (first: {key})" in text


def test_an_extension_after_a_kill_is_no_resume_mismatch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed past its checkpoint (steps 5, 6 logged, checkpoint of step 4), then resumed
    with more --steps: the redone steps 5 and 6 run the new cosine schedule (another
    learning rate), so their losses differ from the logged ones by design. They were
    marked resume_mismatch and warned "not bit-exact" (trial C)."""
    from lowprec.core.warn import reset_warnings

    reset_warnings("train:")
    out = tmp_path / "r"
    cfg = replace(TINY, recipe="bf16")
    train(cfg, out, progress=False, stop_after=4)
    ck4 = (out / "checkpoint.pt").read_bytes()
    train(cfg, out, resume=True, progress=False, stop_after=6)
    old = {r["step"]: r for r in read_metrics(out)}
    (out / "checkpoint.pt").write_bytes(ck4)  # killed after step 6, before its checkpoint
    caplog.set_level("WARNING", logger="lowprec.jobs")
    longer = replace(cfg, steps=cfg.steps + 4)
    train(longer, out, resume=True, progress=False)
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(1, longer.steps + 1))
    # step 5's loss is the checkpoint's weights' (equal); its update, at the new rate, is not
    assert recs[4]["lr"] != old[5]["lr"] and recs[5]["loss"] != old[6]["loss"]
    assert not any("resume_mismatch" in r for r in recs), recs[4]
    assert "redone from the checkpoint" not in caplog.text


def test_a_second_process_cannot_train_a_run_that_is_training(tmp_path: Path) -> None:
    """A --resume started while the run still trains was accepted: both processes appended
    to metrics.jsonl (steps duplicated and out of order, a wrong summary, and a run that no
    later --resume could continue; trial C). The run's lock refuses it before anything is
    read or written; a lock left by a killed process is no lock (the system drops it)."""
    import subprocess
    import sys

    from lowprec.jobs.rundir import LOCK, RunError, RunLock

    out = tmp_path / "r"
    train(TINY, out, progress=False, stop_after=2)
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    holder = subprocess.Popen(  # another process holding the run, as a training one does
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from lowprec.jobs.rundir import RunLock; RunLock(Path(sys.argv[1])).acquire(); "
         "print('held', flush=True); time.sleep(60)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(
            RunError, match=rf"being trained by another process \(pid {holder.pid}\)"
        ):
            train(TINY, out, resume=True, progress=False)
        after = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
        assert {k: v for k, v in after.items() if k != LOCK} == {
            k: v for k, v in before.items() if k != LOCK
        }
    finally:
        holder.kill()
        holder.wait()
    train(TINY, out, resume=True, progress=False)  # the killed holder's lock is gone
    assert [r["step"] for r in read_metrics(out)] == list(range(1, TINY.steps + 1))
    with RunLock(out) as lock:  # released at the end of the run: free again
        assert lock.held


def test_fingerprint_names_the_entries_that_differ() -> None:
    a = {"m": {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2)}, "lr": 0.1,
         "g": [torch.tensor(1, dtype=torch.int64)], "e": torch.empty(0)}  # fmt: skip
    fa = checkpoints.fingerprint(a)
    assert list(fa) == ["m.w", "m.b", "lr", "g.0", "e"]
    assert checkpoints.unrestored(fa, checkpoints.fingerprint(a)) == []
    b = {**a, "m": {"w": a["m"]["w"].clone(), "b": torch.zeros(2, dtype=torch.float64)}}
    b["m"]["w"][1] = torch.tensor(1.0078125, dtype=torch.bfloat16)  # one ulp above 1
    assert checkpoints.unrestored(fa, checkpoints.fingerprint(b)) == ["m.w", "m.b"]
    assert checkpoints.unrestored(fa, checkpoints.fingerprint({**a, "lr": 0.2})) == ["lr"]
    assert checkpoints.unrestored(fa, checkpoints.fingerprint({**a, "x": 1})) == ["x"]
    c = {**a, "e": torch.empty(0, 1)}  # same bytes (none), another shape
    assert checkpoints.unrestored(fa, checkpoints.fingerprint(c)) == ["e"]


def test_ctrl_c_takes_effect_at_the_step_boundary_and_resume_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real SIGINT raised in the middle of step 6 (after its update, before its metrics
    line) lets step 6 finish: its metrics row is logged, the checkpoint is at step 6, and
    the resumed run logs every step once with the losses of an uninterrupted run."""
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(TINY, straight, progress=False)
    real = train_mod._train_step
    calls = {"n": 0}

    def interrupt_in_6(*args: object) -> dict[str, object]:
        calls["n"] += 1
        rec = real(*args)  # type: ignore[arg-type]
        if calls["n"] == 6:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only sets a flag
        return rec

    monkeypatch.setattr(train_mod, "_train_step", interrupt_in_6)
    with pytest.raises(Interrupted) as e:
        train(TINY, cut, progress=False)
    assert (e.value.step, e.value.signum) == (6, signal.SIGINT)
    monkeypatch.setattr(train_mod, "_train_step", real)
    assert torch.load(cut / "checkpoint.pt", weights_only=True)["step"] == 6
    assert [r["step"] for r in read_metrics(cut)] == [1, 2, 3, 4, 5, 6]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    train(TINY, cut, resume=True, progress=False)
    assert [r["step"] for r in read_metrics(cut)] == list(range(1, 9))
    assert _losses(straight) == _losses(cut)
    assert [r.get("val_loss") for r in read_metrics(straight)] == [
        r.get("val_loss") for r in read_metrics(cut)
    ]


def test_second_signal_aborts_without_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second SIGINT aborts at once (KeyboardInterrupt, no checkpoint of the half-done
    step); the directory keeps the last periodic checkpoint and resumes exactly."""
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(TINY, straight, progress=False)
    real = train_mod._train_step
    calls = {"n": 0}

    def two_signals_in_5(*args: object) -> dict[str, object]:
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # raises KeyboardInterrupt here
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(train_mod, "_train_step", two_signals_in_5)
    with pytest.raises(KeyboardInterrupt) as e:
        train(TINY, cut, progress=False)
    assert not isinstance(e.value, Interrupted)
    monkeypatch.setattr(train_mod, "_train_step", real)
    assert torch.load(cut / "checkpoint.pt", weights_only=True)["step"] == 4
    train(TINY, cut, resume=True, progress=False)
    assert _losses(straight) == _losses(cut)


def test_metrics_and_summary(tmp_path: Path) -> None:
    summary = train(replace(TINY, recipe="fp16-static-ls"), tmp_path / "r", progress=False)
    recs = read_metrics(tmp_path / "r")
    assert [r["step"] for r in recs] == list(range(1, 9))
    for key in (
        "loss",
        "loss_scale",
        "skipped",
        "grad_norm",
        "grad_zero_share",
        "grad_nonfinite_share",
        "act_grad_underflow",
        "act_grad_zero",
        "step_time",
        "lr",
    ):
        assert key in recs[0], key
    assert [r["step"] for r in recs if "val_loss" in r] == [4, 8]
    assert recs[0]["loss_scale"] == 2.0**12
    assert 0.0 <= recs[0]["act_grad_underflow"] <= 1.0
    assert summary["steps"] == 8 and summary["val_bpc"] == pytest.approx(
        summary["val_loss"] / 0.6931471805599453
    )
    # Warm-up then cosine decay to lr/10 at the last step.
    assert recs[0]["lr"] == pytest.approx(1.5e-3) and recs[-1]["lr"] == pytest.approx(3e-4)
    assert json.loads((tmp_path / "r" / "summary.json").read_text()) == summary


def test_existing_directory_is_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(RunError, match="already exists"):
        train(TINY, out, progress=False)
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_resume_errors(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="not a run directory"):
        train(TINY, tmp_path / "nothing", resume=True, progress=False)
    out = tmp_path / "run"
    train(TINY, out, progress=False, stop_after=2)
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RunError, match="corrupt"):
        train(TINY, out, resume=True, progress=False)
    with pytest.raises(
        RunError, match=r"different configuration \(lr 0\.003 in the run, 0\.001 now\); only"
    ):
        train(replace(TINY, lr=1e-3), out, resume=True, progress=False)
    with pytest.raises(RunError, match=r"\(recipe fp32 in the run, bf16 now; seed 0 in the run"):
        train(replace(TINY, recipe="bf16", seed=1), out, resume=True, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"recipe": "fp17"}, "unknown name 'fp17'; valid: fp32, bf16"),
        ({"steps": 0}, "steps must be a positive int"),
        ({"batch_size": -1}, "batch_size must be a positive int"),
        ({"width": 30, "heads": 4}, "divisible by heads"),
        ({"lr": 0.0}, "lr must be a positive"),
    ],
)
def test_bad_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replace(TINY, **kwargs)  # type: ignore[arg-type]


def test_cli_train_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    args = [
        "train",
        "--recipe",
        "bf16",
        "--steps",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--width",
        "32",
        "--depth",
        "1",
        "--heads",
        "2",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(args) == 0
    assert "val bpc" in capsys.readouterr().out
    assert (out / "checkpoint.pt").is_file() and (out / "summary.json").is_file()
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert "already exists" in capsys.readouterr().err
    for bad, msg in (
        (["--recipe", "nope"], "valid: fp32"),
        (["--steps", "0"], "--steps"),
        (["--batch-size", "x"], "--batch-size"),
        (["--resume"], "--resume needs --out"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["train", *bad])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def test_grad_meter_counts_stored_payload_of_scaled_gradients() -> None:
    """Underflow is judged in the dtype the gradient is stored in. A plain FP16 gradient of
    magnitude 2^-20 (an FP16 subnormal: below the smallest normal, 2^-14) counts; the same
    values as a scalify ScaledTensor (FP16 payload 1.0, scale 2^-20) are stored exactly and
    do not. Zeros count as zeros either way."""
    from lowprec.core.tensor import ScaledTensor

    meter = train_mod.GradMeter(torch.nn.Identity())
    vals = torch.tensor([2.0**-20, -(2.0**-20), 0.0, 2.0**-20])
    meter._on_grad(vals.to(torch.float16))
    assert meter.result() == {"act_grad_underflow": 1.0, "act_grad_zero": 0.25}
    meter.reset()
    payload = torch.tensor([1.0, -1.0, 0.0, 1.0], dtype=torch.float16)
    meter._on_grad(ScaledTensor(payload, torch.tensor(2.0**-20)))
    assert meter.result() == {"act_grad_underflow": 0.25, "act_grad_zero": 0.25}


# ---- NaN/Inf during training (issue 14, defect 4) -----------------------------------------


def _nan_at(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """Make the loss (hence every gradient) NaN at the given 0-based steps of later runs,
    through a forward hook on the model for that step only."""
    real = train_mod.train_step
    seen = {"step": 0}

    def step(run: Any, x: torch.Tensor, y: torch.Tensor, lr: float, **kw: Any) -> Any:
        i = round(seen["step"])
        seen["step"] += 1
        if i not in steps:
            return real(run, x, y, lr, **kw)
        hook = run.model.register_forward_hook(lambda m, a, o: (o[0], o[1] * float("nan")))
        try:
            return real(run, x, y, lr, **kw)
        finally:
            hook.remove()

    monkeypatch.setattr(train_mod, "train_step", step)


def _state(out: Path) -> dict[str, Any]:
    return torch.load(out / "checkpoint.pt", weights_only=True)  # type: ignore[no-any-return]


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def test_nonfinite_stop_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 (no loss scaling), NaN at step 5: the run stops with a message naming the step
    and what was non-finite, the step is logged and marked, the checkpoint of step 4 is
    untouched and finite, summary.json says where it diverged; a resume with skip ends."""
    straight, out = tmp_path / "straight", tmp_path / "nan"
    train(TINY, straight, progress=False, stop_after=4)
    _nan_at(monkeypatch, {4})
    with pytest.raises(NonFiniteError, match=r"step 5: the loss and gradients became NaN/Inf"):
        train(TINY, out, progress=False)
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and recs[-1]["stopped"] == "nonfinite"
    assert recs[-1]["nonfinite"] == "loss and gradients"
    assert json.loads((out / "summary.json").read_text())["diverged_at"] == 5
    a, b = _state(straight), _state(out)
    assert a["step"] == b["step"] == 4
    assert all(
        torch.equal(x, y) for x, y in zip(_tensors(a["run"]), _tensors(b["run"]), strict=True)
    )
    assert all(bool(torch.isfinite(t).all()) for t in _tensors(b["run"]) if t.is_floating_point())
    monkeypatch.undo()
    _nan_at(monkeypatch, {0})  # the resumed run's first step (step 5) is NaN again: skipped
    train(TINY, out, resume=True, progress=False, on_nonfinite="skip")
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert recs[4]["skipped"] and recs[4]["nonfinite"] == "loss and gradients"
    assert "stopped" not in recs[4] and not any(r["skipped"] for r in recs[5:])
    assert json.loads((out / "summary.json").read_text())["diverged_at"] is None


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp16-unit", "fp16-scalify"])
def test_nonfinite_skip_changes_no_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recipe: str
) -> None:
    """A skipped NaN step (step 3) leaves weights, optimizer state and the float8 amax
    histories (model buffers) exactly as after step 2; the next forward works."""
    cfg = replace(TINY, recipe=recipe)
    before, skipped = tmp_path / "before", tmp_path / "skipped"
    train(cfg, before, progress=False, stop_after=2)
    _nan_at(monkeypatch, {2})
    train(cfg, skipped, progress=False, stop_after=3, on_nonfinite="skip")
    a, b = _state(before)["run"], _state(skipped)["run"]
    for key in ("model", "optimizer"):
        ta, tb = _tensors(a[key]), _tensors(b[key])
        assert len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
    assert read_metrics(skipped)[2]["skipped"]
    train(cfg, skipped, resume=True, progress=False)  # later forwards are finite
    assert all(math.isfinite(r["loss"]) for r in read_metrics(skipped)[3:])


def test_too_many_consecutive_skips_stop_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _nan_at(monkeypatch, set(range(2, 100)))
    with pytest.raises(NonFiniteError, match=r"step 5: 3 consecutive steps skipped"):
        train(TINY, tmp_path / "r", progress=False, on_nonfinite="skip", max_skips=3)
    # it diverged at the first of the NaN-loss steps it skipped (3), not where it stopped
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["diverged_at"] == 3


def test_loss_scaled_skip_and_recovery_is_not_divergence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16-dynamic-ls: a NaN step is the scaler's normal skip (the default stop does not
    apply), the run ends; neither summary.json nor the report calls it diverged."""
    from lowprec.jobs.report import diagnose, load_run, write_report

    _nan_at(monkeypatch, {3})
    summary = train(replace(TINY, recipe="fp16-dynamic-ls"), tmp_path / "ls", progress=False)
    assert summary["skipped_steps"] == 1 and summary["diverged_at"] is None
    recs = read_metrics(tmp_path / "ls")
    assert not math.isfinite(recs[3]["loss"]) and recs[4]["loss_scale"] == recs[3]["loss_scale"] / 2
    assert not any("diverged" in n for n in diagnose(load_run(tmp_path / "ls")))
    page = write_report([tmp_path / "ls"], tmp_path / "r.html").read_text()
    assert "the run diverged" not in page


def test_no_checkpoint_of_nonfinite_state(tmp_path: Path) -> None:
    out = tmp_path / "r"
    train(TINY, out, progress=False, stop_after=2)
    before = (out / "checkpoint.pt").read_bytes()
    prepared, _ = train_mod.build(TINY)
    with torch.no_grad():
        next(prepared.model.parameters())[0] = float("inf")
    with pytest.raises(NonFiniteError, match="holds Inf/NaN; no checkpoint written"):
        checkpoints.save(out, prepared, 3)
    assert (out / "checkpoint.pt").read_bytes() == before


def test_overflowing_gradients_with_a_finite_loss_are_not_called_a_nan_loss(
    tmp_path: Path,
) -> None:
    """fp16 with a static loss scale of 1e30: the loss stays finite, every scaled gradient
    overflows, every step is skipped until --max-skips stops the run. The error advises a
    lower loss scale (not loss scaling, which the recipe has), summary.json names the
    gradients, and the report's verdict says so (it read "fails: loss NaN/Inf at step 5").
    """
    from lowprec.jobs.report import diagnose, load_run, summary_verdicts

    base = get_recipe("fp16-static-ls")
    rec = replace(base, name="fp16-ls1e30", policy=replace(base.policy, loss_scale=1e30))
    out = tmp_path / "huge"
    with pytest.raises(NonFiniteError, match=r"step 5: 5 consecutive .*lower the loss scale"):
        train(replace(TINY, recipe=rec), out, progress=False, max_skips=5)
    recs = read_metrics(out)
    assert all(math.isfinite(r["loss"]) and r["skipped"] for r in recs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged_at"] == 5 and summary["diverged_cause"] == "gradients"
    run = load_run(out)
    text = dict(summary_verdicts([run]))[run.name]
    assert text == "fails: gradients NaN/Inf at step 5"
    assert not any("loss became NaN" in n for n in diagnose(run, text))


def test_weights_made_nan_by_an_update_stop_the_run_even_when_skipping(
    tmp_path: Path,
) -> None:
    """fp16-pure (FP16 parameters, no masters, no loss scaling) at a learning rate that
    makes AdamW's first FP16 update NaN: skipped steps cannot recover NaN weights, so the
    run stops at the first NaN loss whatever --on-nonfinite says, naming the weights; the
    summary is written and the report calls the cause the weights (it skipped on until
    the checkpoint failed, wrote no summary, and reported the NaN weights as overflow)."""
    from lowprec.jobs.report import diagnose, load_run, summary_verdicts

    out = tmp_path / "pure"
    cfg = replace(TINY, recipe="fp16-pure", lr=1e4)
    with pytest.raises(NonFiniteError, match=r"holds Inf/NaN after the previous update"):
        train(cfg, out, progress=False, on_nonfinite="skip", max_skips=100)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged_cause"] == "weights"
    run = load_run(out)
    text = dict(summary_verdicts([run]))[run.name]
    assert text.startswith("fails: weights NaN/Inf at step")
    notes = diagnose(run, text)
    assert any("weights became NaN/Inf" in n for n in notes), notes
    assert not any("overflow fp16" in n for n in notes), notes


def test_a_step_that_was_nan_both_times_is_not_a_resume_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redone step whose loss was NaN before and after the resume logs the same step:
    NaN equals NaN here (it was marked resume_mismatch)."""
    out = tmp_path / "r"
    _nan_at(monkeypatch, {3})
    train(replace(TINY, recipe="fp16-dynamic-ls"), out, progress=False, stop_after=5)
    recs = read_metrics(out)
    assert not math.isfinite(recs[3]["loss"])
    # cut back to the checkpoint before the NaN step and redo it, NaN again
    (out / "checkpoint.pt").unlink()
    monkeypatch.undo()
    _nan_at(monkeypatch, {3})
    train(replace(TINY, recipe="fp16-dynamic-ls"), out, resume=True, progress=False)
    assert not any(r.get("resume_mismatch") for r in read_metrics(out))


def test_a_scalify_scale_beyond_float32_is_a_nonfinite_step(tmp_path: Path) -> None:
    """fp16-scalify at lr 1e6: scalify keeps the values in range until a scale itself
    passes float32's max in the backward (ScaleOverflowError, where FP32 arithmetic
    overflows too). The step is a non-finite one (stopped here, naming the gradients;
    skipped with --on-nonfinite skip), not a crash of the run (it was a ValueError)."""
    out = tmp_path / "sc"
    cfg = replace(TINY, recipe="fp16-scalify", lr=1e6)
    with pytest.raises(NonFiniteError, match=r"the (loss and )?gradients became NaN/Inf"):
        train(cfg, out, progress=False)
    assert json.loads((out / "summary.json").read_text())["diverged_at"] is not None
    with pytest.raises(NonFiniteError, match="consecutive steps skipped"):
        train(cfg, out, resume=True, progress=False, on_nonfinite="skip", max_skips=2)
