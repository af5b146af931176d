"""Worker of ``test_unit_loss.py``: run under ``torch.distributed.run --nproc-per-node 2``.

``python -m torch.distributed.run --nproc-per-node 2 tests/distributed/_unit_loss_worker.py
OUT.json``: a unit recipe (``fp32-unit``) under DDP (plain, BF16 and FP8 gradient
communication) and FSDP2, one backward of a global batch of 8 rows (4 per rank) with each
kind of loss: a plain mean loss computed outside the model (``F.cross_entropy``,
``F.mse_loss``), lowprec's unit cross-entropy outside the model, and the model's own loss
in ``forward`` (CharGPT's ``F.cross_entropy``, converted by the unit mode). Rank 0 writes
every parameter's gradient (gathered) and each rank's input gradient, and the one-process
references: the whole batch's parameter gradients, each half batch's input gradient.

MoE (:data:`MOE_LOSSES` × :data:`MOE_MODES`): a tiny Qwen3-MoE (8 experts, top-2, no
load-balancing loss, whose batch statistics no data-parallel run shares) under
``fp32-unit``, whose ranks route different numbers of their tokens to each expert; the
same gradients and references.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lowprec
import lowprec.distributed as LD
from lowprec.jobs.hf_models import build_hf_model
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.unit import functional as U

LOSSES = ("mean-ce", "mean-mse", "unit-ce", "in-forward", "unused-unit", "mixed")
IN_MODEL = ("in-forward", "unused-unit", "mixed")  # CharGPT, which computes its unit loss
MODES = (("ddp", "fp32"), ("ddp", "bf16"), ("ddp", "fp8"), ("fsdp", "fp32"))
MOE_LOSSES = ("in-forward", "unused-unit")
MOE_MODES = (("ddp", "fp32"), ("fsdp", "fp32"))


def _moe_model() -> nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16, width=32, depth=1, heads=2, seq_len=8)
    return build_hf_model("qwen3moe", cfg, output_router_logits=False)


def _moe_backward(model: nn.Module, loss: str, x: torch.Tensor, y: torch.Tensor) -> None:
    logits, unit = model(x, y)
    mean = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    (unit if loss == "in-forward" else mean).backward()


def _model(loss: str) -> nn.Module:
    torch.manual_seed(0)
    if loss in IN_MODEL:
        return CharGPT(ModelConfig(width=32, depth=1, heads=2, seq_len=8, vocab_size=16))
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10))


def _batch(loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if loss in IN_MODEL:
        return torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g)
    x = torch.randn(8, 16, generator=g)
    y = (
        torch.randn(8, 10, generator=g)
        if loss == "mean-mse"
        else torch.randint(0, 10, (8,), generator=g)
    )
    return x, y


def _backward(
    model: nn.Module, loss: str, x: torch.Tensor, y: torch.Tensor, aux: float = 0.5
) -> torch.Tensor:
    """One backward; the gradient of the input (of the embedding output for CharGPT).
    ``unused-unit``: the model computes its unit loss, the user back-propagates a mean
    cross-entropy of its logits instead; ``mixed``: the unit loss plus ``aux`` times that
    mean loss."""
    if loss in IN_MODEL:
        emb: list[torch.Tensor] = []

        def keep(m: nn.Module, a: Any, o: torch.Tensor) -> None:
            o.retain_grad()
            emb.append(o)

        inner = model.module if hasattr(model, "module") else model
        h = inner.tok.register_forward_hook(keep)
        logits, unit = model(x, y)
        mean = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        {"in-forward": unit, "unused-unit": mean, "mixed": unit + aux * mean}[loss].backward()
        h.remove()
        return emb[0].grad.detach().clone()
    x = x.clone().requires_grad_(True)
    out = model(x)
    if loss == "mean-ce":
        F.cross_entropy(out, y).backward()
    elif loss == "mean-mse":
        F.mse_loss(out, y).backward()
    else:
        U.cross_entropy(out, y).backward()
    return x.grad.detach().clone()


def _grads(model: nn.Module) -> dict[str, list[float]]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[n.replace("module.", "")] = g.detach().double().reshape(-1).tolist()
    return out


def main(path: str) -> None:
    LD.init()
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    for loss in LOSSES:
        x, y = _batch(loss)
        one = lowprec.prepare(_model(loss), "fp32-unit")
        _backward(one.model, loss, x, y)
        res[f"{loss}/reference"] = _grads(one.model)
        halves = []
        for r in range(2):
            half = lowprec.prepare(_model(loss), "fp32-unit")
            # (mixed: a rank's mean term reaches the model divided by N = 2, see unit_reduce)
            rows = slice(4 * r, 4 * r + 4)
            halves.append(_backward(half.model, loss, x[rows], y[rows], aux=0.25))
        res[f"{loss}/reference_dx"] = [h.double().reshape(-1).tolist() for h in halves]
        for mode, comm in MODES:
            p = LD.prepare(_model(loss), "fp32-unit", mode, grad_comm=comm)
            dx = _backward(p.model, loss, x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4])
            dxs: list[Any] = [None, None]
            dist.all_gather_object(dxs, dx.double().reshape(-1).tolist())
            res[f"{loss}/{mode}-{comm}"] = {"grads": _grads(p.model), "dx": dxs}
    x, y = _batch("in-forward")
    mine = slice(4 * rank, 4 * rank + 4)
    for loss in MOE_LOSSES:
        one = lowprec.prepare(_moe_model(), "fp32-unit")
        _moe_backward(one.model, loss, x, y)
        res[f"moe/{loss}/reference"] = _grads(one.model)
        for mode, comm in MOE_MODES:
            p = LD.prepare(_moe_model(), "fp32-unit", mode, grad_comm=comm)
            _moe_backward(p.model, loss, x[mine], y[mine])
            res[f"moe/{loss}/{mode}-{comm}"] = {"grads": _grads(p.model)}
    if rank == 0:
        Path(path).write_text(json.dumps(res))
    LD.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
