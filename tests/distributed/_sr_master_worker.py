"""Worker of ``test_sr_masters.py``: run under ``torch.distributed.run --nproc-per-node 2``.

``bf16`` with stochastically rounded FP32 masters (``MasterWeights``) under DDP, built
without a generator, then trained 5 steps with the ranks' global generators seeded apart
(per-rank dropout or sampling seeds do that). Rank 0 writes how many parameter elements
differ between the replicas, and whether the optimizer has a generator of its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lowprec.distributed as LD
from lowprec.recipes import get_recipe


def main(path: str) -> None:
    LD.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    recipe = get_recipe("bf16", stochastic_rounding=True)
    p = LD.prepare(model, recipe, "ddp", lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    torch.manual_seed(1000 + rank)  # the ranks' global generators now differ
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        rows = slice(4 * rank, 4 * rank + 4)
        with p.compute():
            loss = F.mse_loss(p.model(x[rows]).float(), y[rows])
        p.scaler.scale(loss).backward()
        p.scaler.step(p.optimizer)
        p.scaler.update()
        p.optimizer.zero_grad()
    differ = 0
    for q in p.model.parameters():
        t0 = q.detach().float().clone()
        dist.broadcast(t0, 0)
        differ += int((q.float() != t0).sum())
    counts = [0, 0]
    dist.all_gather_object(counts, differ)
    if rank == 0:
        gen = getattr(p.optimizer, "generator", None)
        Path(path).write_text(json.dumps({"differ": counts, "own_generator": gen is not None}))
    LD.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
