"""The guard: during training, move a layer whose measured numerics fail to a safer format.

At each step whose GEMMs were measured (:mod:`lowprec.analysis.gemms`, e.g. every
``gemms_every`` steps of ``lowprec train``) the guard reads the per-GEMM records and the
step's loss (:meth:`Guard.check`), and moves a float8 layer to its next safer choice
(:func:`next_safer`) when

* an operand of one of its GEMMs had :attr:`GuardConfig.flush_limit` or more of its values
  flushed to zero, or :attr:`GuardConfig.saturate_limit` or more saturated, or the GEMM's
  relative error (sampled, against the high-precision GEMM) reached
  :attr:`GuardConfig.rel_err_limit`;
* or the loss spiked: above ``(1 + spike) ×`` its exponential moving average (after
  :attr:`GuardConfig.warmup` steps); then the float8 layer with the largest GEMM error of
  the latest measurement moves (at most one spike move per :attr:`GuardConfig.cooldown` steps).

The ladder (:func:`next_safer`), per GEMM of the layer: a cast with no scaling (scale 1,
``fp8-naive``) → FP8 tensor-wise; FP4 (E2M1) → FP8 row-wise; other float8 → high
precision (the policy's dtype). A move takes the layer's GEMMs on its lowest rung one rung
up and leaves the others as they are. A move replaces the layer in place
(:func:`lowprec.float8.convert.replace_layer`: the same parameters, fresh scaling state),
between two steps. Each :class:`Move` (step, layer, from, to, reason) is recorded; the
guard's state (:meth:`Guard.state_dict`: its moves, the loss average, the last spike move)
goes into checkpoints, and :meth:`Guard.replay` re-applies the moves of a checkpoint to a
freshly built model before its state is loaded, so that a resumed run continues exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from lowprec.analysis.verdicts import percent
from lowprec.core.observe import GEMMS
from lowprec.float8 import Float8Config, Float8Linear
from lowprec.float8.config import PRESETS, ROLES
from lowprec.float8.convert import replace_layer
from lowprec.recipes.serial import decode, encode

__all__ = ["Guard", "GuardConfig", "Move", "next_safer"]


def _positive(name: str, v: object, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kinds) or not 0 < v < math.inf:
        raise ValueError(
            f"{name} must be a {'positive int' if integer else 'number > 0'}, got {v!r}"
        )


@dataclass(frozen=True)
class GuardConfig:
    """When the guard moves a layer (module docstring). Shares are fractions of an
    operand's elements; ``spike`` is relative (0.5: a loss 50% above its average)."""

    flush_limit: float = 0.25
    saturate_limit: float = 0.01
    rel_err_limit: float = 0.3
    spike: float = 0.5
    ema: float = 0.9
    warmup: int = 20
    cooldown: int = 10

    def __post_init__(self) -> None:
        for name in ("flush_limit", "saturate_limit", "rel_err_limit", "spike"):
            _positive(name, getattr(self, name))
        if (
            isinstance(self.ema, bool)
            or not isinstance(self.ema, (int, float))
            or not 0 < self.ema < 1
        ):
            raise ValueError(f"ema must be in (0, 1), got {self.ema!r}")
        _positive("warmup", self.warmup, integer=True)
        _positive("cooldown", self.cooldown, integer=True)


@dataclass(frozen=True)
class Move:
    """One move: after step ``step`` (steps done), ``layer`` went from config ``frm`` to
    ``to`` (a float8 config's name, or ``"high precision"``) because of ``reason``;
    ``config`` is the new config's fields (``None``: high precision)."""

    step: int
    layer: str
    frm: str
    to: str
    reason: str
    config: dict[str, Any] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Move:
        try:
            return cls(int(d["step"]), str(d["layer"]), str(d["frm"]), str(d["to"]),
                       str(d["reason"]), d.get("config"))  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a guard move must have step, layer, frm, to, reason: {e}") from None


def _no_scaling(cfg: Float8Config) -> bool:
    return all(cfg.cast(r).static_scale == 1.0 for r in ROLES)


def _fp4(cfg: Float8Config) -> bool:
    return any(cfg.cast(r).fmt == "e2m1" for r in ROLES)


def _per_gemm(cfg: Float8Config) -> dict[str, Float8Config | None]:
    """The config each GEMM of a layer with ``cfg`` runs (``None``: high precision)."""
    own = dict(cfg.gemms)
    base = cfg.replace(high_precision_gemms=(), gemms=())
    if own or cfg.high_precision_gemms:  # the layer's name is not its base GEMMs' name
        base = base.replace(name=next((n for n in PRESETS if _is_preset(base, n)), base.name))
    return {g: None if g in cfg.high_precision_gemms else own.get(g, base) for g in GEMMS}


