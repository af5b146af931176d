"""u-μP's claim (issue 4, item 5): sweeping only the global learning rate η is enough, and
the best η does not move with width. Trains the unit-scaled CharGPT (recipe
``fp32-unit``, the real training loop; 4 heads at every width) at two widths over a grid
of η (factor 2 apart) and reports, per width, the val loss by η and the best η; the claim
holds if the best η's are the same or one grid step apart.

η reaches the recipe as ``lr = η / UMUP_LR_PER_LR`` (the recipes map the standard lr to η).
Runs go two at a time, one thread each (``--jobs``); ``--quick``: 2 widths x 3 η, 30 steps,
temp JSON.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from _common import arg_parser, parse_args, print_table, run_record, write_json

from lowprec.jobs.train import TrainConfig
from lowprec.unit.entry import UMUP_LR_PER_LR

# The 120-step configuration of tests/test_recipes_train.py (width set per run).
CFG = TrainConfig(steps=120, batch_size=16, seq_len=64, width=64, depth=2, heads=4, lr=3e-3,
                  warmup=10, eval_every=120, eval_batches=8, ckpt_every=1000,
                  recipe="fp32-unit")  # fmt: skip

_CHILD = """
import json, sys, tempfile, torch
torch.set_num_threads(1)
from lowprec.jobs.train import TrainConfig, train
cfg = TrainConfig(**json.loads(sys.argv[1]))
print(json.dumps(train(cfg, tempfile.mkdtemp(), progress=False)["val_loss"]))
"""


def _run(cfg: TrainConfig) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cfg.to_dict())],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = arg_parser(__doc__, quick="2 widths x 3 η, 30 steps")
    ap.add_argument("--widths", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--etas", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--jobs", type=int, default=2)
    a = parse_args(ap, None, "umup_sweep_cpu")
    cfg, etas = CFG, a.etas
    if a.quick:
        cfg, etas = replace(CFG, steps=30, warmup=5, eval_every=30, eval_batches=2), [0.25, 1, 4]
    runs = [(w, eta, replace(cfg, width=w, lr=eta / UMUP_LR_PER_LR))
            for w in a.widths for eta in etas]  # fmt: skip
    with ThreadPoolExecutor(a.jobs) as pool:
        vals = list(pool.map(lambda r: _run(r[2]), runs))
    loss: dict[int, dict[float, float]] = {w: {} for w in a.widths}
    for (w, eta, _), v in zip(runs, vals, strict=True):
        loss[w][eta] = v
    best = {w: min(etas, key=lambda e: loss[w][e] if math.isfinite(loss[w][e]) else math.inf)
            for w in a.widths}  # fmt: skip
    print_table("unit-scaled CharGPT: val loss by global η (fp32-unit)",
                ["η"] + [f"width {w}" for w in a.widths],
                [[e] + [loss[w][e] for w in a.widths] for e in etas])  # fmt: skip
    steps = abs(math.log2(best[a.widths[0]] / best[a.widths[-1]]))
    print(f"best η by width: {best}; {steps:.0f} grid step(s) apart")
    rec: dict[str, Any] = run_record("bench_umup_sweep", "cpu", train=cfg.to_dict(),
                                     widths=a.widths, etas=etas)  # fmt: skip
    rec["umup_lr_per_lr"] = UMUP_LR_PER_LR
    rec["val_loss"] = {str(w): {str(e): loss[w][e] for e in etas} for w in a.widths}
    rec["best_eta"] = {str(w): best[w] for w in a.widths}
    rec["best_eta_steps_apart"] = steps
    rec["holds"] = steps <= 1
    write_json(rec, a.out)


if __name__ == "__main__":
    main()
