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

Depth-relative rules. One component of a pattern may be ``{first:K}`` or ``{last:K}``, with
``K`` a count of blocks or a share ``P%`` of them: it matches the index of a block among the
first / last ``k`` blocks of the model, where the blocks are the children of the outermost
``nn.ModuleList`` / ``nn.Sequential`` containers (a transformer's ``blocks``, HF models'
``model.layers``; a list nested in a block, such as MoE experts, is not a block list) and
``k = K``, or ``k = ⌊P/100 · n + 1/2⌋`` for ``n`` blocks (the share rounded half up, so it
may be 0). ``"*.{last:15%}.*"`` is every layer of the last 15% of the blocks: with 12
blocks ``k = ⌊1.8 + 0.5⌋ = 2`` (blocks 10 and 11), with 4 blocks ``k = 1``, with 2 blocks
``k = 0`` (none). A rule is matched by putting the index in place of the token and
matching the whole name. Depth tokens need the model (:func:`block_depths`), which
:func:`lowprec.recipes.prepare` passes.

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

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from lowprec.float8 import Float8Config
from lowprec.recipes.serial import decode, encode

__all__ = ["LayerRule", "block_depths", "layer_config", "rules_from_list", "rules_to_list"]

_DEPTH = re.compile(r"\{(first|last):(\d+(?:\.\d+)?)(%?)\}")


def block_depths(model: nn.Module) -> dict[str, int]:
    """The model's block lists: the fully-qualified name of every outermost
    ``nn.ModuleList`` / ``nn.Sequential`` (one not inside another; ``""`` for the model
    itself) mapped to its number of children."""
    out: dict[str, int] = {}
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        if any(name == c or name.startswith(c + ".") or c == "" for c in out):
            continue
        out[name] = len(m)
    return out


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

        tokens = _DEPTH.findall(self.pattern)
        rest = _DEPTH.sub("", self.pattern)
        if len(tokens) > 1 or "{" in rest or "}" in rest:
            raise ValueError(
                f"pattern {self.pattern!r}: at most one depth token, '{{first:K}}' or "
                "'{last:K}' with K a number of blocks or a share such as '15%'"
            )
        if tokens:
            _, k, pct = tokens[0]
            if (pct and float(k) > 100) or (not pct and not k.isdigit()):
                raise ValueError(
                    f"pattern {self.pattern!r}: K must be a whole number of blocks or a "
                    "share from 0% to 100%"
                )

    @property
    def depth_relative(self) -> bool:
        """Whether the pattern holds a ``{first:K}`` / ``{last:K}`` token."""
        return _DEPTH.search(self.pattern) is not None

    def matches(self, fqn: str, depths: Mapping[str, int] | None = None) -> bool:
        """Whether the layer at ``fqn`` matches; ``depths`` (:func:`block_depths`) is needed
        for a depth-relative pattern (``ValueError`` without it)."""
        m = _DEPTH.search(self.pattern)
        if m is None:
            return fnmatchcase(fqn, self.pattern)
        if depths is None:
            raise ValueError(
                f"pattern {self.pattern!r} is depth-relative and needs the model's block "
                "lists (block_depths(model))"
            )
        where, k_text, pct = m.groups()
        parts = fqn.split(".")
        for j, part in enumerate(parts):
            container = ".".join(parts[:j])
            if not part.isdigit() or container not in depths:
                continue
            n, i = depths[container], int(part)
            k = math.floor(float(k_text) / 100 * n + 0.5) if pct else int(k_text)
            inside = i < k if where == "first" else i >= n - k
            if inside and fnmatchcase(
                fqn, self.pattern[: m.start()] + part + self.pattern[m.end() :]
            ):
                return True
        return False


def layer_config(
    rules: tuple[LayerRule, ...],
    fqn: str,
    default: Float8Config | None,
    skip: tuple[str, ...],
    depths: Mapping[str, int] | None = None,
) -> Float8Config | None:
    """The float8 config of the layer at ``fqn``: the first matching rule's, else
    ``default`` unless the last name component of ``fqn`` is in ``skip`` (then ``None``).
    ``depths``: the model's block lists (:func:`block_depths`), for depth-relative rules."""
    for r in rules:
        if r.matches(fqn, depths):
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
