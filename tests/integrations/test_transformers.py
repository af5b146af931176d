"""lowprec inside HF transformers' Trainer: ``make_trainer`` trains a tiny Llama with a float8,
a unit, a scalify and a loss-scaling recipe, and resumes exactly from a Trainer checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers

from lowprec.amp import MasterWeights
from lowprec.cli import main
from lowprec.integrations.transformers import STATE_NAME, make_trainer
from lowprec.jobs.rundir import read_metrics
from lowprec.recipes import get_recipe
from tests.integrations._tiny import Tokens, tiny_gpt2, tiny_llama

STEPS, CKPT = 6, 3


def _args(out: Path, **kw: Any) -> Any:
    base: dict[str, Any] = {
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "save_steps": CKPT,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
    }
    return transformers.TrainingArguments(str(out), **{**base, **kw})


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# fp8-delayed: amax histories (buffers) must come back; fp16-dynamic-ls: the loss scaler;
# bf16-unit: u-muP groups + FP32 masters; fp16-scalify: a wrapper model; fp8-lean: lean
# 8-bit states and stochastic rounding (a generator); fp8-static: calibration across the cut.
RECIPES = ["fp8-delayed", "fp16-dynamic-ls", "bf16-unit", "fp16-scalify", "fp8-lean", "fp8-static"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_trains_and_resumes_exactly_from_a_trainer_checkpoint(tmp_path: Path, recipe: str) -> None:
    a = make_trainer(tiny_llama(), _args(tmp_path / "a"), recipe=recipe, train_dataset=Tokens())
    a.train()
    ckpt = tmp_path / "a" / f"checkpoint-{CKPT}"
    assert (ckpt / STATE_NAME).is_file() and (ckpt / "scaler.pt").is_file()
    b = make_trainer(tiny_llama(), _args(tmp_path / "b"), recipe=recipe, train_dataset=Tokens())
    b.train(resume_from_checkpoint=str(ckpt))
    la, lb = _losses(a), _losses(b)
    assert len(la) == STEPS and all(math.isfinite(x) for x in la)
    # Exact: the checkpoint holds everything (model, buffers, masters, optimizer and
    # scaler state, generator, data order, RNG), so the resumed steps are bit-identical.
    assert lb == la
    pa, pb = dict(a.lowprec.model.named_parameters()), dict(b.lowprec.model.named_parameters())
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa), "parameters bit-identical"
    ba, bb = dict(a.lowprec.model.named_buffers()), dict(b.lowprec.model.named_buffers())
    assert all(torch.equal(ba[k], bb[k]) for k in ba), "buffers (amax histories) identical"
    assert a.lowprec.scaler.state_dict() == b.lowprec.scaler.state_dict()
    # It trained: the parameters moved from their initial values.
    init = dict(make_trainer(tiny_llama(), _args(tmp_path / "c"), recipe=recipe).lowprec.model
                .named_parameters())  # fmt: skip
    assert any(not torch.equal(init[k], pa[k]) for k in pa)


@pytest.mark.slow
def test_the_recipe_reaches_the_model_and_the_optimizer(tmp_path: Path) -> None:
    t = make_trainer(tiny_llama(), _args(tmp_path), recipe="bf16-unit", train_dataset=Tokens())
    assert type(t.model).__name__.startswith("Unit"), "the unit-scaled copy is trained"
    assert next(t.model.parameters()).dtype == torch.bfloat16
    assert isinstance(t.lowprec.optimizer, MasterWeights)
    mults = {g["lr_mult"] for g in t.lowprec.optimizer.param_groups}
    assert len(mults) > 1, "u-muP groups with their own learning-rate multipliers"
    t.train()
    assert t.optimizer.optimizer is t.lowprec.optimizer, "Accelerate wraps lowprec's optimizer"
    # The logged learning rate is the global one (the scheduler's, not a group's lr_mult times it).
    assert max(h["learning_rate"] for h in t.state.log_history if "learning_rate" in h) <= 1e-3

    f = make_trainer(tiny_llama(), _args(tmp_path / "f"), recipe="fp8-tensorwise",
                     module_filter=lambda m, fqn: "mlp" not in fqn)  # fmt: skip
    kinds = {n: type(m).__name__ for n, m in f.model.named_modules()}
    assert kinds["model.layers.0.self_attn.q_proj"] == "Float8Linear"
    assert kinds["model.layers.0.mlp.up_proj"] == "Linear", "the module filter kept it"


@pytest.mark.slow
def test_loss_scaling_skips_overflow_and_unscales_before_clipping(tmp_path: Path) -> None:
    # A loss scale of 2^24 overflows FP16 gradients: the first steps are skipped and the
    # scale backs off until the steps go through.
    recipe = get_recipe("fp16-dynamic-ls", loss_scale=2.0**24)
    t = make_trainer(tiny_llama(), _args(tmp_path, max_steps=12, save_steps=100), recipe=recipe,
                     train_dataset=Tokens())  # fmt: skip
    t.train()
    hist = t.lowprec.scaler.history
    assert len(hist) == 12 and hist[0].skipped and not hist[-1].skipped
    assert hist[-1].scale < 2.0**24
    norms = [h["grad_norm"] for h in t.state.log_history if "grad_norm" in h]
    applied = [n for n, r in zip(norms, hist, strict=True) if not r.skipped]
    # Unscaled before clipping: the norm of the true gradient (O(1) here), not S times it.
    assert applied and all(n < 100 for n in applied)
    assert all(torch.isfinite(m).all() for m in t.lowprec.optimizer.master_params)


@pytest.mark.slow
def test_run_directory_is_written_resumed_and_read_by_lowprec_report(tmp_path: Path) -> None:
    run = tmp_path / "run"
    a = make_trainer(tiny_llama(), _args(tmp_path / "a"), recipe="fp16-dynamic-ls",
                     train_dataset=Tokens(), run_dir=run)  # fmt: skip
    a.train()
    full = read_metrics(run)
    assert [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in full] == pytest.approx(_losses(a), rel=0, abs=0)
    assert all(r["loss_scale"] == 2.0**16 and not r["skipped"] for r in full)
    # Resume into the same directory from the checkpoint: the records after it are
    # replaced by the resumed run's, which are identical.
    b = make_trainer(tiny_llama(), _args(tmp_path / "b"), recipe="fp16-dynamic-ls",
                     train_dataset=Tokens(), run_dir=run)  # fmt: skip
    b.train(resume_from_checkpoint=str(tmp_path / "a" / f"checkpoint-{CKPT}"))
    again = read_metrics(run)
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in again] == [r["loss"] for r in full]
    config = json.loads((run / "config.json").read_text())
    assert config["recipe"]["name"] == "fp16-dynamic-ls"
    page = tmp_path / "report.html"
    assert main(["report", str(run), "-o", str(page)]) == 0
    assert "fp16-dynamic-ls" in page.read_text()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    m = tiny_llama()
    with pytest.raises(ValueError, match="fp16/bf16"):
        make_trainer(m, _args(tmp_path, bf16=True), recipe="bf16")
    with pytest.raises(TypeError, match="optimizers"):
        make_trainer(m, _args(tmp_path), recipe="bf16",
                     optimizers=(torch.optim.SGD(m.parameters(), lr=0.1), None))  # fmt: skip
    with pytest.raises(TypeError, match="args must be a TrainingArguments"):
        make_trainer(m, {"output_dir": "x"}, recipe="bf16")
    with pytest.raises(ValueError, match="unknown name"):
        make_trainer(m, _args(tmp_path), recipe="no-such-recipe")
    with pytest.raises(ValueError, match="module_filter"):
        make_trainer(m, _args(tmp_path), recipe="bf16", module_filter=lambda mod, fqn: True)
    with pytest.raises(ValueError, match="no float8 layers"):
        make_trainer(m, _args(tmp_path), recipe="bf16", guard=True)
    with pytest.raises(TypeError, match="guard must be"):
        make_trainer(m, _args(tmp_path), recipe="fp8-delayed", guard="yes")
    assert next(m.parameters()).dtype == torch.float32, "refused before converting the model"


@pytest.mark.slow
def test_resume_refuses_a_checkpoint_of_another_recipe(tmp_path: Path) -> None:
    a = make_trainer(tiny_llama(), _args(tmp_path / "a", max_steps=CKPT), recipe="fp8-delayed",
                     train_dataset=Tokens())  # fmt: skip
    a.train()
    b = make_trainer(tiny_llama(), _args(tmp_path / "b"), recipe="fp8-tensorwise",
                     train_dataset=Tokens())  # fmt: skip
    with pytest.raises(ValueError, match="saved with recipe 'fp8-delayed'"):
        b.train(resume_from_checkpoint=str(tmp_path / "a" / f"checkpoint-{CKPT}"))


@pytest.mark.slow
def test_the_guard_moves_layers_and_a_resumed_run_replays_them(tmp_path: Path) -> None:
    # fp8-naive (no scaling) flushes small gradients; a low flush limit makes the guard move
    # layers at the first measured steps. The resumed run replays the moves before loading.
    from lowprec.autopilot.guard import GuardConfig

    cfg = GuardConfig(flush_limit=0.01, saturate_limit=0.5, rel_err_limit=10.0)

    def trainer(out: Path, run: Path | None) -> Any:
        return make_trainer(tiny_llama(), _args(out), recipe="fp8-naive", train_dataset=Tokens(),
                            guard=cfg, gemms_every=1, run_dir=run)  # fmt: skip

    a = trainer(tmp_path / "a", tmp_path / "run")
    a.train()
    moves = a._guard.moves
    assert moves and moves[0].frm == "naive", "the guard moved fp8-naive layers"
    lines = (tmp_path / "run" / "guard.jsonl").read_text().splitlines()
    assert len(lines) == len(moves)
    assert any(r.get("guard_moves") for r in read_metrics(tmp_path / "run"))
    b = trainer(tmp_path / "b", None)
    b.train(resume_from_checkpoint=str(tmp_path / "a" / f"checkpoint-{CKPT}"))
    assert [(m.step, m.layer, m.to) for m in b._guard.moves] == [
        (m.step, m.layer, m.to) for m in moves
    ]
    assert _losses(b) == _losses(a)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    kinds = {n: type(m).__name__ for n, m in a.model.named_modules()}
    assert kinds == {n: type(m).__name__ for n, m in b.model.named_modules()}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp16-scalify", "fp8-tensorwise"])
def test_gpt2_with_accumulation_evaluation_and_weight_decay_resumes_exactly(
    tmp_path: Path, recipe: str
) -> None:
    # GPT-2: Conv1D linears, a tied head (saved once by save_pretrained, also when scalify
    # wraps the model), dropout (the RNG state must come back); 2 micro-batches per step,
    # evaluation inside compute(), HF's weight-decay groups.
    kw: dict[str, Any] = {
        "max_steps": 4, "save_steps": 2, "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2, "weight_decay": 0.1, "eval_strategy": "steps",
        "eval_steps": 2, "per_device_eval_batch_size": 4,
    }  # fmt: skip
    a = make_trainer(tiny_gpt2(), _args(tmp_path / "a", **kw), recipe=recipe,
                     train_dataset=Tokens(), eval_dataset=Tokens(8, seed=1))  # fmt: skip
    a.train()
    assert {g["weight_decay"] for g in a.lowprec.optimizer.param_groups} == {0.0, 0.1}
    evals = [h["eval_loss"] for h in a.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and all(math.isfinite(x) for x in evals)
    b = make_trainer(tiny_gpt2(), _args(tmp_path / "b", **kw), recipe=recipe,
                     train_dataset=Tokens(), eval_dataset=Tokens(8, seed=1))  # fmt: skip
    b.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert _losses(b) == _losses(a)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.slow
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_recipe_trains_as_the_plain_trainer(tmp_path: Path, weight_decay: float) -> None:
    """With ``fp32`` the lowprec Trainer is HF's: the same optimizer groups and steps.
    Oracle: ``transformers.Trainer`` itself. ``weight_decay=0.0`` (HF's default) gave the
    lowprec Trainer one group at AdamW's own default decay, 0.01."""
    kw: dict[str, Any] = {"max_steps": 3, "save_steps": 100, "weight_decay": weight_decay}
    plain = transformers.Trainer(
        model=tiny_llama(), args=_args(tmp_path / "p", **kw), train_dataset=Tokens()
    )
    plain.train()
    ours = make_trainer(tiny_llama(), _args(tmp_path / "l", **kw), recipe="fp32",
                        train_dataset=Tokens())  # fmt: skip
    ours.train()
    groups = [(g["weight_decay"], len(g["params"])) for g in plain.optimizer.param_groups]
    assert [(g["weight_decay"], len(g["params"])) for g in ours.lowprec.optimizer.param_groups] \
        == groups  # fmt: skip
    assert {wd for wd, _ in groups} == {weight_decay, 0.0}
    assert _losses(ours) == _losses(plain) and len(_losses(plain)) == 3
    pp, po = dict(plain.model.named_parameters()), dict(ours.lowprec.model.named_parameters())
    assert pp.keys() == po.keys()
    assert all(torch.equal(pp[k], po[k]) for k in pp), "parameters bit-identical"


class _Same(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """One token sequence at every index: every batch is that sequence repeated, whatever
    order the Trainer's sampler draws."""

    def __init__(self) -> None:
        self.ids = Tokens(n=1).ids[0]

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "labels": self.ids}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_unit_recipe_step_is_the_one_batch_unit_gradient(tmp_path: Path, accumulation: int) -> None:
    """A unit recipe's first SGD step through the Trainer is lr·lr_mult times the gradient
    of the unit model's own mean loss on the step's whole batch (4 · accumulation rows, one
    backward). HF's loss kwargs divided the summed loss by the token count as a plain op
    (every gradient 1/n of unit: 0.004x at 240 tokens), and k micro-batches' unit weight
    gradients summed to √k times one batch's (the b^-1/2 of each backward)."""
    import copy

    args = _args(tmp_path, max_steps=1, optim="sgd", lr_scheduler_type="constant",
                 gradient_accumulation_steps=accumulation, weight_decay=0.0,
                 max_grad_norm=0.0)  # fmt: skip
    t = make_trainer(tiny_llama(), args, recipe="fp32-unit", train_dataset=_Same())
    ref = copy.deepcopy(t.lowprec.model)
    before = {n: p.detach().clone() for n, p in t.lowprec.model.named_parameters()}
    ids = _Same().ids.repeat(4 * accumulation, 1)
    with t.lowprec.compute():
        ref(input_ids=ids, labels=ids).loss.backward()
    t.train()
    lr_of = {id(p): g["lr"] for g in t.lowprec.optimizer.param_groups for p in g["params"]}
    params = dict(t.lowprec.model.named_parameters())
    for name, p_ref in ref.named_parameters():
        want = -lr_of[id(params[name])] * p_ref.grad
        got = params[name].detach() - before[name]
        # float32 sums in another order (micro-batches, the √k factor): 1e-4 relative
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), name


