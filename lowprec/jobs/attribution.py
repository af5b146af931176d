"""Which layers explain a run's gap: the loss when one layer alone goes back to high precision.

For a trained model whose layers run in low precision (float8 linears, unit scaling's FP8
products), :func:`attribute` measures the loss ``L`` on a few batches as trained, then for
each lowered layer ``ℓ`` the loss ``L_ℓ`` with only ``ℓ`` in high precision (its parameters
unchanged), and ranks the layers by ``gain = (L − L_ℓ) / L``: the share of the loss that
layer's low precision costs. :func:`attribute_run` does it on a ``lowprec train`` run
directory's final checkpoint and validation batches (the report's "layers that explain
the gap").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lowprec.float8 import Float8Linear
from lowprec.float8.convert import replace_layer
from lowprec.jobs.rundir import CHECKPOINT, RunError, load_checkpoint
from lowprec.jobs.train_config import saved_config
from lowprec.jobs.train_setup import build
from lowprec.recipes import Prepared

__all__ = ["attribute", "attribute_run", "high_precision", "lowered_layers"]


def _lowered(m: nn.Module) -> bool:
    if isinstance(m, Float8Linear):
        return len(m.recipe.high_precision_gemms) < 3
    return getattr(m, "float8", None) is True  # a unit-scaled module with FP8 casts


def lowered_layers(model: nn.Module) -> list[str]:
    """The fully-qualified names of the layers of ``model`` that compute in low precision:
    float8 linears with a GEMM not in high precision, and unit-scaled modules with FP8 casts
    (``float8=True``) that hold no such module below them."""
    out = []
    for name, m in model.named_modules():
        if _lowered(m) and not any(_lowered(c) for c in m.modules() if c is not m):
            out.append(name)
    return out


@contextmanager
def high_precision(model: nn.Module, fqn: str) -> Iterator[None]:
    """Inside the block the layer at ``fqn`` computes in high precision (a float8 linear
    replaced by its plain layer, :func:`~lowprec.float8.convert.replace_layer`; a unit
    module's FP8 casts off); the original module is back afterwards, untouched."""
    mod = model.get_submodule(fqn)
    if isinstance(mod, Float8Linear):
        parent_name, _, leaf = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replace_layer(model, fqn, None)
        try:
            yield
        finally:
            setattr(parent, leaf, mod)
    elif _lowered(mod):
        mod.__dict__["float8"] = False  # a unit module's plain attribute
        try:
            yield
        finally:
            mod.__dict__["float8"] = True
    else:
        raise ValueError(f"fqn: {fqn!r} is not a low-precision layer of the model")


@torch.no_grad()
def _loss(prepared: Prepared, batches: Sequence[tuple[Tensor, Tensor]]) -> float:
    total = 0.0
    with prepared.compute():
        for x, y in batches:
            _, loss = prepared.model(x, y)
            total += float(loss)
    return total / max(len(batches), 1)


def attribute(prepared: Prepared, batches: Sequence[tuple[Tensor, Tensor]]) -> list[dict[str, Any]]:
    """``[{"layer", "loss", "gain"}, ...]`` for each lowered layer, largest ``gain`` first
    (module docstring), and the loss as trained as the first entry's ``"base"``; the model
    (``prepared.model(x, y) -> (logits, loss)``) is evaluated in eval mode and left as it
    was."""
    model = prepared.model
    was = model.training
    model.eval()
    try:
        base = _loss(prepared, batches)
        rows = []
        for fqn in lowered_layers(model):
            with high_precision(model, fqn):
                loss = _loss(prepared, batches)
            rows.append({"layer": fqn, "loss": loss, "gain": (base - loss) / base, "base": base})
    finally:
        model.train(was)
    return sorted(rows, key=lambda r: -r["gain"])


def attribute_run(out: str | Path, batches: int = 4) -> list[dict[str, Any]]:
    """:func:`attribute` on the final checkpoint of the ``lowprec train`` run directory
    ``out``, over its first ``batches`` validation batches. :class:`RunError` if the run has
    no single-process checkpoint (an own-loop run, a distributed one) or it does not load."""
    out = Path(out)
    if not (out / CHECKPOINT).is_file():
        raise RunError(f"{out}: no {CHECKPOINT} (a run of `lowprec train` on one process)")
    cfg = saved_config(out)
    prepared, data = build(cfg)
    state = load_checkpoint(out)
    try:
        prepared.load_state_dict(state["run"])
    except (ValueError, KeyError, RuntimeError, TypeError) as e:
        raise RunError(f"{out / CHECKPOINT} does not fit its run ({e})") from None
    return attribute(prepared, [data.batch("val", i) for i in range(batches)])
