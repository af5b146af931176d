"""The configuration of a training run (re-exported by :mod:`lowprec.jobs.train`):
:class:`TrainConfig`, every field a flag of ``lowprec train``, checked field by field, its
learning-rate schedule and its JSON form; :func:`saved_config`, the configuration a run
directory's ``config.json`` records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from lowprec.analysis.gemms import DEFAULT_EVERY
from lowprec.distributed.parallel import GRAD_COMM
from lowprec.jobs.model import ModelConfig, check_model_name
from lowprec.jobs.rundir import CONFIG, RunError, read_config
from lowprec.recipes import Recipe, get_recipe

__all__ = [
    "EVAL_BATCHES_MAX",
    "INT_MAX",
    "LR_MAX",
    "LR_MIN",
    "TrainConfig",
    "check_int",
    "saved_config",
]

# The largest int a field takes: int64's, what torch (``torch.manual_seed``; ``seed + 1``
# seeds the rounding generator, still below 2^64) and a float (the schedule) hold.
INT_MAX = 2**63 - 1
# The learning rate's range: float32's smallest normal (the optimizer's arithmetic is
# float32: a smaller lr is zero or subnormal there) to 1e6, far above any lr that trains
# (lr 1e4 is how the tests make a run diverge; it then stops on NaN/Inf, as it should) and
# far inside float32 (lr 1e308 is Inf there: the first step crashed on the conversion).
LR_MIN = 2.0**-126
LR_MAX = 1e6
EVAL_BATCHES_MAX = 10_000


_POSITIVE = (
    "steps",
    "batch_size",
    "seq_len",
    "width",
    "depth",
    "heads",
    "eval_every",
    "eval_batches",
    "ckpt_every",
    "gemms_every",
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run of the reference model.

    Every field is a flag of ``lowprec train`` (``--batch-size`` for ``batch_size``), with
    the field's ``metadata["help"]``. ``recipe``: a preset name or a
    :class:`~lowprec.Recipe` (``lowprec train --recipe FILE.json``); :meth:`to_dict` writes
    its name, ``config.json`` the whole recipe. Invalid values raise ``ValueError`` (or
    ``TypeError``) naming the field (:meth:`check_field`).
    """

    recipe: str | Recipe = field(
        default="fp32", metadata={"help": "training recipe: a preset name or a JSON file"}
    )
    steps: int = field(default=400, metadata={"help": "training steps"})
    batch_size: int = field(
        default=16, metadata={"help": "sequences per step (the global batch under --parallel)"}
    )
    seq_len: int = field(default=64, metadata={"help": "characters per sequence"})
    width: int = field(default=128, metadata={"help": "model width"})
    depth: int = field(default=2, metadata={"help": "transformer layers"})
    heads: int = field(default=4, metadata={"help": "attention heads (must divide --width)"})
    lr: float = field(default=3e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup: int = field(
        default=20, metadata={"help": "linear warm-up steps, then cosine decay to lr/10"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the initialisation and the data"})
    eval_every: int = field(
        default=50, metadata={"help": "evaluate every this many steps (and at the end)"}
    )
    eval_batches: int = field(default=8, metadata={"help": "validation batches per evaluation"})
    ckpt_every: int = field(default=100, metadata={"help": "checkpoint every this many steps"})
    model: str = field(
        default="reference", metadata={"help": "reference or an HF architecture (docs/models.md)"}
    )
    gemms_every: int = field(
        default=DEFAULT_EVERY,
        metadata={"help": "measure the low-precision GEMMs' casts every this many steps"},
    )
    grad_comm: str = field(
        default="fp32",
        metadata={
            "help": "the gradients' reduction on the wire under --parallel: fp32, bf16, or fp8 "
            "(E4M3 with shared scales, sums in FP32; docs/distributed.md)"
        },
    )
    guard: bool = field(
        default=False,
        metadata={
            "help": "move a float8 layer to a safer format when its measured GEMMs or the "
            "loss fail (lowprec.autopilot.guard; docs/autopilot.md)"
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            self.check_field(f.name, getattr(self, f.name))
        self.check_together({f.name: getattr(self, f.name) for f in fields(self)})
        self.model_config()

    @classmethod
    def check_together(cls, values: dict[str, Any], flags: bool = False) -> None:
        """Check that fields valid alone fit together (``width`` divisible by ``heads``):
        ``values`` by field name, the defaults for those missing. ``ValueError`` naming
        both fields, or (``flags``) both flags of ``lowprec train`` with their values
        (``--width 30 must be divisible by --heads 4``)."""
        d: dict[str, Any] = {f.name: f.default for f in fields(cls)} | values
        width, heads = d["width"], d["heads"]
        if width % heads:
            raise ValueError(
                f"--width {width} must be divisible by --heads {heads}"
                if flags
                else f"width ({width}) must be divisible by heads ({heads})"
            )

    @classmethod
    def check_field(cls, name: str, value: Any) -> None:
        """Check ``value`` for field ``name`` alone: ``ValueError`` (``TypeError`` for a
        recipe of the wrong type) whose message starts with the field's name."""
        if name == "recipe":
            get_recipe(value)  # unknown names list the valid ones
        elif name == "model":
            check_model_name(value)
        elif name in _POSITIVE:
            check_int(name, value, 1)
            if name == "eval_batches" and value > EVAL_BATCHES_MAX:
                raise ValueError(
                    f"eval_batches must be at most {EVAL_BATCHES_MAX}, got {value!r} (every "
                    "evaluation reads that many batches, and an interrupt waits for it; "
                    f"{EVAL_BATCHES_MAX} batches of 16 × 64 read the validation split 90 times)"
                )
        elif name == "lr":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and 0 < value < math.inf):  # (compared, not converted: a huge int)
                raise ValueError(f"lr must be a positive finite number, got {value!r}")
            if not LR_MIN <= value <= LR_MAX:
                raise ValueError(
                    f"lr must be a positive finite number from {LR_MIN:.3g} (float32's "
                    f"smallest normal) to {LR_MAX:g}, got {value!r}"
                )
        elif name == "grad_comm":
            if value not in GRAD_COMM:
                raise ValueError(f"grad_comm must be one of {list(GRAD_COMM)}, got {value!r}")
        elif name == "guard":
            if not isinstance(value, bool):
                raise ValueError(f"guard must be a bool, got {value!r}")
        elif name in ("warmup", "seed"):
            check_int(name, value, 0)
        else:
            raise ValueError(f"name: TrainConfig has no field {name!r}")

    @property
    def recipe_name(self) -> str:
        return self.recipe.name if isinstance(self.recipe, Recipe) else self.recipe

    def recipe_dict(self) -> dict[str, Any]:
        """The recipe as ``Recipe.to_dict`` (what ``config.json`` stores)."""
        return get_recipe(self.recipe).to_dict()

    def lr_at(self, step: int) -> float:
        """Learning rate of step ``step`` (0-based): linear warm-up over ``warmup`` steps,
        then cosine decay to ``lr / 10`` at the last step. A pure function of the step, so
        resuming needs no scheduler state."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(self.steps - 1 - self.warmup, 1)
        t = min((step - self.warmup) / span, 1.0)
        return self.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * t)))

    def model_config(self, vocab_size: int = 65) -> ModelConfig:
        return ModelConfig(vocab_size, self.width, self.depth, self.heads, self.seq_len)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values, ``recipe`` by its name."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["recipe"] = self.recipe_name
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """From :meth:`to_dict` (unknown keys are ignored; ``recipe`` a preset name)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TrainConfig:
        """The configuration a run directory's ``config.json`` records: its ``"train"``
        entry, with the recipe rebuilt from its ``"recipe"`` dict (the preset name where
        the dict is that preset's). ``ValueError``/``TypeError`` if it is not valid."""
        train = dict(config["train"])
        saved = config.get("recipe")
        if isinstance(saved, dict) and saved:
            name = train.get("recipe")
            same = False
            try:
                same = isinstance(name, str) and get_recipe(name).to_dict() == saved
            except ValueError:
                pass  # not a preset: a recipe from a file
            train["recipe"] = name if same else Recipe.from_dict(saved)
        return cls.from_dict(train)

    def differences(self, other: TrainConfig) -> list[str]:
        """The names of the fields whose values differ between ``self`` and ``other``
        (recipes compared by their dicts, whether given by name or as a Recipe)."""
        out = []
        for f in fields(self):
            if f.name == "recipe":
                if self.recipe_dict() != other.recipe_dict():
                    out.append(f.name)
            elif getattr(self, f.name) != getattr(other, f.name):
                out.append(f.name)
        return out


def check_int(name: str, value: object, low: int) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) from ``low``
    (1: positive, 0: non-negative) to :data:`INT_MAX`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "positive" if low == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} int, got {value!r}")
    if value > INT_MAX:
        raise ValueError(f"{name} must be at most 2^63 - 1 = {INT_MAX}, got {value!r}")


def saved_config(out: Path, saved: dict[str, Any] | None = None) -> TrainConfig:
    """The :class:`TrainConfig` that run directory ``out`` records (``saved``: its
    ``config.json``, if already read); :class:`RunError` if there is none or it is not
    valid."""
    saved = read_config(out, "--resume") if saved is None else saved
    try:
        return TrainConfig.from_config(saved)
    except (ValueError, TypeError, KeyError) as e:
        raise RunError(f"--resume: {out / CONFIG} is corrupt ({e})") from None