def test_a_unit_recipe_refuses_a_loss_computed_outside_the_model(tmp_path: Path) -> None:
    """label_smoothing_factor (HF's LabelSmoother) and compute_loss_func compute the loss
    outside the model, bypassing the unit loss: every update was 0.002-0.003x the one
    without (found by a new-user trial). Refused, naming the argument."""
    m = tiny_llama()
    with pytest.raises(ValueError, match=r"args\.label_smoothing_factor: with a unit recipe"):
        make_trainer(m, _args(tmp_path, label_smoothing_factor=0.1), recipe="fp32-unit")
    with pytest.raises(ValueError, match="compute_loss_func: with a unit recipe"):
        make_trainer(
            m, _args(tmp_path), recipe="fp32-unit",
            compute_loss_func=lambda out, labels, num_items_in_batch=None: out.loss,
        )  # fmt: skip


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_scheduler_passed_with_optimizers_drives_lowprecs_optimizer(
    tmp_path: Path, recipe: str
) -> None:
    """optimizers=(None, LambdaLR(user_optimizer, lambda s: 0.0)): HF stepped and logged the
    user's scheduler (rate 0) while lowprec's optimizer kept lr 0.01 and moved the
    parameters. The scheduler now drives lowprec's optimizer (its one lambda for each of
    the weight-decay groups): rate 0, parameters unchanged; a schedule of per-group
    lambdas that differ is refused."""
    m = tiny_llama()
    user = torch.optim.AdamW(m.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(user, lambda s: 0.0)
    t = make_trainer(m, _args(tmp_path, max_steps=3, save_steps=100, learning_rate=0.01,
                                weight_decay=0.1), recipe=recipe, train_dataset=Tokens(),
                     optimizers=(None, sched))  # fmt: skip
    before = [p.detach().clone() for p in t.model.parameters()]
    t.train()
    assert sched.optimizer is t.lowprec.optimizer
    assert [g["lr"] for g in t.lowprec.optimizer.param_groups] == [0.0, 0.0]
    for b, p in zip(before, t.model.parameters(), strict=True):
        assert torch.equal(b, p.detach())
    m2 = tiny_llama()
    two = torch.optim.AdamW([{"params": [p]} for p in m2.parameters()][:3], lr=0.01)
    odd = torch.optim.lr_scheduler.LambdaLR(two, [lambda s: 1.0, lambda s: 0.5, lambda s: 0.0])
    t2 = make_trainer(m2, _args(tmp_path / "b", max_steps=1), recipe=recipe,
                      train_dataset=Tokens(), optimizers=(None, odd))  # fmt: skip
    with pytest.raises(ValueError, match="lr_lambdas differ between the 3 parameter groups"):
        t2.train()


def test_clipping_uses_the_fp32_master_gradients(tmp_path: Path) -> None:
    """fp16-dynamic-ls with a loss of ~1e-7: the unscaled gradients rounded into the
    model's FP16 .grad underflow (norm 0), so HF's clip saw 0, logged grad_norm 0 and did
    not clip. The clip is now MasterWeights.clip_grad_norm_ of the FP32 gradients: the
    logged norm is theirs, and the optimizer steps on torch's clip of them."""
    m = tiny_llama()
    m.register_forward_hook(
        lambda mod, inp, out: (out.__setitem__("loss", out.loss * 1e-7), out)[1]
    )
    args = _args(tmp_path, max_steps=1, max_grad_norm=5e-8, save_steps=100)
    t = make_trainer(m, args, recipe="fp16-dynamic-ls", train_dataset=Tokens(),
                     optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 1.0}))  # fmt: skip
    opt = t.lowprec.optimizer
    assert isinstance(opt, MasterWeights)
    seen: dict[str, float] = {}
    clip, inner_step = opt.clip_grad_norm_, opt.optimizer.step

    def norm() -> float:
        gs = [p.grad.double().norm() for p in opt.master_params if p.grad is not None]
        return float(torch.stack(gs).norm())

    def spy_clip(max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        seen["before"] = norm()
        return clip(max_norm, norm_type)

    def spy_step(*a: Any, **k: Any) -> Any:
        seen["stepped"] = norm()
        return inner_step(*a, **k)

    opt.clip_grad_norm_ = spy_clip  # type: ignore[method-assign]
    opt.optimizer.step = spy_step  # type: ignore[method-assign]
    t.train()
    total = seen["before"]
    logged = next(h["grad_norm"] for h in t.state.log_history if "grad_norm" in h)
    assert total > 1e-8 and logged == pytest.approx(total, rel=1e-4)
    coef = 5e-8 / (total + 1e-6)  # torch's clip coefficient (its 1e-6 included)
    assert seen["stepped"] == pytest.approx(coef * total, rel=1e-4)


def test_the_run_directory_logs_the_rate_each_step_used(tmp_path: Path) -> None:
    """run_dir's metrics recorded the next step's learning rate (logged after the
    scheduler stepped: 0.00833, ..., 0 where HF logged 0.01, ..., 0.00167). Each record
    now holds the rate its step used, HF's logged learning_rate."""
    args = _args(tmp_path / "out", max_steps=6, save_steps=100, learning_rate=0.01,
                 lr_scheduler_type="linear")  # fmt: skip
    t = make_trainer(tiny_llama(), args, recipe="bf16", train_dataset=Tokens(),
                     run_dir=tmp_path / "run")  # fmt: skip
    t.train()
    hf = [h["learning_rate"] for h in t.state.log_history if "learning_rate" in h]
    ours = [r["lr"] for r in read_metrics(tmp_path / "run")]
    assert hf[0] == pytest.approx(0.01) and ours == pytest.approx(hf, rel=1e-9), (ours, hf)
