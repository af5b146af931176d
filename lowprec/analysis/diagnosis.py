"""Plain-language diagnosis of a training run's numerics.

A :class:`Run` is what a run directory holds (``config.json``, the metrics records, their
summary, the :mod:`lowprec.analysis.tracking` records and the per-GEMM records of
:mod:`lowprec.analysis.gemms`); :func:`diagnose` turns it into findings, most important
first, that agree with the run's verdict (:mod:`lowprec.analysis.verdicts`): a run whose
verdict fails is never called healthy, and its finding names the layer, GEMM and operand
whose measured cast explains it.

Every tensor is judged in the format it passed through, never in one it did not: the
tracked tensors in the run's storage format (:attr:`Run.compute_format`), the operands of
the low-precision GEMMs by what their casts measurably did (flushed to zero, saturated,
SQNR). The thresholds: a gradient with :data:`UNDERFLOW_ALERT` of its values below its
format's smallest normal underflows, and so does a GEMM operand with that share flushed
to zero; a tensor with :data:`OVERFLOW_ALERT` of its values above its format's max
overflows, and so does an operand with that share saturated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowprec.analysis.tracking import BACKWARD_KINDS, KINDS
from lowprec.analysis.verdicts import (
    FAIL_GAP,
    NOT_JUDGED,
    failing,
    gap_spread,
    is_reference_recipe,
    percent,
    reference_of,
    verdict,
)
from lowprec.core.formats import get_format

__all__ = [
    "FAIL_GAP",
    "KIND_TEXT",
    "OVERFLOW_ALERT",
    "UNDERFLOW_ALERT",
    "Run",
    "diagnose",
    "gap_spread",
    "gemm_findings",
    "judged_formats",
    "reference_of",
    "techniques",
    "verdict",
    "worst",
    "worst_overflow",
]

KIND_TEXT = {
    "input": "inputs",
    "output": "activations",
    "weight": "weights",
    "grad_output": "activation gradients",
    "weight_grad": "weight gradients",
}
UNDERFLOW_ALERT = 0.25  # share of a tensor below a format's smallest normal
OVERFLOW_ALERT = 1e-4  # share above a format's max


@dataclass
class Run:
    """A loaded run directory."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    numerics: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""  # the name shown; write_report makes it unique among the runs
    gemms: list[dict[str, Any]] = field(default_factory=list)  # gemms.jsonl
    moves: list[dict[str, Any]] = field(default_factory=list)  # guard.jsonl

    @property
    def name(self) -> str:
        return self.label or self.path.name

    @property
    def planned_steps(self) -> int | None:
        steps = self.config.get("train", {}).get("steps")
        return int(steps) if isinstance(steps, int) else None

    @property
    def stopped_early(self) -> bool:
        planned = self.planned_steps
        return planned is not None and int(self.summary.get("steps", 0)) < planned

    @property
    def recipe(self) -> str:
        return str(self.config.get("train", {}).get("recipe", "?"))

    @property
    def recipe_dict(self) -> dict[str, Any]:
        rec = self.config.get("recipe")
        return rec if isinstance(rec, dict) else {}

    @property
    def is_reference(self) -> bool:
        """Whether the run trains in high precision (:func:`is_reference_recipe`)."""
        return is_reference_recipe(self.recipe_dict, self.recipe)

    @property
    def formats(self) -> list[str]:
        first = self.numerics[0] if self.numerics else {}
        return list(first.get("below_normal", {}))

    @property
    def float8(self) -> str | None:
        """The float8 preset of the run's recipe, if any."""
        rec = self.recipe_dict
        if rec.get("float8") is not None:  # the flat recipe dict of lowprec 0.1
            return str(rec["float8"])
        for t in rec.get("technique") or ():  # [{"technique": kind, "config": {...}}, ...]
            if isinstance(t, dict) and t.get("technique") == "float8":
                return str(t.get("config", {}).get("name") or "float8")
        return None

    @property
    def tracked_steps(self) -> list[int]:
        return sorted({int(r["step"]) for r in self.numerics})

    @property
    def compute_format(self) -> str:
        """The format the run's activations and gradients are stored in (scalify: its
        data format's FP16, which holds everything but the FP8 matmul operands)."""
        rec = self.recipe_dict
        for t in rec.get("technique") or ():
            if isinstance(t, dict) and t.get("technique") == "scalify":
                return "fp16"
        if rec.get("scalify_format"):  # flat
            return "fp16"
        return str(rec.get("autocast") or rec.get("param_dtype") or "fp32")


