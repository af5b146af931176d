"""The cost model of the autopilot: candidate formats, targets and their GEMM rates, FLOPs.

A linear ``y = x Wᵀ`` with ``x`` of ``M × K`` and ``W`` of ``N × K`` runs three GEMMs in
training (forward ``y = x Wᵀ``, input gradient ``dx = g W``, weight gradient
``dW = gᵀ x``), each of ``2·M·K·N`` FLOPs. A GEMM whose operands are in format class ``c``
(``bf16``, ``fp8`` or ``fp4``) runs at ``rate(c, target)`` times the BF16 rate of the
target, the ratio of the published dense tensor-core peaks:

=========  ====  ====  ====================================
target     bf16  fp8   fp4
=========  ====  ====  ====================================
``h100``   1     2     2 (no FP4 tensor cores: runs as FP8)
``h200``   1     2     2 (as H100)
``b200``   1     2     4
``cpu``    1     1     1 (emulated: low precision brings no speed)
=========  ====  ====  ====================================

The modelled cost of a plan is its GEMM time relative to all-BF16 on the target::

    cost = Σ_g F_g / rate(c_g, target)  /  Σ_g F_g

over every GEMM ``g`` of every linear layer (``F_g`` its FLOPs on the measured batches).
All-BF16 is 1; uniform FP8 is 0.5; uniform FP4 on B200 is 0.25.

Example:
    >>> gemm_cost({("fc", "forward"): 2.0, ("fc", "weight_grad"): 2.0},
    ...           {("fc", "forward"): "nvfp4", ("fc", "weight_grad"): "fp8-rowwise"}, "b200")
    0.375
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lowprec.core.observe import GEMMS
from lowprec.float8 import Float8Config
from lowprec.float8.conv1d import is_conv1d

__all__ = [
    "CANDIDATES",
    "GEMMS",
    "RATES",
    "TARGETS",
    "candidate_config",
    "check_candidates",
    "check_target",
    "counting_flops",
    "format_class",
    "gemm_cost",
    "linear_layers",
    "rate",
]


# Candidate name -> float8 preset (None: the layer's own dtype, "bf16"), in order of cost
# on B200 and, within one cost, roughly of error (the measured error decides).
_PRESETS: dict[str, str | None] = {
    "bf16": None,
    "fp8-tensorwise": "tensorwise",
    "fp8-rowwise": "rowwise",
    "fp8-blockwise": "blockwise",
    "mxfp8": "mxfp8",
    "mxfp4": "mxfp4",
    "nvfp4": "nvfp4",
}
CANDIDATES: tuple[str, ...] = tuple(_PRESETS)
_CLASS = {"bf16": "bf16", "mxfp4": "fp4", "nvfp4": "fp4"}

# Dense tensor-core peaks relative to BF16 (NVIDIA's data sheets: H100/H200 SXM 989 TFLOPS
# BF16, 1979 FP8; B200 2.25 PFLOPS BF16, 4.5 FP8, 9 FP4).
RATES: dict[str, dict[str, float]] = {
    "h100": {"bf16": 1.0, "fp8": 2.0, "fp4": 2.0},
    "h200": {"bf16": 1.0, "fp8": 2.0, "fp4": 2.0},
    "b200": {"bf16": 1.0, "fp8": 2.0, "fp4": 4.0},
    "cpu": {"bf16": 1.0, "fp8": 1.0, "fp4": 1.0},
}
TARGETS: tuple[str, ...] = tuple(RATES)


def check_target(target: object) -> str:
    """``target`` if it is one of :data:`TARGETS`; ``ValueError`` naming them otherwise."""
    if not isinstance(target, str) or target not in RATES:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    return target


def check_candidates(candidates: object) -> tuple[str, ...]:
    """The candidates as a tuple in :data:`CANDIDATES` order, ``bf16`` always included
    (every GEMM's last fallback); ``ValueError``/``TypeError`` naming the bad entry."""
    if candidates is None:
        return CANDIDATES
    if isinstance(candidates, str) or not isinstance(candidates, Iterable):
        raise TypeError(f"candidates must be a sequence of names, got {candidates!r}")
    names = list(candidates)
    for c in names:
        if c not in _PRESETS:
            raise ValueError(f"candidates: unknown {c!r}; valid: {', '.join(CANDIDATES)}")
    return tuple(c for c in CANDIDATES if c in names or c == "bf16")


def format_class(candidate: str) -> str:
    """``bf16``, ``fp8`` or ``fp4``: the tensor-core class a candidate's GEMMs run in."""
    if candidate not in _PRESETS:
        raise ValueError(f"candidate: unknown {candidate!r}; valid: {', '.join(CANDIDATES)}")
    return _CLASS.get(candidate, "fp8")


def rate(candidate: str, target: str) -> float:
    """The GEMM rate of ``candidate`` on ``target``, relative to BF16 (module table)."""
    return RATES[check_target(target)][format_class(candidate)]


def candidate_config(candidate: str) -> Float8Config | None:
    """The float8 config of ``candidate`` (``None`` for ``bf16``: the layer's own dtype)."""
    format_class(candidate)
    preset = _PRESETS[candidate]
    return None if preset is None else Float8Config.from_name(preset)


def gemm_cost(
    flops: Mapping[tuple[str, str], float], choice: Mapping[tuple[str, str], str], target: str
) -> float:
    """``Σ F_g / rate(c_g) / Σ F_g`` (module docstring); a GEMM missing from ``choice`` is
    BF16. ``ValueError`` if there are no FLOPs."""
    total = sum(flops.values())
    if total <= 0:
        raise ValueError("flops: no GEMM FLOPs to weigh (the model ran no linear layer)")
    return sum(f / rate(choice.get(k, "bf16"), target) for k, f in flops.items()) / total


def linear_layers(model: nn.Module) -> list[str]:
    """The fully-qualified names of the linear-like layers (``nn.Linear``, HF ``Conv1D``)
    that :func:`lowprec.float8.apply` converts, in module order."""
    return [
        fqn for fqn, m in model.named_modules() if fqn and (type(m) is nn.Linear or is_conv1d(m))
    ]


@contextmanager
def counting_flops(model: nn.Module) -> Iterator[dict[tuple[str, str], float]]:
    """Count the FLOPs of each GEMM ``(fqn, gemm)`` of the linear layers of ``model`` while
    the block runs it, by forward hooks: a call with input ``x`` (``M·K`` elements) and
    output of last dimension ``N`` adds ``2·M·K·N`` FLOPs to each of its GEMMs that runs:
    the forward always; with autograd on, ``input_grad`` if ``x`` requires a gradient (not
    for a first layer fed data) and ``weight_grad`` if the weight does (not for a frozen
    one). The dict yielded is filled when the block ends.

    Example:
        >>> import torch
        >>> m = nn.Sequential(nn.Linear(4, 3))
        >>> with counting_flops(m) as flops:
        ...     _ = m(torch.zeros(5, 4))
        >>> flops[("0", "forward")]  # 2 · 5 · 4 · 3
        120.0
    """
    layers = linear_layers(model)
    counts = {(fqn, g): 0.0 for fqn in layers for g in GEMMS}
    mods = dict(model.named_modules())
    handles = []
    for fqn in layers:

        def hook(mod: nn.Module, args: Any, out: Any, fqn: str = fqn) -> None:
            if not (isinstance(out, Tensor) and args and isinstance(args[0], Tensor)):
                return
            f = 2.0 * args[0].numel() * out.shape[-1]
            counts[(fqn, "forward")] += f
            if torch.is_grad_enabled():
                w = getattr(mod, "weight", None)
                counts[(fqn, "input_grad")] += f if args[0].requires_grad else 0.0
                counts[(fqn, "weight_grad")] += (
                    f if isinstance(w, Tensor) and w.requires_grad else 0.0
                )

        handles.append(mods[fqn].register_forward_hook(hook))
    result: dict[tuple[str, str], float] = {}
    try:
        yield result
    finally:
        for h in handles:
            h.remove()
    result.update(counts)
