"""The demo's judgement: each recipe's reference and verdict, and its two tables.

A recipe's reference is the set's high-precision run of its kind
(:func:`lowprec.analysis.verdicts.is_reference_recipe`): ``fp32``, or ``fp32-unit`` for a
unit-scaled recipe; :func:`with_references` adds them to a set that lacks them, so that no
low-precision recipe is ever judged against another.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from lowprec.analysis.verdicts import (
    REFERENCE,
    as_reason,
    is_reference_recipe,
    own_verdict,
    reference_of,
    skipped_tail,
    verdict,
)
from lowprec.jobs.run_summary import share_cell
from lowprec.jobs.train import TrainConfig
from lowprec.recipes import get_recipe

__all__ = [
    "TOLERANCE_SIGMAS",
    "judge",
    "reference",
    "results_table",
    "spread_table",
    "with_references",
]

TOLERANCE_SIGMAS = 2.0  # a gap within this many seed standard deviations is noise


def is_reference(recipe: str) -> bool:
    """Whether the preset ``recipe`` trains in high precision (a reference)."""
    return is_reference_recipe(get_recipe(recipe).to_dict(), recipe)


def reference(recipe: str, available: Sequence[str]) -> str | None:
    """The reference of ``recipe`` among ``available`` (``None`` for a reference itself,
    or when there is none)."""
    if is_reference(recipe):
        return None
    refs = [(r, get_recipe(r).unit is not None) for r in available if is_reference(r)]
    return reference_of(get_recipe(recipe).unit is not None, refs)


def with_references(recipes: Sequence[str]) -> list[str]:
    """``recipes`` (duplicates dropped) with their references added in front where the set
    lacks them: ``fp32`` for a recipe that is not unit-scaled, ``fp32-unit`` for a
    unit-scaled one. A low-precision recipe is never the reference.

    Example:
        >>> with_references(["fp8-naive", "fp8-unit"])
        ['fp32', 'fp32-unit', 'fp8-naive', 'fp8-unit']
    """
    for r in recipes:
        get_recipe(r)  # unknown names fail here, listing the valid ones
    names = list(dict.fromkeys(recipes))
    need = []
    for r in names:
        if not is_reference(r):
            need.append("fp32-unit" if get_recipe(r).unit is not None else "fp32")
    return [n for n in dict.fromkeys(need) if n not in names] + names


def judge(results: list[dict[str, Any]], tolerance: dict[str, float]) -> None:
    """Add each result's ``reference``, gaps and ``verdict`` (in place). A run is first
    judged by itself (:func:`own_verdict`: diverged, its loss curve); a reference that
    passes is :data:`REFERENCE`; the others are judged against their reference's val loss,
    or not judged where the reference itself fails or was not judged."""
    val = {s["recipe"]: s["val_loss"] for s in results}
    own = {s["recipe"]: text for s in results if (text := own_verdict(s)) is not None}
    for s in results:
        ref = reference(s["recipe"], list(val))
        s["reference"] = ref
        for key, name in (("val_gap_to_fp32", "fp32"), ("val_gap_to_ref", ref)):
            v, r = s["val_loss"], val.get(name or s["recipe"])
            ok = r is not None and math.isfinite(v) and math.isfinite(r)
            s[key] = v / r - 1.0 if ok else None
        n = s["skipped_steps"]
        if s["recipe"] in own:
            s["verdict"] = own[s["recipe"]]
        elif is_reference(s["recipe"]):  # (a diverged one is in own)
            s["verdict"] = REFERENCE + skipped_tail(n)
        elif ref is not None and ref in own:
            s["verdict"] = f"not judged: its reference {ref} {as_reason(own[ref])}"
        else:
            s["verdict"] = verdict(
                s["val_gap_to_ref"], ref, tolerance.get(ref or ""),
                underflow=s["act_grad_underflow"], skipped=n,
            )  # fmt: skip


def pct(g: float | None) -> str:
    return "-" if g is None or not math.isfinite(g) else f"{100 * g:+.2f}%"


def results_table(
    results: list[dict[str, Any]],
    cfg: TrainConfig,
    seconds: float,
    tolerance: dict[str, float],
    seeds: Sequence[int] | None = None,
) -> Table:
    """The demo's table: a row per result (of the seed ``cfg.seed``); the title names the
    configuration and the seeds trained (``seeds``, default ``cfg.seed`` alone), saying
    which seed the rows show when there are several."""
    spread = ", ".join(f"±{100 * t:.2f}% vs {r}" for r, t in tolerance.items()) or "not measured"
    shown = list(seeds or [cfg.seed])
    which = (
        f"seed {cfg.seed}"
        if shown == [cfg.seed]
        else f"seeds {' '.join(map(str, shown))} (rows: seed {cfg.seed})"
    )
    table = Table(
        title=(
            f"lowprec demo: {cfg.steps} steps, batch {cfg.batch_size}x{cfg.seq_len}, "
            f"width {cfg.width}, depth {cfg.depth}, lr {cfg.lr}, {which} "
            f"({seconds:.0f} s)"
        ),
        caption=f"seed spread of the gap ({TOLERANCE_SIGMAS:g} sd over seeds): {spread}",
    )
    cols = (
        "recipe",
        "val loss",
        "gap to fp32",
        "gap to ref",
        "act-grad underflow",
        "skipped",
        "ms/step",
        "verdict",
    )
    width = max(len(s["recipe"]) for s in results)
    for col in cols:
        if col == "recipe":  # never wrapped or cut: the name is what a reader looks for
            table.add_column(col, no_wrap=True, min_width=width)
        elif col == "verdict":
            table.add_column(col, min_width=30)
        else:
            table.add_column(col, justify="right")
    for s in results:
        ms = s["steady_ms"]
        ref = s["reference"]
        table.add_row(
            s["recipe"],
            f"{s['val_loss']:.4f}",
            pct(s["val_gap_to_fp32"]),
            "-" if ref in (None, "fp32") else f"{pct(s['val_gap_to_ref'])} ({ref})",
            share_cell(s["act_grad_underflow"], 1),
            str(s["skipped_steps"]),
            ("-" if not math.isfinite(ms) else f"{ms:.0f}")
            + (" emulated" if s["emulated"] else ""),
            s["verdict"],
        )
    return table


def spread_table(
    recipes: Sequence[str], seeds: Sequence[int], val: dict[str, list[float]]
) -> Table:
    table = Table(title="val loss per seed, and the gap to fp32 / fp32-unit (paired by seed)")
    for col in ("recipe", *(f"seed {s}" for s in seeds), "gap per seed", "gap sd"):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    for r in recipes:
        ref = reference(r, recipes)
        gaps = [v / b - 1 for v, b in zip(val[r], val[ref], strict=True)] if ref else []
        ok = len(gaps) > 1 and all(map(math.isfinite, gaps))
        table.add_row(
            r,
            *(f"{v:.4f}" for v in val[r]),
            " ".join(pct(g) for g in gaps) or "-",
            f"{100 * statistics.stdev(gaps):.2f}%" if ok else "-",
        )
    return table
