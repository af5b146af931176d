"""Run by test_transformers_ddp.py under ``accelerate launch --num_processes 2`` (or
``torchrun``): ``make_trainer`` data-parallel over 2 CPU processes (gloo), trained and then
resumed from its checkpoint in a new trainer, for each recipe ``argv[2:]``; writes
``<recipe>/result_<rank>.json`` under ``argv[1]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from lowprec.integrations.transformers import make_trainer
from tests.integrations._tiny import Tokens, tiny_llama


def _args(out: Path) -> Any:
    return transformers.TrainingArguments(
        str(out), max_steps=4, save_steps=2, logging_steps=1, per_device_train_batch_size=2,
        learning_rate=1e-3, use_cpu=True, report_to=[], disable_tqdm=True, ddp_backend="gloo",
    )  # fmt: skip


def main(out: Path, recipe: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    a = make_trainer(tiny_llama(), _args(out / "a"), recipe=recipe, train_dataset=Tokens())
    a.train()
    b = make_trainer(tiny_llama(), _args(out / "b"), recipe=recipe, train_dataset=Tokens())
    b.train(resume_from_checkpoint=str(out / "a" / "checkpoint-2"))
    flat = torch.cat([p.detach().float().flatten() for p in a.model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    pa, pb = list(a.model.parameters()), list(b.model.parameters())

    def losses(t: Any) -> list[float]:
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    result = {
        "world": dist.get_world_size(),
        "wrapped": type(a.model_wrapped).__name__,
        "replicas_equal": all(torch.equal(every[0], e) for e in every),
        "resumed_equal": all(torch.equal(p, q) for p, q in zip(pa, pb, strict=True)),
        "losses": losses(a),
        "resumed_losses": losses(b),
        "steps": len(a.lowprec.scaler.history),
    }
    (out / f"result_{dist.get_rank()}.json").write_text(json.dumps(result))


def accelerate_loop(out: Path, recipe: str) -> None:
    """lowprec.integrations.accelerate.prepare on the same 2 processes: the replicas stay
    identical (float8 scales reduced over the ranks)."""
    from accelerate import Accelerator

    from lowprec.integrations.accelerate import prepare

    out.mkdir(parents=True, exist_ok=True)
    acc = Accelerator(cpu=True)
    m = tiny_llama()
    model, opt, lp = prepare(acc, m, torch.optim.AdamW(m.parameters(), lr=1e-3), recipe)
    ids = Tokens(16).ids
    for i in range(3):
        x = ids[4 * i + 2 * acc.process_index : 4 * i + 2 * acc.process_index + 2]
        with lp.compute():
            acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().float().flatten() for p in lp.model.parameters()])
    bufs = torch.cat([b.detach().float().flatten() for b in lp.model.buffers()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    every_b = [torch.empty_like(bufs) for _ in range(dist.get_world_size())]
    dist.all_gather(every_b, bufs)
    result = {
        "wrapped": type(model).__name__,
        "replicas_equal": all(torch.equal(every[0], e) for e in every),
        "scales_equal": all(torch.equal(every_b[0], e) for e in every_b),
        "steps": len(lp.scaler.history),
    }
    (out / f"accelerate_{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    for name in sys.argv[2:]:
        main(Path(sys.argv[1]) / name, name)
    accelerate_loop(Path(sys.argv[1]) / "accelerate", "fp8-delayed")
    # Destroy the gloo group before interpreter teardown: freed there, its threads can be
    # destroyed while joinable and abort the process after its work (SIGABRT, seen in CI).
    from lowprec.distributed import shutdown

    shutdown()
