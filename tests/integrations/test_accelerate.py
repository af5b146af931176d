"""lowprec under HF Accelerate: ``prepare(accelerator, model, optimizer, recipe)`` trains as
lowprec's own loop does, bit for bit, and ``save_state``/``load_state`` resume exactly."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from lowprec.amp import MasterWeights  # noqa: E402
from lowprec.integrations.accelerate import prepare  # noqa: E402
from lowprec.recipes import prepare as prepare_recipe  # noqa: E402
from tests.integrations._tiny import Tokens, tiny_llama  # noqa: E402

STEPS = 4


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide state; each test starts from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _batches(n: int, start: int = 0) -> list[torch.Tensor]:
    ids = Tokens(64).ids
    return [ids[4 * i : 4 * i + 4] for i in range(start, start + n)]


def _accelerate_loop(model: Any, optimizer: Any, lp: Any, acc: Any, batches: Any) -> list[float]:
    losses = []
    for ids in batches:
        with lp.compute():
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
        lp.scaler.unscale_(lp.optimizer)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp16-dynamic-ls", "fp8-delayed", "bf16-unit"])
def test_the_accelerate_loop_is_lowprecs_loop(recipe: str) -> None:
    acc = accelerate.Accelerator(cpu=True)
    m = tiny_llama()
    model, opt, lp = prepare(acc, m, _adamw(m), recipe)
    assert acc.scaler is lp.scaler and opt.optimizer is lp.optimizer
    if recipe != "fp8-delayed":  # fp8-delayed keeps BF16 params with masters too
        assert isinstance(lp.optimizer, MasterWeights)
    got = _accelerate_loop(model, opt, lp, acc, _batches(STEPS))
    # The same steps by hand with lowprec alone (the loop of lowprec.recipes.Prepared).
    ref = prepare_recipe(
        tiny_llama(), recipe, lambda ps: torch.optim.AdamW(ps, 1e-3, weight_decay=0.01)
    )
    want = []
    for ids in _batches(STEPS):
        with ref.compute():
            loss = ref.model(input_ids=ids, labels=ids).loss
            ref.scaler.scale(loss).backward()
        ref.scaler.unscale_(ref.optimizer)
        torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 1.0)
        ref.scaler.step(ref.optimizer)
        ref.scaler.update()
        ref.optimizer.zero_grad(set_to_none=True)
        want.append(float(loss.detach()))
    assert got == want, "identical losses"
    for (n, p), (_, q) in zip(
        lp.model.named_parameters(), ref.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), n
    assert len(lp.scaler.history) == STEPS


@pytest.mark.slow
def test_save_state_and_load_state_resume_exactly(tmp_path: Path) -> None:
    acc = accelerate.Accelerator(cpu=True)
    m = tiny_llama()
    model, opt, lp = prepare(acc, m, _adamw(m), "fp8-delayed",
                             module_filter=lambda mod, fqn: "mlp" not in fqn)  # fmt: skip
    assert type(lp.model.model.layers[0].mlp.up_proj).__name__ == "Linear", "filtered out"
    assert type(lp.model.model.layers[0].self_attn.q_proj).__name__ == "Float8Linear"
    _accelerate_loop(model, opt, lp, acc, _batches(2))
    acc.save_state(str(tmp_path / "ckpt"))
    tail = _accelerate_loop(model, opt, lp, acc, _batches(2, start=2))

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    acc2 = accelerate.Accelerator(cpu=True)
    m2 = tiny_llama(seed=1)  # other initial weights: all of them must come from the checkpoint
    model2, opt2, lp2 = prepare(acc2, m2, _adamw(m2), "fp8-delayed",
                                module_filter=lambda mod, fqn: "mlp" not in fqn)  # fmt: skip
    acc2.load_state(str(tmp_path / "ckpt"))
    tail2 = _accelerate_loop(model2, opt2, lp2, acc2, _batches(2, start=2))
    assert tail2 == tail
    for (n, p), (_, q) in zip(lp.model.state_dict().items(), lp2.model.state_dict().items(),
                              strict=True):  # fmt: skip
        assert torch.equal(p, q), n


def test_bad_arguments_are_refused() -> None:
    m = tiny_llama()
    with pytest.raises(ValueError, match="mixed_precision='bf16'"):
        prepare(accelerate.Accelerator(cpu=True, mixed_precision="bf16"), m, None, "bf16")
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=True)
    with pytest.raises(TypeError, match="accelerator must be"):
        prepare(object(), m, None, "bf16")
    with pytest.raises(TypeError, match="optimizer must be"):
        prepare(acc, m, "adamw", "bf16")  # type: ignore[arg-type]
    two = torch.optim.SGD([{"params": [m.lm_head.weight]}, {"params": [m.model.norm.weight]}])
    with pytest.raises(ValueError, match="2 parameter groups"):
        prepare(acc, m, two, "bf16")


def test_an_optimizer_over_part_of_the_model_is_refused() -> None:
    """lowprec rebuilds the optimizer over every trainable parameter: one built over a part
    of the model used to come back training all of it, silently. Now a ValueError naming
    what it does not hold; the same model with the other part frozen is accepted, and its
    prepared optimizer holds exactly the trainable part."""
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(cpu=True)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"holds 2 of the model's 4 .*'1\.weight'"):
        prepare(acc, m, torch.optim.AdamW(m[0].parameters()), "bf16")
    other = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="2 that are not"):
        prepare(acc, m, torch.optim.AdamW([*m.parameters(), *other.parameters()]), "bf16")
    m[1].requires_grad_(False)
    _, _, p = prepare(acc, m, torch.optim.AdamW(m[0].parameters()), "bf16")
    assert sum(len(g["params"]) for g in p.optimizer.param_groups) == 2


@pytest.mark.parametrize(("recipe", "k"), [("fp32-unit", 2), ("fp32-unit", 4), ("fp32", 2)])
def test_accumulated_gradient_is_the_one_batch_gradient(recipe: str, k: int) -> None:
    """Accelerate's own accumulation loop (``Accelerator(gradient_accumulation_steps=k)``,
    ``with accelerator.accumulate(model)``, ``accelerator.backward(loss)``, no division of
    the user's) gives, at the step, the gradient of one batch of all ``4k`` rows:
    ``accelerator.backward`` divides every loss by ``k``, and for a unit recipe the adapter
    scales its backward by ``√k`` too (a unit weight gradient carries ``b^-1/2`` of its own
    backward's ``b`` rows, so ``k`` micro-batches sum to ``√k`` times the batch of ``4k``).
    Before, the step's unit gradient was ``1/√k`` of that batch's (``1/(k√k)`` following
    the docs' "divide by √k yourself": 0.25 at ``k`` = 4). ``fp32``: a mean loss, the
    control (unchanged). Tolerance 1e-5 relative (of each tensor's largest entry): the
    same float32 sums, in ``k`` parts then added, instead of one reduction (measured at
    most 6e-7)."""
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=k)
    model, opt, lp = prepare(acc, tiny_llama(), lambda ps: torch.optim.SGD(ps, lr=1e-3), recipe)
    ref = copy.deepcopy(lp.model)
    ids = Tokens(64).ids[: 4 * k]
    with lp.compute():
        ref(input_ids=ids, labels=ids).loss.backward()  # one batch of all 4k rows
    got: dict[str, torch.Tensor] = {}
    for i in range(k):
        batch = ids[4 * i : 4 * i + 4]
        with acc.accumulate(model):
            with lp.compute():
                loss = model(input_ids=batch, labels=batch).loss
                acc.backward(loss)
            assert acc.sync_gradients == (i == k - 1)
            if acc.sync_gradients:
                got = {n: p.grad.detach().clone() for n, p in lp.model.named_parameters()}
            opt.step()
            opt.zero_grad()
    for name, p in ref.named_parameters():
        assert p.grad is not None
        err = float((got[name] - p.grad).abs().max() / p.grad.abs().max())
        assert err <= 1e-5, (name, err, "norm ratio", float(got[name].norm() / p.grad.norm()))