def _is_preset(cfg: Float8Config, name: str) -> bool:
    p = PRESETS.get(name)
    return p == cfg.replace(name=p.name)


def _rung(cfg: Float8Config | None) -> int:
    """A GEMM's rung on the ladder: 0 no scaling, 1 FP4, 2 other float8, 3 high precision."""
    if cfg is None:
        return 3
    return 0 if _no_scaling(cfg) else 1 if _fp4(cfg) else 2


def _joined(per: Mapping[str, Float8Config | None]) -> Float8Config | None:
    """One layer config from each GEMM's (:func:`_per_gemm`'s inverse): the first float8
    GEMM's config, the others that differ as ``gemms``, the high-precision ones as
    ``high_precision_gemms``; named ``fwd=...,dgrad=...,wgrad=...`` when they differ."""
    lowered = [g for g in GEMMS if per[g] is not None]
    if not lowered:
        return None
    base = per[lowered[0]]
    assert base is not None
    own = tuple((g, c) for g in lowered[1:] if (c := per[g]) is not None and c != base)
    hp = tuple(g for g in GEMMS if per[g] is None)
    if not own and not hp:
        return base
    names = [c.name if c is not None else "bf16" for c in (per[g] for g in GEMMS)]
    name = ",".join(f"{s}={n}" for s, n in zip(("fwd", "dgrad", "wgrad"), names, strict=True))
    return base.replace(name=name, high_precision_gemms=hp, gemms=own)


def next_safer(cfg: Float8Config | None) -> Float8Config | None:
    """The next rung of the ladder (module docstring); ``None``: high precision.

    Per GEMM: the GEMMs on the lowest rung of the layer move up one (no scaling →
    FP8 tensor-wise, FP4 → FP8 row-wise, other float8 → high precision); the others keep
    their config, so a move never makes a GEMM less precise (a high-precision GEMM of a
    per-GEMM plan stays high precision).

    Example:
        >>> next_safer(Float8Config.from_name("naive")).name
        'tensorwise'
        >>> next_safer(Float8Config.from_name("nvfp4")).name
        'rowwise'
        >>> next_safer(Float8Config.from_name("rowwise")) is None  # high precision next
        True
        >>> mixed = Float8Config.from_name("mxfp4").replace(
        ...     high_precision_gemms=("forward", "weight_grad"))
        >>> next_safer(mixed).name
        'fwd=bf16,dgrad=rowwise,wgrad=bf16'
    """
    if cfg is None:
        return None
    per = _per_gemm(cfg)
    low = min(_rung(c) for c in per.values())
    if low == 3:
        return None
    up = Float8Config.from_name(("tensorwise", "rowwise")[low]) if low < 2 else None
    return _joined({g: up if _rung(c) == low else c for g, c in per.items()})


