"""Measuring how much each GEMM of each linear layer suffers in each candidate format.

A :class:`Probe` holds a deep copy of the model (the user's model is never touched), a few
batches and the loss function, and the *reference*: each batch's loss ``R_b`` and the
parameter gradients ``r`` of the mean loss, with every layer in the model's own precision.
:meth:`Probe.run` runs the batches again with some layers lowered (each swapped for a
:class:`~lowprec.float8.Float8Linear` sharing its parameters, put back afterwards) and
compares:

* ``loss_delta = mean_b |L_b − R_b| / mean_b R_b``: the relative change of the loss;
* ``grad_err2 = ‖g − r‖² / ‖r‖²``: the relative squared error of all parameter gradients.

A forward GEMM changes the loss and, through the activations, the gradients; the two
backward GEMMs leave the loss of the batch as it is and change only the gradients
(``input_grad`` those of every layer before it, ``weight_grad`` this layer's weight's).
:meth:`Probe.sensitivity` lowers one GEMM of one layer at a time (the others in
``high_precision_gemms``) and records, with :func:`lowprec.analysis.gemms.measure_gemms`,
what the GEMM's casts did: ``sqnr_db`` (the worse of its two operands) and ``rel_err``.

Against a budget (:class:`~lowprec.autopilot.plan.Budget`: ``loss`` a relative loss change,
``grad`` a relative gradient error) a measurement's *error* is the share of the budget it
uses, ``loss_delta / loss + grad_err2 / grad²``; squared gradient errors of independent
GEMMs add, and so, to first order, do loss changes.

Each batch runs after ``torch.manual_seed(seed + b)``, so dropout and any other randomness
repeat exactly between the reference and every run: the measurements are deterministic.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lowprec.analysis.gemms import measure_gemms
from lowprec.autopilot.cost import GEMMS, candidate_config, counting_flops, linear_layers
from lowprec.float8 import Float8Config
from lowprec.float8 import apply as float8_apply

__all__ = ["LossFn", "Measured", "Outcome", "Probe"]

LossFn = Callable[[nn.Module, Any], Tensor]


@dataclass(frozen=True)
class Outcome:
    """What a run with some layers lowered changed (module docstring)."""

    loss_delta: float
    grad_err2: float

    def error(self, loss_budget: float, grad_budget: float) -> float:
        """The share of the budget used: ``loss_delta / loss + grad_err2 / grad²``."""
        return self.loss_delta / loss_budget + self.grad_err2 / grad_budget**2


@dataclass(frozen=True)
class Measured:
    """One GEMM of one layer in one candidate, the rest of the model as it is."""

    loss_delta: float
    grad_err2: float
    sqnr_db: float | None
    rel_err: float | None

    def error(self, loss_budget: float, grad_budget: float) -> float:
        return Outcome(self.loss_delta, self.grad_err2).error(loss_budget, grad_budget)


class Probe:
    """A copy of ``model`` with its reference numbers on ``batches`` (module docstring).

    ``loss_fn(model, batch)`` returns the scalar loss of one batch. :attr:`flops` holds the
    FLOPs of each GEMM ``(fqn, gemm)`` on the batches (:func:`counting_flops`)."""

    def __init__(
        self, model: nn.Module, batches: Sequence[Any], loss_fn: LossFn, seed: int = 0
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a callable (model, batch) -> loss, got {loss_fn!r}")
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("batches: need at least one batch")
        self.loss_fn, self.seed = loss_fn, seed
        self.model = copy.deepcopy(model)
        self.model.train()
        self.layers = linear_layers(self.model)
        if not self.layers:
            raise ValueError("model: no nn.Linear (or HF Conv1D) layer to tune")
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        with counting_flops(self.model) as flops:
            self.ref_losses, self._ref_grads = self._run()
        self.flops = flops
        if not all(math.isfinite(v) for v in self.ref_losses):
            raise ValueError(f"loss_fn: the reference loss is not finite ({self.ref_losses})")
        self._ref_norm2 = sum(float(g.double().square().sum()) for g in self._ref_grads)
        if self._ref_norm2 == 0.0:
            raise ValueError("loss_fn: the reference gradients are all zero")

    @property
    def ref_loss(self) -> float:
        """The mean reference loss over the batches."""
        return sum(self.ref_losses) / len(self.ref_losses)

    def _run(self) -> tuple[list[float], list[Tensor]]:
        for p in self._params:
            p.grad = None
        losses = []
        n = len(self.batches)
        for i, b in enumerate(self.batches):
            torch.manual_seed(self.seed + i)
            loss = self.loss_fn(self.model, b)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise TypeError(f"loss_fn must return a scalar tensor, got {loss!r}")
            (loss.float() / n).backward()  # type: ignore[no-untyped-call]
            losses.append(float(loss.detach()))
        grads = [
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self._params
        ]
        for p in self._params:
            p.grad = None
        return losses, grads

    @contextlib.contextmanager
    def lowered(self, configs: Mapping[str, Float8Config]) -> Iterator[dict[str, nn.Module]]:
        """Inside the block the layers named in ``configs`` are float8 layers with those
        configs (sharing the parameters); yields them by name."""
        mods = dict(self.model.named_modules())
        done: list[tuple[nn.Module, str, nn.Module]] = []
        new: dict[str, nn.Module] = {}
        try:
            for fqn, cfg in configs.items():
                if fqn not in self.layers:
                    raise ValueError(f"configs: {fqn!r} is not a linear layer of the model")
                parent, _, name = fqn.rpartition(".")
                owner = mods[parent]
                old = getattr(owner, name)
                new[fqn] = float8_apply(old, cfg)
                setattr(owner, name, new[fqn])
                done.append((owner, name, old))
            yield new
        finally:
            for owner, name, old in reversed(done):
                setattr(owner, name, old)

    def compare(
        self,
        losses: Sequence[float],
        grads: Sequence[Tensor],
        only: Sequence[int] | None = None,
        skip: Sequence[int] = (),
    ) -> Outcome:
        """The :class:`Outcome` of a run's losses and gradients against the reference;
        ``grad_err2`` over the parameters of indices ``only`` (default all) less ``skip``,
        relative to the norm of all reference gradients."""
        keep = set(range(len(grads)) if only is None else only) - set(skip)
        diffs = [abs(a - b) for a, b in zip(losses, self.ref_losses, strict=True)]
        if not all(math.isfinite(d) for d in diffs):
            return Outcome(math.inf, math.inf)
        err2 = sum(
            float((g.double() - r.double()).square().sum())
            for i, (g, r) in enumerate(zip(grads, self._ref_grads, strict=True))
            if i in keep
        )
        err2 = err2 / self._ref_norm2 if math.isfinite(err2) else math.inf
        return Outcome(sum(diffs) / len(diffs) / abs(self.ref_loss), err2)

    def run(self, configs: Mapping[str, Float8Config]) -> Outcome:
        """Run the batches with the layers of ``configs`` lowered; compare."""
        with self.lowered(configs):
            return self.compare(*self._run())

    def measure(self, fqn: str, candidate: str) -> dict[str, Measured]:
        """Each GEMM of layer ``fqn`` lowered to ``candidate`` alone: ``{gemm: Measured}``
        (``bf16``: nothing changes, all zeros). Two runs: the forward GEMM alone; then
        both backward GEMMs, whose gradient errors separate exactly: ``weight_grad``
        changes only this layer's weight gradient, ``input_grad`` only the gradients of
        the parameters before the layer (a weight used by several layers blurs this)."""
        cfg = candidate_config(candidate)
        if cfg is None:
            return dict.fromkeys(GEMMS, Measured(0.0, 0.0, math.inf, 0.0))
        fwd = cfg.replace(high_precision_gemms=("input_grad", "weight_grad"))
        bwd = cfg.replace(high_precision_gemms=("forward",))
        out: dict[str, Measured] = {}
        for c, gemms in ((fwd, ("forward",)), (bwd, ("input_grad", "weight_grad"))):
            with self.lowered({fqn: c}) as new, measure_gemms(new[fqn], every=1) as rec:
                losses, grads = self._run()
                weight = new[fqn].weight
            cast = _cast_numbers(rec.records)
            if gemms == ("forward",):
                o = self.compare(losses, grads)
                out["forward"] = Measured(o.loss_delta, o.grad_err2, *cast["forward"])
                continue
            own = [i for i, p in enumerate(self._params) if p is weight]
            wg = self.compare(losses, grads, only=own)
            rest = self.compare(losses, grads, skip=own)
            out["input_grad"] = Measured(0.0, rest.grad_err2, *cast["input_grad"])
            out["weight_grad"] = Measured(0.0, wg.grad_err2, *cast["weight_grad"])
        return out

    def sensitivity(
        self, candidates: Sequence[str], progress: Callable[[str], None] | None = None
    ) -> dict[tuple[str, str], dict[str, Measured]]:
        """:meth:`measure` for every GEMM of every layer in every candidate:
        ``{(fqn, gemm): {candidate: Measured}}``; ``progress(fqn)`` after each layer."""
        out: dict[tuple[str, str], dict[str, Measured]] = {}
        for fqn in self.layers:
            per = {c: self.measure(fqn, c) for c in candidates}
            for g in GEMMS:
                out[(fqn, g)] = {c: per[c][g] for c in candidates}
            if progress is not None:
                progress(fqn)
        return out


def _cast_numbers(
    records: Sequence[dict[str, Any]],
) -> dict[str, tuple[float | None, float | None]]:
    """``{gemm: (sqnr_db, rel_err)}`` of measure_gemms' records: the worst operand SQNR
    and the mean relative error over the batches (``None`` where nothing was cast)."""
    out: dict[str, tuple[float | None, float | None]] = {}
    for g in GEMMS:
        recs = [r for r in records if r["gemm"].split("#")[0] == g]
        sq = [
            op["sqnr_db"]
            for r in recs
            for op in r["operands"].values()
            if op["sqnr_db"] is not None and not op["high_precision"]
        ]
        errs = [r["rel_err"] for r in recs if r["rel_err"] is not None]
        hp = all(op["high_precision"] for r in recs for op in r["operands"].values())
        out[g] = (
            min(sq) if sq else None,
            None if hp or not errs else sum(errs) / len(errs),
        )
    return out
