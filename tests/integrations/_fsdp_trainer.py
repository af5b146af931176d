"""Run by test_transformers_fsdp.py, in one of two modes (``argv[1]``), writing JSON under
``argv[2]`` for each recipe ``argv[3:]``:

* ``fsdp``, under ``accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2`` on the
  CPU (gloo): ``make_trainer`` shards the model with lowprec's FSDP2, trains 4 steps
  (2 rows per rank) with a checkpoint at step 2, and a new trainer resumes from it. Rank 1
  builds its model from another seed (as HF's ``cpu_ram_efficient_loading`` leaves the
  ranks other than 0 without the pretrained weights): the trainer starts every rank from
  rank 0's. ``<recipe>/result_<rank>.json``; ``refused_<rank>.json`` for a recipe FSDP2
  cannot run;
* ``single``: the same 4 steps on one process with the same global batch (4 rows):
  ``<recipe>/single.json``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers

from lowprec.integrations.transformers import make_trainer
from lowprec.recipes import get_recipe
from tests.integrations._tiny import Tokens, tiny_llama


def _args(out: Path, batch: int, **kw: Any) -> Any:
    return transformers.TrainingArguments(
        str(out), max_steps=4, save_steps=2, logging_steps=1, per_device_train_batch_size=batch,
        learning_rate=1e-3, use_cpu=True, report_to=[], disable_tqdm=True, **kw,
    )  # fmt: skip


def _losses(t: Any) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def single(out: Path, recipe: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    t = make_trainer(tiny_llama(), _args(out / "run", 4, save_strategy="no"), recipe=recipe,
                     train_dataset=Tokens())  # fmt: skip
    t.train()
    evaluated = t.evaluate(Tokens(8, seed=1))["eval_loss"]
    (out / "single.json").write_text(json.dumps({"losses": _losses(t), "eval": evaluated}))


def fsdp(out: Path, recipe: str) -> None:
    import safetensors.torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from lowprec.distributed.checkpoint import full_state_dict
    from lowprec.scalify.transform import Scalified

    out.mkdir(parents=True, exist_ok=True)
    seed = int(os.environ["RANK"])  # rank 1's own weights are replaced by rank 0's
    a = make_trainer(
        tiny_llama(seed),
        _args(out / "a", 2, ddp_backend="gloo"),
        recipe=recipe,
        train_dataset=Tokens(),
    )
    a.train()
    b = make_trainer(
        tiny_llama(seed),
        _args(out / "b", 2, ddp_backend="gloo"),
        recipe=recipe,
        train_dataset=Tokens(),
    )
    b.train(resume_from_checkpoint=str(out / "a" / "checkpoint-2"))
    whole_a, whole_b = full_state_dict(a.model), full_state_dict(b.model)
    params = [p for p in a.model.parameters()]
    # the file rank 0 wrote at step 4 (the HF model a scalify wrapper runs) against the
    # gathered state of the model at step 4
    saved = full_state_dict(a.model.module if isinstance(a.model, Scalified) else a.model)
    ckpt = out / "a" / "checkpoint-4"
    file = safetensors.torch.load_file(str(ckpt / "model.safetensors"))
    result = {
        "world": dist.get_world_size(),
        "fsdp_module": isinstance(a.model_wrapped, FSDPModule) and a.model_wrapped is a.model,
        "ddp_anywhere": any(isinstance(m, DistributedDataParallel) for m in a.model.modules()),
        "accelerate_fsdp": a.is_fsdp_enabled,
        "sharded": all(isinstance(p, DTensor) for p in params)
        and any(p.to_local().numel() < p.numel() for p in params),
        "resumed_equal": whole_a.keys() == whole_b.keys()
        and all(torch.equal(whole_a[k], whole_b[k]) for k in whole_a),
        "n_buffers": len(list(a.model.buffers())),
        "differ": [
            k for k in whole_a if not torch.equal(whole_a[k], whole_b.get(k, torch.empty(0)))
        ],
        # a delayed weight's amax is recorded at the first all-gather after each update
        "weight_amax_records": [
            int((v != 0).sum()) for k, v in whole_a.items() if k.endswith("weight_amax_history")
        ],
        "saved_equal": bool(file) and all(torch.equal(v, saved[k]) for k, v in file.items()),
        "dcp": (ckpt / "lowprec_fsdp" / ".metadata").is_file(),
        "losses": _losses(a),
        "resumed_losses": _losses(b),
        "steps": len(a.lowprec.scaler.history),
        "scale": a.lowprec.scaler.state_dict(),
        "resumed_scale": b.lowprec.scaler.state_dict(),
        # evaluation through the sharded model (after the states were compared: an eval
        # forward may record amax values)
        "eval": a.evaluate(Tokens(8, seed=1))["eval_loss"],
        "resumed_eval": b.evaluate(Tokens(8, seed=1))["eval_loss"],
    }
    (out / f"result_{dist.get_rank()}.json").write_text(json.dumps(result, default=str))


def extras(out: Path) -> None:
    """fp8-delayed with gradient accumulation and a run directory (rank 0 writes it, every
    rank measures), then ``trainer.save_model``: the unsharded model loads with
    ``from_pretrained``. ``extras_<rank>.json``."""
    import torch.distributed as dist

    from lowprec.distributed.checkpoint import full_state_dict

    args = _args(out / "extras", 2, ddp_backend="gloo", gradient_accumulation_steps=2)
    t = make_trainer(tiny_llama(), args, recipe="fp8-delayed", train_dataset=Tokens(),
                     run_dir=str(out / "run"), numerics_every=2, gemms_every=2)  # fmt: skip
    t.train()
    t.save_model(str(out / "final"))
    whole = full_state_dict(t.model)
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out / "final")).state_dict()
    result = {
        "losses": _losses(t),
        "loaded_equal": all(torch.equal(v, whole[k]) for k, v in loaded.items()),
        "metrics": len((out / "run" / "metrics.jsonl").read_text().splitlines())
        if dist.get_rank() == 0
        else None,
    }
    (out / f"extras_{dist.get_rank()}.json").write_text(json.dumps(result))


def refused(out: Path) -> None:
    """What FSDP2 refuses, with a ValueError on every rank: a recipe that rounds FP32
    master weights stochastically (the all-gather casts the FP32 shards to nearest), and
    ``load_best_model_at_end``."""
    import torch.distributed as dist

    base = get_recipe("bf16")
    bad = replace(base, name="bf16-sr-masters",
                  policy=replace(base.policy, stochastic_rounding=True))  # fmt: skip
    errors: list[str | None] = []
    best = {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 2}
    for recipe, kw in ((bad, {}), ("bf16", best)):
        try:
            args = _args(out / "refused", 2, ddp_backend="gloo", **kw)
            make_trainer(tiny_llama(), args, recipe=recipe, train_dataset=Tokens())
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    (out / f"refused_{dist.get_rank()}.json").write_text(json.dumps({"errors": errors}))


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    for name in sys.argv[3:]:
        (single if mode == "single" else fsdp)(root / name, name)
    if mode == "fsdp":
        extras(root)
        refused(root)
        # Destroy the gloo group before interpreter teardown: freed there, its threads can
        # be destroyed while joinable and abort the process after its work (SIGABRT).
        from lowprec.distributed import shutdown

        shutdown()