class Guard:
    """Watches a model's measured GEMMs and its loss and moves layers (module docstring).

    Example:
        >>> import torch
        >>> from lowprec.float8 import apply
        >>> m = apply(torch.nn.Sequential(torch.nn.Linear(8, 8)), "naive")
        >>> g = Guard(m)
        >>> rec = {"step": 0, "layer": "0", "gemm": "input_grad", "rel_err": 0.9,
        ...        "operands": {"grad_output": {"flushed": 0.7, "saturated": 0.0}}}
        >>> [(mv.layer, mv.frm, mv.to) for mv in g.check(1, [rec], loss=2.0)]
        [('0', 'naive', 'tensorwise')]
        >>> type(m[0]).__name__, m[0].recipe.name
        ('Float8Linear', 'tensorwise')
    """

    def __init__(self, model: nn.Module, config: GuardConfig | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if config is not None and not isinstance(config, GuardConfig):
            raise TypeError(f"config must be a GuardConfig, got {type(config).__name__}")
        self.model, self.config = model, config or GuardConfig()
        self.moves: list[Move] = []
        self.loss_avg: float | None = None
        self.seen = 0  # losses averaged
        self.last_spike_move = -(10**9)
        self.last_errors: dict[str, float] = {}

    def watched(self) -> list[str]:
        """The names of the model's float8 layers, which the guard can move."""
        return [n for n, m in self.model.named_modules() if isinstance(m, Float8Linear)]

    # -- the decision --------------------------------------------------------------------
    def _reasons(self, records: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        c, out = self.config, {}
        for r in records:
            layer, gemm = str(r["layer"]), str(r["gemm"])
            err = r.get("rel_err")
            if isinstance(err, (int, float)) and math.isfinite(err):
                self.last_errors[layer] = max(self.last_errors.get(layer, 0.0), float(err))
            why = None
            for role, op in r["operands"].items():
                if op.get("high_precision"):
                    continue
                if float(op.get("flushed") or 0.0) >= c.flush_limit:
                    why = f"{gemm}: {percent(op['flushed'])} of {role} flushed to zero"
                elif float(op.get("saturated") or 0.0) >= c.saturate_limit:
                    why = f"{gemm}: {percent(op['saturated'])} of {role} saturated"
                if why:
                    break
            if why is None and isinstance(err, (int, float)) and err >= c.rel_err_limit:
                why = f"{gemm}: GEMM relative error {float(err):.3g}"
            if why is not None and layer not in out:
                out[layer] = why
        return out

    def check(
        self, step: int, records: Sequence[Mapping[str, Any]], loss: float | None = None
    ) -> list[Move]:
        """Judge step ``step`` (steps done) by its GEMM ``records`` (those measured at this
        step; may be empty) and its training ``loss``, apply the moves to the model and
        return them."""
        if records:
            self.last_errors = {}
        reasons = self._reasons(records)
        c = self.config
        if loss is not None and math.isfinite(loss):
            avg = self.loss_avg
            spiked = (
                avg is not None
                and self.seen >= c.warmup
                and loss > (1 + c.spike) * avg
                and step - self.last_spike_move >= c.cooldown
            )
            movable = [k for k in self.last_errors if k not in reasons and self._movable(k)]
            if spiked and movable:
                worst = max(movable, key=lambda k: self.last_errors[k])
                reasons[worst] = f"loss spike: {loss:.4g} vs average {avg:.4g}"
                self.last_spike_move = step
            self.loss_avg = loss if avg is None else c.ema * avg + (1 - c.ema) * loss
            self.seen += 1
        moves = []
        for layer, why in reasons.items():
            mv = self._move(step, layer, why)
            if mv is not None:
                moves.append(mv)
        return moves

    def _layer(self, fqn: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(fqn)
        except AttributeError:
            return None

    def _movable(self, fqn: str) -> bool:
        return isinstance(self._layer(fqn), Float8Linear)

    def _move(self, step: int, fqn: str, why: str) -> Move | None:
        layer = self._layer(fqn)
        if not isinstance(layer, Float8Linear):  # high precision already, or not a float8 layer
            return None
        cfg = layer.recipe
        new = next_safer(cfg)
        replace_layer(self.model, fqn, new)
        mv = Move(step, fqn, cfg.name, "high precision" if new is None else new.name, why,
                  None if new is None else _encode(new))  # fmt: skip
        self.moves.append(mv)
        return mv

    # -- resuming ------------------------------------------------------------------------
    def replay(self, moves: Sequence[Move]) -> None:
        """Apply recorded ``moves`` (in order) to the model: a resumed run rebuilds its model
        as it started, replays the moves up to its checkpoint, then loads the checkpoint."""
        for mv in moves:
            cfg = None if mv.config is None else _decode(mv.config)
            replace_layer(self.model, mv.layer, cfg)
            self.moves.append(mv)

    def state_dict(self) -> dict[str, Any]:
        return {
            "moves": [m.to_dict() for m in self.moves],
            "loss_avg": self.loss_avg,
            "seen": self.seen,
            "last_spike_move": self.last_spike_move,
            "last_errors": dict(self.last_errors),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the loss average and counters (the moves themselves are
        :meth:`replay`\\ ed before the model's state is loaded; they must agree)."""
        recorded = [Move.from_dict(m) for m in state.get("moves", [])]
        if [(m.step, m.layer, m.to) for m in recorded] != [
            (m.step, m.layer, m.to) for m in self.moves
        ]:
            raise ValueError("the guard's moves in the checkpoint differ from those replayed")
        self.loss_avg = state.get("loss_avg")
        self.seen = int(state.get("seen", 0))
        self.last_spike_move = int(state.get("last_spike_move", -(10**9)))
        self.last_errors = {str(k): float(v) for k, v in state.get("last_errors", {}).items()}


def _encode(cfg: Float8Config) -> dict[str, Any]:
    return encode(cfg)


def _decode(d: Mapping[str, Any]) -> Float8Config:
    return decode(Float8Config, dict(d))
