"""Model structure that more than one technique recognises: the MoE experts modules of
transformers 5.

A transformers 5 experts class (decorated with ``use_experts_implementation``) states its
layout in three boolean attributes, ``has_gate``, ``has_bias`` and ``is_transposed``, and
holds every expert's weights in two 3-D parameters: ``gate_up_proj`` (with a gate, applied
by ``_apply_gate``) or ``up_proj`` (with ``act_fn``), and ``down_proj``, with 2-D
``<name>_bias`` parameters when ``has_bias``. ``lowprec.float8`` (grouped FP8 GEMMs) and
``lowprec.unit`` (unit-scaled experts) both convert these modules; this is their one
definition of what such a module holds. (``lowprec.float8`` also recognises hand-written
experts modules without the flags, by probing their forward.)
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = [
    "EXPERT_FLAGS",
    "ExpertFlags",
    "expert_weight_names",
    "holds_experts",
    "stated_flags",
    "weight_names",
]

EXPERT_FLAGS = ("has_gate", "has_bias", "is_transposed")
ExpertFlags = tuple[bool, bool, bool]  # (has_gate, has_bias, is_transposed)


def expert_weight_names(has_gate: bool) -> tuple[str, str]:
    """The names of the two 3-D expert weights: ``(gate_up_proj | up_proj, down_proj)``."""
    return ("gate_up_proj" if has_gate else "up_proj", "down_proj")


def weight_names(mod: nn.Module) -> tuple[str, str]:
    """The names of the expert weights of ``mod``, an experts module with a ``has_gate``
    flag (stated, or set by the module that converted it)."""
    return expert_weight_names(bool(mod.has_gate))


def stated_flags(mod: nn.Module) -> ExpertFlags | None:
    """``(has_gate, has_bias, is_transposed)`` when ``mod`` states all three as booleans
    (a ``use_experts_implementation`` class), else ``None``."""
    if not all(isinstance(getattr(mod, f, None), bool) for f in EXPERT_FLAGS):
        return None
    return (bool(mod.has_gate), bool(mod.has_bias), bool(mod.is_transposed))


def holds_experts(mod: nn.Module, flags: ExpertFlags) -> bool:
    """``mod`` holds what ``flags`` describe: the gate (a callable ``_apply_gate``) or the
    activation (a callable ``act_fn``) its forward applies, the two expert weights as 3-D
    floating-point parameters of its own and, with ``has_bias``, their 2-D biases."""
    has_gate, has_bias, _ = flags
    if not callable(getattr(mod, "_apply_gate" if has_gate else "act_fn", None)):
        return False
    for name in expert_weight_names(has_gate):
        p = mod._parameters.get(name)
        if not isinstance(p, Tensor) or p.dim() != 3 or not p.dtype.is_floating_point:
            return False
        b = mod._parameters.get(name + "_bias")
        if has_bias and (not isinstance(b, Tensor) or b.dim() != 2):
            return False
    return True
