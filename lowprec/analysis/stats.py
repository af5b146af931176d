"""Statistics of tensors and gradients: the one implementation behind every report.

``lowprec.amp.grad_stats``, the training job's activation-gradient meter and the numerics
tracker all count through this module. It depends on :mod:`lowprec.core` only, so any
technique may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["grad_stats"]


def grad_stats(params: Iterable[Tensor]) -> dict[str, float]:
    """Share of gradient values that are exactly zero and that are non-finite, and the
    global gradient L2 norm (in FP32), over all parameters that have a gradient."""
    total = 0
    zeros = torch.zeros((), dtype=torch.float64)
    nonfinite = torch.zeros((), dtype=torch.float64)
    sq = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad
        if g is None:
            continue
        total += g.numel()
        zeros += (g == 0).sum()
        fin = torch.isfinite(g)
        nonfinite += (~fin).sum()
        sq += torch.where(fin, g.double(), 0.0).pow(2).sum()
    if total == 0:
        return {"grad_zero_share": 0.0, "grad_nonfinite_share": 0.0, "grad_norm": 0.0}
    return {
        "grad_zero_share": float(zeros) / total,
        "grad_nonfinite_share": float(nonfinite) / total,
        "grad_norm": math.sqrt(float(sq)),
    }
