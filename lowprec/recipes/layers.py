"""Per-layer recipes: which float8 config (or none) each layer of a model gets.

A :class:`~lowprec.recipes.Recipe` with a float8 technique may carry ``layers``, a tuple
of :class:`LayerRule`\\ s. A linear-like layer at fully-qualified name ``fqn`` gets the
config of the *first* rule whose ``pattern`` matches ``fqn`` (:func:`fnmatch.fnmatchcase`:
``*`` matches any run of characters, dots included; ``blocks.[01].*`` the first two
blocks): a :class:`~lowprec.float8.Float8Config`, or ``None`` (the layer stays in the
policy's dtype, "high precision"). A layer no rule matches gets the recipe's float8 config,
unless its last name component is in the recipe's ``float8_skip``. Per-GEMM formats live in
the config itself (:attr:`~lowprec.float8.Float8Config.high_precision_gemms`, and a config
per GEMM where the config supports it): a rule names one config per layer.

Example:
    >>> from lowprec.float8 import Float8Config
    >>> rules = (LayerRule("blocks.0.*", Float8Config.from_name("rowwise")),
    ...          LayerRule("*.mlp.*", None))
    >>> default = Float8Config.from_name("tensorwise")
    >>> [layer_config(rules, n, default, ()).name if layer_config(rules, n, default, ())
    ...  else None for n in ("blocks.0.mlp.fc", "blocks.1.mlp.fc", "blocks.1.attn.qkv")]
    ['rowwise', None, 'tensorwise']
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from lowprec.float8 import Float8Config
from lowprec.recipes.serial import decode, encode

__all__ = ["LayerRule", "layer_config", "rules_from_list", "rules_to_list"]


@dataclass(frozen=True)
class LayerRule:
    """Layers whose fully-qualified name matches ``pattern`` get ``float8`` (``None``: high
    precision, the policy's dtype)."""

    pattern: str
    float8: Float8Config | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"pattern must be a non-empty string, got {self.pattern!r}")
        if self.float8 is not None and not isinstance(self.float8, Float8Config):
            raise TypeError(
                f"float8 must be a Float8Config or None (high precision), got "
                f"{type(self.float8).__name__}"
            )

    def matches(self, fqn: str) -> bool:
        return fnmatchcase(fqn, self.pattern)


def layer_config(
    rules: tuple[LayerRule, ...], fqn: str, default: Float8Config | None, skip: tuple[str, ...]
) -> Float8Config | None:
    """The float8 config of the layer at ``fqn``: the first matching rule's, else
    ``default`` unless the last name component of ``fqn`` is in ``skip`` (then ``None``)."""
    for r in rules:
        if r.matches(fqn):
            return r.float8
    return None if fqn.rsplit(".", 1)[-1] in skip else default


def rules_to_list(rules: tuple[LayerRule, ...]) -> list[dict[str, Any]]:
    """JSON-ready: ``[{"pattern": ..., "float8": <config fields> | None}, ...]``."""
    return [
        {"pattern": r.pattern, "float8": None if r.float8 is None else encode(r.float8)}
        for r in rules
    ]


def rules_from_list(items: object) -> tuple[LayerRule, ...]:
    """Inverse of :func:`rules_to_list` (``ValueError`` naming the bad entry)."""
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"layers must be a list of {{'pattern', 'float8'}}, got {items!r}")
    out = []
    for i, d in enumerate(items):
        if isinstance(d, LayerRule):
            out.append(d)
            continue
        if not isinstance(d, dict) or set(d) - {"pattern", "float8"} or "pattern" not in d:
            raise ValueError(f"layers[{i}] must be {{'pattern': str, 'float8': ...}}, got {d!r}")
        f8 = d.get("float8")
        cfg = (
            None if f8 is None else f8 if isinstance(f8, Float8Config) else decode(Float8Config, f8)
        )
        out.append(LayerRule(d["pattern"], cfg))
    return tuple(out)
