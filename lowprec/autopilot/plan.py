"""The autopilot's result: :class:`Plan` (a per-layer, per-GEMM :class:`~lowprec.Recipe`
with the measurements behind it) and :class:`Budget` (how much error the plan may add).

A plan's JSON (:meth:`Plan.to_dict`, written by :meth:`Plan.save` atomically in strict JSON,
:mod:`lowprec._json`) is what ``lowprec tune --out plan.json`` writes and ``lowprec train
--recipe plan.json`` reads::

    {"kind": "lowprec-plan", "version": 1, "target": "b200", "cost": 0.41,
     "budget": {"loss": 0.005, "grad": 0.05}, "seed": 0, "reference_loss": 4.2,
     "measured": {"loss_delta": ..., "grad_err": ..., "error": ...},
     "candidates": [...], "moved": [...], "model": "--model reference --width 128 ...",
     "layers": {"blocks.0.fc": {"format": "nvfp4", "flops": ..., "gemms": {
         "forward": {"format": "nvfp4", "flops": ..., "loss_delta": ..., "grad_err": ...,
                     "sqnr_db": ..., "rel_err": ..., "error": ...,
                     "fallbacks": ["fp8-rowwise", "bf16"]}, ...}}},
     "recipe": {... Recipe.to_dict() ...}}
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowprec._json import dumps, loads
from lowprec.autopilot.cost import CANDIDATES, check_target
from lowprec.recipes import Recipe

__all__ = ["DEFAULT_BUDGET", "KIND", "Budget", "Plan"]

KIND = "lowprec-plan"
VERSION = 1
GRAD_PER_LOSS = 10.0  # a float budget b is Budget(loss=b, grad=GRAD_PER_LOSS · b)


def _positive(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Budget:
    """The error a plan may add, measured on the tuning batches against the model in its
    own precision: ``loss``, the relative change of the loss ``|L − R| / R`` (forward
    GEMMs), and ``grad``, the relative error ``‖g − r‖ / ‖r‖`` of the parameter gradients
    (all GEMMs). A plan's error ``loss_delta / loss + grad_err² / grad²`` must stay ≤ 1.

    :meth:`of` reads a float ``b`` as ``Budget(loss=b, grad=10·b)``."""

    loss: float = 0.005
    grad: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss", _positive("budget.loss", self.loss))
        object.__setattr__(self, "grad", _positive("budget.grad", self.grad))

    @classmethod
    def of(cls, budget: Budget | float | None) -> Budget:
        """``budget`` as a :class:`Budget` (``None``: :data:`DEFAULT_BUDGET`)."""
        if budget is None:
            return DEFAULT_BUDGET
        if isinstance(budget, Budget):
            return budget
        b = _positive("budget", budget)
        return cls(loss=b, grad=GRAD_PER_LOSS * b)


DEFAULT_BUDGET = Budget()


@dataclass(frozen=True)
class Plan:
    """What :func:`lowprec.tune` chose and why.

    Attributes:
        recipe: the :class:`~lowprec.Recipe` to train with (BF16 parameters with FP32
            master weights; one :class:`~lowprec.recipes.layers.LayerRule` per linear
            layer, its float8 config per GEMM, ``None`` where every GEMM stays BF16).
        cost: the modelled GEMM time relative to all-BF16 on ``target``
            (:mod:`lowprec.autopilot.cost`).
        layers: ``{fqn: {"format", "flops", "gemms": {gemm: {"format", "flops",
            "loss_delta", "grad_err", "sqnr_db", "rel_err", "error", "fallbacks"}}}}``:
            each GEMM's choice, the numbers measured with only that GEMM lowered, and
            its safer choices in order (``bf16`` last).
        target, budget, seed, candidates: how it was tuned.
        reference_loss: the mean loss of the tuning batches in the model's precision.
        measured: ``{"loss_delta", "grad_err", "error"}`` of the whole plan on them.
        moved: the GEMMs (``"fqn:gemm"``) the repair moved to a safer choice, in order.
        model: the model it was tuned on, in words (``lowprec tune`` writes its flags,
            ``"--model llama --width 32 ..."``; ``""``: not recorded). A plan names that
            model's layers: :func:`lowprec.prepare` refuses its recipe on a model none of
            whose layers it names (:func:`lowprec.recipes.compose.check_layer_rules`).
    """

    recipe: Recipe
    cost: float
    target: str
    budget: Budget
    seed: int
    reference_loss: float
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    candidates: tuple[str, ...] = CANDIDATES
    moved: tuple[str, ...] = ()
    model: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, Recipe):
            raise TypeError(f"recipe must be a Recipe, got {type(self.recipe).__name__}")
        check_target(self.target)
        if not isinstance(self.budget, Budget):
            raise TypeError(f"budget must be a Budget, got {type(self.budget).__name__}")
        if isinstance(self.cost, bool) or not isinstance(self.cost, (int, float)):
            raise TypeError(f"cost must be a number, got {self.cost!r}")
        if not 0.0 < self.cost <= 1.0:
            raise ValueError(f"cost must be in (0, 1], got {self.cost!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.layers, dict):
            raise TypeError(f"layers must be a dict, got {type(self.layers).__name__}")
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "moved", tuple(self.moved))
        if not isinstance(self.model, str):
            raise TypeError(f"model must be a str, got {type(self.model).__name__}")

    def formats(self) -> dict[str, str]:
        """``{fqn: format}``: each layer's choice in one word (``nvfp4``), or per GEMM
        (``fwd=nvfp4,dgrad=fp8-rowwise,wgrad=nvfp4``)."""
        return {fqn: str(d["format"]) for fqn, d in self.layers.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (module docstring)."""
        return {
            "kind": KIND,
            "version": VERSION,
            "target": self.target,
            "cost": self.cost,
            "budget": {"loss": self.budget.loss, "grad": self.budget.grad},
            "seed": self.seed,
            "reference_loss": self.reference_loss,
            "measured": dict(self.measured),
            "candidates": list(self.candidates),
            "moved": list(self.moved),
            "model": self.model,
            "layers": self.layers,
            "recipe": self.recipe.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: object) -> Plan:
        """Inverse of :meth:`to_dict`; ``ValueError`` naming what is wrong."""
        if not is_plan_dict(d):
            raise ValueError(f"not a plan: expected a dict with 'kind': {KIND!r}")
        assert isinstance(d, dict)
        if d.get("version") != VERSION:
            raise ValueError(f"plan version must be {VERSION}, got {d.get('version')!r}")
        missing = {"target", "cost", "budget", "seed", "reference_loss", "recipe"} - set(d)
        if missing:
            raise ValueError(f"plan: missing keys {sorted(missing)}")
        b = d["budget"]
        if not isinstance(b, dict) or set(b) != {"loss", "grad"}:
            raise ValueError(f"plan budget must be {{'loss', 'grad'}}, got {b!r}")
        return cls(
            recipe=Recipe.from_dict(d["recipe"]),
            cost=d["cost"],
            target=d["target"],
            budget=Budget(**b),
            seed=d["seed"],
            reference_loss=d["reference_loss"],
            layers=d.get("layers", {}),
            measured=d.get("measured", {}),
            candidates=tuple(d.get("candidates", CANDIDATES)),
            moved=tuple(d.get("moved", ())),
            model=d.get("model", ""),
        )

    def to_json(self) -> str:
        """Strict JSON text of :meth:`to_dict` (non-finite numbers as strings)."""
        return dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the plan to ``path`` atomically (a temporary file, flushed and synced,
        then renamed over ``path``)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`."""
        return cls.from_dict(loads(Path(path).read_text(encoding="utf-8")))


def is_plan_dict(d: object) -> bool:
    """Whether ``d`` is the dict of a plan (``"kind": "lowprec-plan"``)."""
    return isinstance(d, dict) and d.get("kind") == KIND
