"""The validation of :class:`~lowprec.float8.config.Float8Config`'s per-GEMM fields
(``gemms``, ``hadamard``), run by its ``__post_init__``: each check raises ``ValueError``
naming the field, and normalises it in place (the frozen config is being built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowprec.core.observe import GEMMS

if TYPE_CHECKING:
    from lowprec.float8.config import Float8Config

__all__ = ["check_gemms", "check_hadamard"]

ROLES = ("input", "weight", "grad_output")
GEMM_ROLES: dict[str, tuple[str, str]] = {
    "forward": ("input", "weight"),
    "input_grad": ("grad_output", "weight"),
    "weight_grad": ("grad_output", "input"),
}


def check_gemms(cfg: Float8Config) -> None:
    """Validate and normalise ``cfg.gemms`` (set in place: the config is being built);
    precompute what the GEMMs ask of it (no dataclass comparison runs while
    ``torch.compile`` traces a GEMM)."""
    given = cfg.gemms
    pairs = list(given.items()) if isinstance(given, dict) else given
    if not isinstance(pairs, (list, tuple)):
        raise ValueError(f"gemms must be pairs (gemm, Float8Config) or a dict, got {given!r}")
    out: dict[str, Float8Config] = {}
    for p in pairs:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ValueError(f"gemms: each entry must be a pair (gemm, config), got {p!r}")
        g, c = p
        if g not in GEMMS:
            raise ValueError(f"gemms: GEMM names must be among {GEMMS}, got {g!r}")
        if g in out:
            raise ValueError(f"gemms: GEMM {g!r} is given twice in {given!r}")
        if g in cfg.high_precision_gemms:
            raise ValueError(
                f"gemms: {g!r} is also in high_precision_gemms={cfg.high_precision_gemms!r}"
                " (a GEMM is either quantized with a per-GEMM config or high precision)"
            )
        if isinstance(c, str):
            c = type(cfg).from_name(c)
        if not isinstance(c, type(cfg)):
            raise ValueError(
                f"gemms: the config of {g!r} must be a Float8Config or a preset name, "
                f"got {type(c).__name__}"
            )
        if c.gemms or c.high_precision_gemms:
            raise ValueError(
                f"gemms: the config of {g!r} has gemms={c.gemms!r} and "
                f"high_precision_gemms={c.high_precision_gemms!r}; a per-GEMM config "
                "may have neither"
            )
        if c.hadamard:
            raise ValueError(
                f"gemms: the config of {g!r} has hadamard={c.hadamard!r}; the Hadamard "
                "transforms are the base config's (its hadamard field)"
            )
        for role in GEMM_ROLES[g]:
            oc = c.cast(role)
            if oc != cfg.cast(role) and oc.scaling != "dynamic":
                raise ValueError(
                    f"gemms: the {role} cast of {g!r} ({oc.describe()}) must have "
                    f"scaling='dynamic' or equal the base {role} cast "
                    f"({cfg.cast(role).describe()}): the delayed/static scaling state "
                    "belongs to the base config's roles"
                )
        out[g] = c
    norm = tuple((g, out[g]) for g in GEMMS if g in out)
    object.__setattr__(cfg, "gemms", norm)
    # Computed once: which (gemm, role) casts differ from the base cast.
    own = frozenset(
        (g, role) for g, c in norm for role in GEMM_ROLES[g] if c.cast(role) != cfg.cast(role)
    )
    # Which GEMMs quantize a role with the same cast: (role, gemm, gemm) pairs.
    same = frozenset(
        (role, a, b)
        for role in ROLES
        for a in GEMMS
        for b in GEMMS
        if dict(norm).get(a, cfg).cast(role) == dict(norm).get(b, cfg).cast(role)
    )
    object.__setattr__(cfg, "_per_gemm", dict(norm))
    object.__setattr__(cfg, "_own", own)
    object.__setattr__(cfg, "_same", same)


def check_hadamard(cfg: Float8Config) -> None:
    """Validate and normalise ``cfg.hadamard`` (a tuple in :data:`GEMMS` order)."""
    h = cfg.hadamard
    if isinstance(h, (list, str)):
        h = tuple(h) if isinstance(h, list) else (h,)
    if not isinstance(h, tuple) or not set(h) <= set(GEMMS) or len(set(h)) != len(h):
        raise ValueError(f"hadamard must be distinct names among {GEMMS}, got {h!r}")
    for g in h:
        if g in cfg.high_precision_gemms:
            raise ValueError(
                f"hadamard: {g!r} is also in high_precision_gemms (a high-precision GEMM "
                "multiplies the operands as they are)"
            )
        for role in GEMM_ROLES[g]:
            c = cfg.gemm_cast(g, role)
            if c.scaling != "dynamic":
                raise ValueError(
                    f"hadamard: the {role} cast of {g!r} ({c.describe()}) must have "
                    "scaling='dynamic': its scale is taken from the transformed operand"
                )
    object.__setattr__(cfg, "hadamard", tuple(g for g in GEMMS if g in h))
