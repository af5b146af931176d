"""Activation checkpointing and a float8 layer's scaling state.

``torch.utils.checkpoint`` runs a layer's forward a second time in backward, to rebuild
the tensors the first one did not keep. A delayed-scaling layer's forward both reads its
``amax`` history (the scale is ``amax_hist · 2^margin / fmt.max`` of the history *before*
this call) and records this call's ``amax`` in it; a stochastically rounding layer draws
from the step counter of its ``rng_state`` and advances it. Run again, the forward would
read the history that already holds this call's ``amax`` (another scale: its rebuilt
tensors, and so the gradients, would be those of another forward) and record it a second
time (the window would cover half as many steps).

:class:`ForwardReplay` keeps what each training forward of a layer used (its scales and
step counter) and hands it back to the recomputation of that forward, which then records
nothing. A recomputation is a training-mode forward run while the autograd engine runs a
backward (:func:`recomputing`). Calls are matched latest first, as backward mostly
recomputes them, among those whose input has the same ``amax`` (a recomputation sees the
same input, bit for bit). Under ``torch.compile`` (whose checkpointing recomputes inside its
own graph) nothing is kept.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from lowprec.core.warn import warn_once

__all__ = ["ForwardReplay", "recomputing"]

log = logging.getLogger("lowprec.float8")
_LIMIT = 64  # calls kept: more than any layer's calls between a forward and its backward


def recomputing(training: bool) -> bool:
    """Whether a forward in ``training`` mode is a recomputation run by a backward
    (activation checkpointing): the autograd engine is running a graph task."""
    if not training or torch.compiler.is_compiling():
        return False
    return bool(torch._C._current_graph_task_id() != -1)


class ForwardReplay:
    """What a layer's training forwards used, for their recomputations (module doc).

    Each forward is kept with a key computed from its input (its ``amax``: a recomputation
    sees the same input, bit for bit); a recomputation takes the latest forward with an
    equal key (backward recomputes the regions last first, and a region's calls in their
    order)."""

    def __init__(self) -> None:
        self._calls: list[tuple[Tensor, Any]] = []

    def save(self, key: Tensor, used: Any) -> None:
        """Keep what one training forward (not a recomputation) used."""
        self._calls.append((key, used))
        del self._calls[:-_LIMIT]

    def take(self, key: Tensor) -> Any | None:
        """What the latest kept forward with input key ``key`` used, no longer kept;
        ``None`` (with a WARNING) if none matches."""
        for i in range(len(self._calls) - 1, -1, -1):
            k, used = self._calls[i]
            if k.shape == key.shape and bool(torch.equal(k, key)):
                del self._calls[i]
                return used
        warn_once(
            log,
            "float8:replay:unmatched",
            "float8: a forward recomputed in backward (activation checkpointing) matches no "
            "forward of this layer kept for it; its scales are read from the scaling state "
            "as it is now (the gradients may be those of another scale)",
        )
        return None
