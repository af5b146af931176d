"""``lowprec tune``: the autopilot on a model of ``lowprec train``, written to ``plan.json``.

The model is built as ``lowprec train`` builds it (:func:`lowprec.jobs.model.build_model`,
same shape flags, same seed), optionally trained ``steps_before`` steps in BF16 so that the
sensitivity is measured on weights that have moved from their initialisation, then tuned
(:func:`lowprec.tune`) on ``batches`` training batches drawn after those steps. The plan is
written atomically (:meth:`lowprec.autopilot.Plan.save`); ``lowprec train --recipe
plan.json`` trains with its recipe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowprec.autopilot import Budget, Plan, tune
from lowprec.autopilot.cost import check_candidates, check_target
from lowprec.jobs.data import CharData
from lowprec.jobs.interrupts import Interrupted
from lowprec.jobs.model import ModelConfig, build_model, check_model_name
from lowprec.jobs.train_config import TrainConfig, check_int
from lowprec.jobs.train_setup import check_memory
from lowprec.recipes import prepare
from lowprec.recipes.step import train_step

__all__ = [
    "BUDGET_RANGE",
    "TuneConfig",
    "TuneInterrupted",
    "check_budget",
    "plan_rows",
    "run_tune",
]

BUDGET_RANGE = (1e-9, 1e3)  # the float budgets lowprec tune takes (check_budget)


@dataclass(frozen=True)
class TuneConfig:
    """What ``lowprec tune`` tunes (every field a flag; checked on construction)."""

    target: str = "h100"
    model: str = "reference"
    width: int = 128
    depth: int = 2
    heads: int = 4
    seq_len: int = 64
    batch_size: int = 8
    batches: int = 2
    budget: float | None = None
    candidates: tuple[str, ...] | None = None
    seed: int = 0
    steps_before: int = 0
    lr: float = 3e-3

    def __post_init__(self) -> None:
        check_target(self.target)
        check_model_name(self.model)
        for name in ("width", "depth", "heads", "seq_len", "batch_size", "batches"):
            check_int(name, getattr(self, name), 1)
        for name in ("seed", "steps_before"):  # torch.manual_seed takes < 2^64 (seed + batch)
            check_int(name, getattr(self, name), 0)
        if self.budget is not None:
            check_budget(self.budget)
        if self.candidates is not None:
            check_candidates(self.candidates)
        TrainConfig.check_field("lr", self.lr)  # as lowprec train's --lr
        ModelConfig(65, self.width, self.depth, self.heads, self.seq_len)  # width % heads

    def model_flags(self) -> str:
        """The model's flags, as :attr:`lowprec.autopilot.Plan.model` records them."""
        return (
            f"--model {self.model} --width {self.width} --depth {self.depth} "
            f"--heads {self.heads} --seq-len {self.seq_len}"
        )


def check_budget(budget: object) -> None:
    """``ValueError`` naming ``budget`` unless it is a :class:`~lowprec.autopilot.Budget` or
    a number ``b`` in :data:`BUDGET_RANGE` (relative loss change ``b``, gradient error
    ``10·b``): below the range the squared gradient budget underflows, above it every
    format passes (and ``10·b`` overflows near the largest float)."""
    if isinstance(budget, Budget):
        return
    lo, hi = BUDGET_RANGE
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not lo <= budget <= hi:
        raise ValueError(f"budget must be a number from {lo:g} to {hi:g}, got {budget!r}")


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    loss: torch.Tensor = model(*batch)[1]
    return loss


class TuneInterrupted(Interrupted):
    """``lowprec tune`` stopped by SIGINT/SIGTERM: it has no run directory or checkpoint,
    and the plan is written only at the end (atomically), so none was written."""

    def __init__(self, signum: int, out: str) -> None:
        super().__init__(0, signum, out)

    def __str__(self) -> str:
        return f"interrupted ({self.signal_name}); no plan written to {self.out}"


def _diverged(cfg: TuneConfig, what: str) -> ValueError:
    return ValueError(
        f"the model diverged during --steps-before {cfg.steps_before} training at --lr "
        f"{cfg.lr:g}: {what}; lower --lr (or --steps-before)"
    )


def run_tune(cfg: TuneConfig, out: Path, say: Callable[[str], None] = print) -> Plan:
    """Build, optionally pre-train, tune and save the plan to ``out`` (module docstring)."""
    check_memory(cfg.batch_size, cfg.seq_len, cfg.width, cfg.depth, cfg.heads)
    data = CharData(cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    shape = ModelConfig(data.vocab_size, cfg.width, cfg.depth, cfg.heads, cfg.seq_len)
    model = build_model(cfg.model, shape)
    if cfg.steps_before:
        prepared = prepare(model, "bf16", lambda ps: torch.optim.AdamW(ps, lr=cfg.lr))
        warm = max(cfg.steps_before // 5, 1)
        for step in range(cfg.steps_before):
            lr = cfg.lr * min(1.0, (step + 1) / warm)
            loss = float(train_step(prepared, *data.batch("train", step), lr).loss.detach())
            if not math.isfinite(loss):
                raise _diverged(cfg, f"the loss was {loss} at step {step + 1}")
        model = prepared.model
    batches = [data.batch("train", cfg.steps_before + i) for i in range(cfg.batches)]
    if cfg.steps_before:  # weights that diverged give a NaN/Inf loss on the tuning batches
        with torch.no_grad():
            losses = [float(_loss(model, b)) for b in batches]
        if not all(math.isfinite(v) for v in losses):
            raise _diverged(cfg, f"the loss of the tuning batches is {losses}")
        say(f"trained {cfg.steps_before} steps in bf16 before measuring")
    plan = tune(
        model,
        batches,
        loss_fn=_loss,
        target=cfg.target,
        budget=cfg.budget,
        candidates=cfg.candidates,
        seed=cfg.seed,
        progress=say,
    )
    plan = replace(plan, model=cfg.model_flags())
    out.parent.mkdir(parents=True, exist_ok=True)
    plan.save(out)
    return plan


def plan_rows(plan: Plan) -> list[list[str]]:
    """One row per layer for the summary table: fqn, share of the FLOPs, the format of
    each GEMM, the worst operand SQNR (dB), the largest budget share of its GEMMs."""
    total = sum(float(d["flops"]) for d in plan.layers.values()) or 1.0
    rows = []
    for fqn, d in plan.layers.items():
        gemms = d["gemms"]
        sq = [g["sqnr_db"] for g in gemms.values() if g["format"] != "bf16" and g["sqnr_db"]]
        rows.append(
            [
                fqn,
                f"{100 * float(d['flops']) / total:.1f}%",
                *(str(gemms[g]["format"]) for g in ("forward", "input_grad", "weight_grad")),
                f"{min(sq):.1f}" if sq else "-",
                f"{max(float(g['error']) for g in gemms.values()):.3f}",
            ]
        )
    return rows
