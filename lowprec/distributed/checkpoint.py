"""Sharded checkpoints of a parallel run with ``torch.distributed.checkpoint`` (DCP).

:func:`save` writes, into one DCP directory, everything a run needs to continue:

* the model (parameters and buffers: float8 amax histories and calibration maxima, the
  scaling state, are buffers);
* the optimizer state and the master weights: under FSDP2 the FP32 shards are both the
  parameters and the masters, saved sharded as DTensors by parameter name
  (``get_state_dict``); under DDP the model, the ``MasterWeights`` (FP32 copies and the
  inner optimizer) are replicated and each tensor is written once;
* the loss scaler's state and the recipe;
* ``extra``: anything else the caller adds (step, data position, RNG states), any nesting
  of dicts, lists, numbers and tensors.

Every rank calls :func:`save` and :func:`load` together. DCP writes each rank's shards in
parallel and the metadata last (``.metadata``): a directory without it is incomplete.

Resharding. An FSDP2 checkpoint stores each parameter and each optimizer moment by its
name and global shape; :func:`load` reads the pieces this rank's shards need, whatever the
world size that wrote it (``set_state_dict``). Resumed on the same world size, every
tensor is restored bit for bit; on another, the values are the same bits, but the
gradient sums are split differently, so the run continues within float rounding of the
original (``docs/distributed.md`` states the measured tolerance).

Layout: tensors are stored under ``"<part>/<path>"`` keys; the structure with every
tensor replaced by its key is stored as one pickled object (``"skeleton"``; DCP itself
unpickles the objects of a checkpoint: load only checkpoints you trust), so that any nested
state (a ``MasterWeights`` state dict, the scaler's history) round-trips without a
template.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from lowprec.distributed.parallel import unwrap
from lowprec.recipes.prepared import Prepared
from lowprec.recipes.recipe import Recipe

__all__ = ["is_sharded", "load", "save"]

_TENSOR = "\0tensor:"  # marks a tensor's key in the skeleton


def is_sharded(prepared: Prepared) -> bool:
    """Whether ``prepared``'s parameters are FSDP2 shards (DTensors)."""
    return any(isinstance(p, DTensor) for p in prepared.model.parameters())


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a plain local tensor: a DTensor whose local shard is a tensor subclass
    (an FP8 all-gather weight wrapping its FP32 master) as the same DTensor over the
    wrapped tensor (shares its memory), which DCP can write and read."""
    if isinstance(t, DTensor):
        local = t.to_local()
        if type(local) is not torch.Tensor and hasattr(local, "__tensor_flatten__"):
            names, _ = local.__tensor_flatten__()
            return DTensor.from_local(
                getattr(local, names[0]),
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
    return t


def _flatten(obj: Any, path: str, out: dict[str, Any]) -> Any:
    """``obj`` with every tensor replaced by a marker of its key; the tensors go to ``out``."""
    if isinstance(obj, torch.Tensor):
        out[path] = _plain(obj)
        return _TENSOR + path
    if isinstance(obj, dict):
        return {k: _flatten(v, f"{path}/{k}", out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{path}/{i}", out) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _rebuild(skeleton: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(skeleton, str) and skeleton.startswith(_TENSOR):
        return tensors[skeleton[len(_TENSOR) :]]
    if isinstance(skeleton, dict):
        return {k: _rebuild(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        items = [_rebuild(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


_OPTIONS = StateDictOptions(strict=True)


def _live_state(prepared: Prepared) -> dict[str, Any]:
    """The model and optimizer state of ``prepared`` (sharded: DCP's own state dicts,
    by parameter name), plus the scaler and the recipe."""
    if is_sharded(prepared):
        model, optim = get_state_dict(prepared.model, prepared.optimizer, options=_OPTIONS)
        mode = "fsdp"
    else:
        model, optim = unwrap(prepared.model).state_dict(), prepared.optimizer.state_dict()
        mode = "replicated"
    return {
        "model": model,
        "optimizer": optim,
        "scaler": prepared.scaler.state_dict(),
        "recipe": prepared.recipe.to_dict(),
        "layout": mode,
    }


def save(prepared: Prepared, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write ``prepared``'s state and ``extra`` to the DCP directory ``path`` (every rank
    calls it). See the module docstring for what is saved."""
    state = {**_live_state(prepared), "extra": extra or {}}
    tensors: dict[str, Any] = {}
    skeleton = _flatten(state, "", tensors)
    blob = pickle.dumps(skeleton)  # one opaque object: DCP would flatten a nested dict
    dcp_save({"skeleton": blob, **tensors}, checkpoint_id=str(path))


def load(prepared: Prepared, path: str | Path) -> dict[str, Any]:
    """Restore ``prepared`` from the DCP directory ``path`` (every rank calls it) and
    return the ``extra`` that :func:`save` stored. ``ValueError`` if it was saved with
    another recipe or layout (FSDP2 shards vs a replicated model)."""
    path = str(path)
    box: dict[str, Any] = {"skeleton": None}
    dcp_load(box, checkpoint_id=path)
    skeleton = pickle.loads(box["skeleton"]) if isinstance(box["skeleton"], bytes) else None
    if not isinstance(skeleton, dict) or "recipe" not in skeleton:
        raise ValueError(f"checkpoint {path}: not a lowprec checkpoint (no skeleton)")
    if Recipe.from_dict(skeleton["recipe"]) != prepared.recipe:
        raise ValueError(
            f"checkpoint {path}: saved with recipe {skeleton['recipe'].get('name')!r}, not "
            f"{prepared.recipe.name!r}"
        )
    live = _live_state(prepared)
    if skeleton["layout"] != live["layout"]:
        raise ValueError(
            f"checkpoint {path}: saved with layout {skeleton['layout']!r} (fsdp: sharded, "
            f"replicated: ddp or one process), this run is {live['layout']!r}"
        )
    # The template: this run's own tensors (DTensors: the shards this rank needs), and for
    # what this run does not hold yet (loaded optimizer moments, extra) the saved shapes.
    template: dict[str, Any] = {}
    _flatten(live, "", template)
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    wanted: dict[str, Any] = {}
    for key, md in meta.items():
        if key == "skeleton" or not isinstance(md, TensorStorageMetadata):
            continue
        own = template.get(key)
        if isinstance(own, torch.Tensor) and tuple(own.shape) == tuple(md.size):
            wanted[key] = own if isinstance(own, DTensor) else torch.empty_like(own)
        else:
            wanted[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp_load(wanted, checkpoint_id=path)
    state = _rebuild(skeleton, wanted)
    if live["layout"] == "fsdp":
        set_state_dict(
            prepared.model,
            prepared.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_OPTIONS,
        )
    else:
        unwrap(prepared.model).load_state_dict(state["model"])
        prepared.optimizer.load_state_dict(state["optimizer"])
    prepared.scaler.load_state_dict(state["scaler"])
    extra: dict[str, Any] = state["extra"]
    return extra