def worst(
    run: Run,
    step: int,
    measure: str,
    kinds: Sequence[str] | None = None,
    formats: Sequence[str] | None = None,
    own: bool = False,
) -> list[tuple[float, str, dict[str, Any]]]:
    """(share, format, record) of ``measure`` at ``step``, largest first; ``own``: each
    tensor only in the format it is stored in (:func:`own_format`)."""
    out = []
    for r in run.numerics:
        if r["step"] != step or (kinds is not None and r["kind"] not in kinds):
            continue
        mine = own_format(r) if own else None
        for fmt, share in r[measure].items():
            if (formats is None or fmt in formats) and (not own or fmt == mine):
                out.append((float(share), fmt, r))
    return sorted(out, key=lambda t: -t[0])


def own_format(record: Mapping[str, Any]) -> str | None:
    """The format a tracked tensor is stored in (its record's ``dtype``: a ScaledTensor's
    payload), ``None`` if that is no format lowprec names."""
    dtype = getattr(torch, str(record.get("dtype", "")), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return None
    try:
        return get_format(dtype).name
    except (ValueError, TypeError):
        return None


def judged_formats(run: Run, backward: bool = False) -> list[str]:
    """The formats a run's tracked tensors are judged in: each tensor in the one it is
    stored in (:func:`own_format`), where the tracker measured that format. Never a format
    it did not pass through: a GEMM's FP8/FP4 casts are judged by what they measurably did
    (:func:`gemm_findings`). ``backward``: the formats of the gradients only."""
    kinds = BACKWARD_KINDS if backward else KINDS
    fmts = [own_format(r) for r in run.numerics if r["kind"] in kinds]
    return [f for f in dict.fromkeys(fmts) if f is not None and f in run.formats]


def worst_overflow(run: Run, step: int) -> list[tuple[float, str, dict[str, Any]]]:
    """Overflow shares at ``step``, each tensor in the format it is stored in, largest
    first."""
    return worst(run, step, "above_max", KINDS, own=True)


# ---- the low-precision GEMMs: what their casts did ---------------------------------------

_GEMM_TEXT = {
    "forward": "forward GEMM (x·Wᵀ)",
    "input_grad": "input-gradient GEMM (g·W)",
    "weight_grad": "weight-gradient GEMM (gᵀ·x)",
}
_ROLE_TEXT = {"input": "inputs", "weight": "weights", "grad_output": "gradients"}


def _gemm_text(gemm: str) -> str:
    base, _, k = gemm.partition("#")
    return _GEMM_TEXT.get(base, f"{base} GEMM") + (f" (call {k})" if k else "")


def _scale_text(op: dict[str, Any]) -> str:
    n, lo, hi = op.get("n_scales"), op.get("scale_min"), op.get("scale_max")
    if not n or lo is None or hi is None:
        return "no cast"
    if n == 1:
        return f"scale {lo:.3g}"
    return f"{n} scales in [{lo:.3g}, {hi:.3g}]"


def gemm_operands(
    run: Run, step: int | None = None
) -> list[tuple[dict[str, Any], str, dict[str, Any]]]:
    """``(record, role, operand)`` of every cast (low-precision) GEMM operand measured at
    ``step`` (default: the last measured step)."""
    if not run.gemms:
        return []
    at = max(int(r["step"]) for r in run.gemms) if step is None else step
    return [
        (r, role, op)
        for r in run.gemms
        if r["step"] == at
        for role, op in r["operands"].items()
        if not op.get("high_precision")
    ]


def gemm_findings(run: Run) -> list[str]:
    """Findings about the run's low-precision GEMMs at the last measured step, worst first:
    the operand with the largest flushed share (at least :data:`UNDERFLOW_ALERT`), the one
    with the largest saturated share (at least :data:`OVERFLOW_ALERT`), each naming its
    layer, GEMM, format and scale and counting the others; else the lowest SQNR."""
    ops = gemm_operands(run)
    if not ops:
        return []
    step = int(ops[0][0]["step"])
    out = []
    for measure, alert, what in (
        ("flushed", UNDERFLOW_ALERT, "flushed to zero"),
        ("saturated", OVERFLOW_ALERT, "saturated (clamped to the format's max)"),
    ):
        bad = sorted(
            (t for t in ops if float(t[2].get(measure) or 0.0) >= alert),
            key=lambda t: -float(t[2][measure]),
        )
        if not bad:
            continue
        r, role, op = bad[0]
        sq = op.get("sqnr_db")
        sq_text = (
            f", SQNR {sq:.1f} dB" if isinstance(sq, (int, float)) and math.isfinite(sq) else ""
        )
        more = f"; {len(bad) - 1} more of the {len(ops)} cast operands too" if len(bad) > 1 else ""
        out.append(
            f"In {r['layer']}'s {_gemm_text(r['gemm'])}, {percent(op[measure])} of the "
            f"{_ROLE_TEXT.get(role, role)} were {what} by the cast to {op['format'].upper()} "
            f"({_scale_text(op)}{sq_text}) at step {step}{more}."
        )
    if not out:
        finite = [t for t in ops if isinstance(t[2].get("sqnr_db"), (int, float))]
        if finite:
            r, role, op = min(finite, key=lambda t: float(t[2]["sqnr_db"]))
            out.append(
                f"The low-precision GEMMs' casts flush and saturate little at step {step}; the "
                f"noisiest is {r['layer']}'s {_gemm_text(r['gemm'])}: its "
                f"{_ROLE_TEXT.get(role, role)} in {op['format'].upper()} ({_scale_text(op)}) "
                f"at SQNR {float(op['sqnr_db']):.1f} dB."
            )
    return out


def _power_text(scale: float) -> str:
    e = math.log2(scale) if scale > 0 and math.isfinite(scale) else 0.5
    return f"2^{e:.0f}" if e == int(e) else f"{scale:g}"


def _loss_scale_overflow(run: Run, gone: Sequence[Mapping[str, Any]]) -> str:
    """Why NaN/Inf gradients of a loss-scaled run are the scale's doing (``""`` if they
    may not be): every NaN/Inf tensor is a gradient (no weight or activation went
    NaN/Inf, so nothing diverged) and the run's loss scaler skipped steps, so no update
    was applied on them: the loss, times the scale, overflowed the gradients' format."""
    scaling = run.recipe_dict.get("loss_scaling")
    skipped = [m for m in run.metrics if m.get("skipped")]
    if scaling in (None, "none") or not skipped:
        return ""
    if any(r["kind"] not in BACKWARD_KINDS for r in gone):
        return ""
    scale = skipped[-1].get("loss_scale", run.recipe_dict.get("loss_scale"))
    if not isinstance(scale, (int, float)):
        return ""
    fmt = run.compute_format
    steps = len(run.metrics)
    share = f"all {steps}" if len(skipped) == steps else f"{len(skipped)} of the {steps}"
    cure = (
        "lower the loss scale, or use dynamic loss scaling, which backs off"
        if scaling == "static"
        else "the dynamic scaler backs off on each skipped step; a lower initial loss scale "
        "skips fewer"
    )
    return (
        f", and the loss scaler skipped {share} steps (no update applied): the {scaling} "
        f"loss scale {_power_text(float(scale))} made the scaled gradients overflow "
        f"{fmt.upper()} (max {get_format(fmt).max:g}) to Inf, which is why they are NaN/Inf; "
        f"{cure}."
    )


def diagnose(run: Run, verdict_text: str | None = None) -> list[str]:
    """Plain-language findings about ``run``, most important first.

    ``verdict_text``: the run's verdict (:func:`summary_verdicts`), which leads; with a
    failing verdict the run is never called healthy, and the measured cause follows it.
    The tracked tensors are judged in the run's storage format; the low-precision GEMMs by
    their measured casts (:func:`gemm_findings`). One finding per measure names the worst
    tensor and counts the others past the threshold.
    """
    notes: list[str] = []
    s = run.summary
    fails = s.get("diverged_at") is not None or (verdict_text is not None and failing(verdict_text))
    if verdict_text is not None:
        notes.append(f"Verdict: {verdict_text}.")
    if s.get("diverged_at") is not None:
        what = str(s.get("diverged_cause"))
        if "loss" in what and run.recipe_dict.get("loss_scaling") in ("dynamic", "static"):
            what = "scaled loss"  # loss scaling is there already: it does not cure this
        notes.append(_DIVERGED.get(what, _DIVERGED["loss"]).format(step=s["diverged_at"]))
    if run.stopped_early and s.get("diverged_at") is None:
        notes.append(
            f"The run stopped at step {s.get('steps')} of {run.planned_steps} (interrupted?): "
            "its numbers are not final; `lowprec train --resume` continues it exactly."
        )
    if s.get("skipped_steps"):
        n, scaling = int(s["skipped_steps"]), run.recipe_dict.get("loss_scaling")
        if scaling == "dynamic" and s.get("diverged_at") is not None:
            text = (
                f"The loss scaler skipped {n} step(s) with Inf/NaN gradients, and the run "
                "diverged all the same: where the loss itself is NaN/Inf (the forward "
                "overflows, or the weights did), no loss scale cures it."
            )
        elif scaling == "dynamic":
            text = (
                f"The loss scaler skipped {n} step(s) with Inf/NaN gradients (expected while "
                "a dynamic loss scale finds its level)."
            )
        elif scaling == "static":
            text = (
                f"The loss scaler skipped {n} step(s) with Inf/NaN gradients: the static loss "
                "scale is too high for them (a dynamic one backs off)."
            )
        else:
            stopped = s.get("diverged_at") is not None and run.stopped_early
            text = (
                f"{n} step(s) had Inf/NaN gradients and were not applied"
                + ("; the run stopped at the last" if stopped else " (`--on-nonfinite skip`)")
                + ": the recipe has no loss scaling."
            )
        notes.append(text)
    if run.moves:
        mv = run.moves[-1]
        notes.append(
            f"The guard moved {len(run.moves)} layer(s) to safer formats during training "
            f"(the last after step {mv['step']}: {mv['layer']} from {mv['frm']} to "
            f"{mv['to']}, {mv['reason']}); the findings below describe the run as it ended."
        )
    found = gemm_findings(run)
    cause = bool(found) and not found[0].startswith("The low-precision GEMMs' casts flush")
    if fails and found:
        found[0] = ("The measured cause: " if cause else "") + found[0]
    notes += found
    if not run.numerics and not run.gemms:
        notes.append("No numerics were recorded for this run (no numerics.jsonl).")
        if fails:
            notes.append("The run fails, and no measurement of its numerics explains why.")
        return notes
    own = run.compute_format
    last = run.tracked_steps[-1] if run.numerics else None
    at = s.get("diverged_at")
    gap = int(at) - last if at is not None and last is not None else 0
    stale = gap > 1
    if stale:
        notes.append(
            f"The numerics were last measured at step {last}, {gap} steps before "
            f"the run diverged at step {at}: the measurements below describe the run then, "
            "not where it failed."
        )
    gone = sorted(
        ((float(r.get("nonfinite") or 0.0), r) for r in run.numerics
         if r["step"] == last and r["kind"] in KINDS and (r.get("nonfinite") or 0.0) > 0),
        key=lambda t: -t[0],
    )  # fmt: skip
    if gone and last is not None:
        cause = True
        notes.append(_nonfinite_origin(run, last, [t[1] for t in gone]))
    for fmt in judged_formats(run) if last is not None else ():
        assert last is not None
        bad = worst(run, last, "below_normal", BACKWARD_KINDS, [fmt], own=True)
        bad = [t for t in bad if t[0] >= UNDERFLOW_ALERT]
        if bad:
            cause = cause or not stale  # measured long before the failure: not its cause
            share, _, r = bad[0]
            n_grads = len(
                {(x["name"], x["kind"]) for x in run.numerics if x["step"] == last}
                & {(x["name"], x["kind"]) for x in run.numerics if x["kind"] in BACKWARD_KINDS}
            )
            more = (
                f" ({len(bad) - 1} more of the {n_grads} gradient tensors too)"
                if len(bad) > 1
                else ""
            )
            notes.append(
                f"{percent(share)} of the {KIND_TEXT[r['kind']]} of {r['name']} underflow in "
                f"{fmt} (below its smallest normal, {get_format(fmt).min_normal:.3g}) at step "
                f"{last}{more}: use loss scaling or unit scaling."
            )
        over = [  # NaN/Inf values are counted above the max; reported above as NaN/Inf
            (t[0] - float(t[2].get("nonfinite") or 0.0), t[1], t[2])
            for t in worst_overflow(run, last)
            if t[1] == fmt
        ]
        over = sorted((t for t in over if t[0] >= OVERFLOW_ALERT), key=lambda t: -t[0])
        if over:
            cause = cause or not stale
            share, _, r = over[0]
            notes.append(
                f"{percent(share)} of the {KIND_TEXT[r['kind']]} of {r['name']} overflow "
                f"{fmt} (above {get_format(fmt).max:g}) at step {last}: scale them "
                "(loss scaling, float8 scaling) or keep them in a wider format."
            )
    where = f" at step {last}" if last is not None else ""
    checked = f" in {', '.join(judged_formats(run)) or own}" if last is not None else ""
    if fails and not cause and stale:
        notes.append(
            f"Nothing measured{where} explains a failure {gap} steps later: "
            "look at the loss curves and the learning rate (and measure the numerics more "
            "often to see the failure itself)."
        )
    elif fails and not cause:
        notes.append(
            f"No measured underflow or overflow{checked}{where} and no GEMM cast that flushes or "
            "saturates explains the failure: look at the loss curves and the learning rate."
        )
    elif not fails and not cause:
        tail = ""
        if verdict_text is not None and verdict_text.startswith("no reference"):
            tail = "; without a reference run the loss itself is not judged"
        elif verdict_text is not None and verdict_text.startswith(NOT_JUDGED):
            tail = "; trained with other settings than its reference, its loss is not judged"
        elif verdict_text is not None and verdict_text.startswith("not judged"):
            tail = f"; its loss is not judged ({verdict_text.partition(': ')[2]})"
        notes.append(
            f"Healthy{where}: no gradient has {100 * UNDERFLOW_ALERT:.0f}% of its values below "
            f"the smallest normal and nothing overflows{checked}, and no low-precision GEMM "
            f"cast flushes {100 * UNDERFLOW_ALERT:.0f}% or saturates{tail}."
        )
    return notes


def _nonfinite_origin(run: Run, step: int, gone: Sequence[Mapping[str, Any]]) -> str:
    """Where the NaN/Inf values of ``step`` come from, as one finding. ``gone``: the tracked
    tensors of that step with NaN/Inf values. A NaN/Inf weight leads (an update made it
    so: the weights diverged); else the records are in the order the step computed them
    (forward, then backward), so the first is the origin: an activation of the forward
    (an operation of the forward exceeded the storage format's range, which no loss scale
    changes), or a gradient while the forward is finite (the backward overflowed, or the
    loss scale did: :func:`_loss_scale_overflow`)."""
    recs = [r for r in run.numerics if r["step"] == step and r["kind"] in KINDS]
    weights = [r for r in recs if r["kind"] == "weight" and (r.get("nonfinite") or 0.0) > 0]
    # a NaN/Inf weight came from an update, before this step's forward: it leads
    first = weights[0] if weights else next(r for r in recs if (r.get("nonfinite") or 0.0) > 0)
    share = float(first.get("nonfinite") or 0.0)
    more = f" ({len(gone) - 1} more tensors too)" if len(gone) > 1 else ""
    what = (
        f"NaN/Inf first appear in the {KIND_TEXT[first['kind']]} of {first['name']} "
        f"({percent(share)} of them) at step {step}{more}"
    )
    fmt = run.compute_format
    if first["kind"] in ("input", "output"):  # (every weight finite)
        i = recs.index(first)
        prev = next((r for r in reversed(recs[:i]) if r["kind"] in ("input", "output")), None)
        after = (
            f", computed from the finite {KIND_TEXT[prev['kind']]} of {prev['name']}"
            if prev
            else ""
        )
        rng = get_format(fmt).max
        if rng < 1e38:  # a narrow format: the forward's values exceeded it
            return (
                f"{what}{after}, while every weight is finite: an operation of the forward "
                f"exceeded {fmt.upper()}'s range (max {rng:g}), for example attention "
                "scores q·kᵀ. A loss scale does not change the forward: lower the learning "
                "rate, or run that operation in FP32 or BF16."
            )
        return (
            f"{what}{after}, while every weight is finite: the forward's values diverged "
            f"beyond {fmt.upper()}'s range. Lower the learning rate."
        )
    if first["kind"] in BACKWARD_KINDS:
        scaled = _loss_scale_overflow(run, gone)
        if scaled:
            return what + scaled
        return (
            f"{what}, the forward finite: the backward overflowed {fmt.upper()} (max "
            f"{get_format(fmt).max:g}). Use loss scaling with skipped steps (dynamic backs "
            "off), or lower the learning rate."
        )
    return (
        f"{what}: the weights themselves diverged (an optimizer update made them NaN/Inf). "
        "Lower the learning rate, or keep FP32 master weights."
    )


def techniques(run: Run) -> list[str]:
    """The technique kinds of the run's recipe (``"unit"``, ``"float8"``, ``"scalify"``)."""
    rec = run.recipe_dict
    kinds = [str(t.get("technique")) for t in rec.get("technique") or () if isinstance(t, dict)]
    return kinds + [k for k in ("float8", "unit_fp8", "scalify_format") if rec.get(k)]


# What a run that diverged is told, by what became NaN/Inf (summary "diverged_cause").
_DIVERGED = {
    "loss": (
        "The loss became NaN/Inf at step {step}: the run diverged. Look for overflow below, "
        "lower the learning rate, or use loss scaling with skipped steps."
    ),
    "scaled loss": (
        "The loss became NaN/Inf at step {step}: the run diverged, its loss scaling "
        "notwithstanding (a NaN/Inf loss is the forward's, which no loss scale cures). Look "
        "for overflow below and lower the learning rate."
    ),
    "gradients": (
        "The gradients were Inf/NaN at every step up to step {step} while the loss stayed "
        "finite: each step was skipped, and the run stopped after too many in a row. A "
        "loss scale too high for them overflows the scaled gradients (see the skipped steps "
        "below)."
    ),
    "weights": (
        "The weights became NaN/Inf in the update before step {step}: an optimizer step on "
        "finite gradients overflowed the parameters' format, and no skipped step can undo "
        "it. Lower the learning rate or keep FP32 master weights."
    ),
}
_DIVERGED["loss and gradients"] = _DIVERGED["loss"]
