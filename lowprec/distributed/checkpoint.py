"""Sharded checkpoints of a parallel run with ``torch.distributed.checkpoint`` (DCP).

:func:`save` writes, into one DCP directory, everything a run needs to continue:

* the model (parameters and buffers: float8 amax histories and calibration maxima, the
  scaling state, are buffers);
* the optimizer state and the master weights: under FSDP2 the FP32 shards are both the
  parameters and the masters, saved sharded as DTensors by parameter name
  (``get_state_dict``); under DDP the model, the ``MasterWeights`` (FP32 copies and the
  inner optimizer) are replicated and each tensor is written once;
* a lean optimizer's (:mod:`lowprec.amp.lean`) sharded states as the parameters are
  (``DTensor`` objects holding the parameter's rows: codes, block scales, remainders) and its
  stochastic-rounding generator (``optimizer_extra``: ``get_state_dict`` keeps only
  ``state`` and ``param_groups`` of an optimizer's state dict), so a resumed run draws the
  same numbers;
* the loss scaler's state, the recipe and the optimizer's class;
* ``extra``: anything else the caller adds (step, data position, RNG states), any nesting
  of dicts, lists, numbers and tensors.

Every rank calls :func:`save` and :func:`load` together. DCP writes each rank's shards in
parallel and the metadata last (``.metadata``): a directory without it is incomplete.

Resharding. An FSDP2 checkpoint stores each parameter and each optimizer moment by its
name and global shape; :func:`load` reads the pieces this rank's shards need, whatever the
world size that wrote it (``set_state_dict``). Resumed on the same world size, every
tensor is restored bit for bit; on another, the values are the same bits, but the
gradient sums are split differently, so the run continues within float rounding of the
original (``docs/distributed.md`` states the measured tolerance). Lean 8-bit states
reshard exactly too: their blocks lie along rows and never cross a shard
(:mod:`lowprec.amp.state_codec`), so a rank's rows of the saved codes and scales are
the ones it would have computed.

Layout (format 2): tensors are stored under ``"<part>/<path>"`` keys. The structure, with
every tensor replaced by a reference to its key, is stored as a JSON index in one
``uint8`` tensor (``"lowprec.index"``), so that any nested state (a ``MasterWeights``
state dict, the scaler's history, ``extra``) round-trips without a template.

**Loading never runs code from the checkpoint.** DCP's own reader unpickles the
checkpoint's ``.metadata`` file and any non-tensor object; :func:`load` does neither. It
reads ``.metadata`` with an unpickler that rebuilds only DCP's metadata classes, torch's
dtypes, layouts and sizes (anything else is refused, so a payload never runs), and asks
DCP for tensors alone, which DCP reads with ``torch.load(weights_only=True)``. The index is
parsed as JSON and validated. Checkpoints of format 1 (lowprec before this change: the
structure was a pickle, ``"skeleton"``) are refused with an error that says so; they are
never unpickled.
"""

from __future__ import annotations

import io
import json
import math
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
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
from lowprec.scalify.transform import Scalified

__all__ = ["FORMAT", "full_state_dict", "is_sharded", "load", "save"]

FORMAT = 2
"""The checkpoint format :func:`save` writes and :func:`load` reads (1: a pickled
structure, refused)."""
_INDEX = "lowprec.index"  # the JSON index, as a uint8 tensor
_LEGACY = "skeleton"  # format 1: the pickled structure


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


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every FSDP2 shard gathered into the whole tensor (an
    FP8 all-gather weight as its FP32 master), on every rank: a collective that every rank
    of the mesh calls, in the same order. Plain tensors (replicated buffers) are detached
    as they are. For writing the unsharded model (``save_pretrained``) from one rank."""
    out: dict[str, torch.Tensor] = {}
    for k, v in unwrap(model).state_dict().items():
        if isinstance(v, DTensor):
            whole = _plain(v)
            assert isinstance(whole, DTensor)
            out[k] = whole.full_tensor()
        else:
            out[k] = v.detach()
    return out


_SCALARS = (str, int, bool, type(None))


def _encode(obj: Any, path: str, out: dict[str, Any]) -> Any:
    """``obj`` as JSON values, every tensor replaced by ``{"tensor": key}`` (the tensors go
    to ``out``). Containers are tagged (``{"dict": [[key, value], ...]}``, ``{"list": [...]}``,
    ``{"tuple": [...]}``) so that int keys and tuples come back as they were; non-finite
    floats are ``{"float": "nan" | "inf" | "-inf"}``. Anything else raises ``TypeError``."""
    if isinstance(obj, torch.Tensor):
        if path in out:
            raise ValueError(f"checkpoint: two entries of the state map to the key {path!r}")
        out[path] = _plain(obj)
        return {"tensor": path}
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, _SCALARS):
                raise TypeError(
                    f"checkpoint: {path or 'the state'} has a key of type {type(k).__name__} "
                    "(keys must be str, int, bool or None)"
                )
            items.append([k, _encode(v, f"{path}/{k}", out)])
        return {"dict": items}
    if isinstance(obj, (list, tuple)):
        tag = "list" if isinstance(obj, list) else "tuple"
        return {tag: [_encode(v, f"{path}/{i}", out) for i, v in enumerate(obj)]}
    raise TypeError(
        f"checkpoint: {path or 'the state'} holds a {type(obj).__name__}; a checkpoint stores "
        "dicts, lists, tuples, str, int, float, bool, None and tensors"
    )


def _tensor_keys(node: Any, out: dict[str, None]) -> None:
    """The tensor keys an index refers to (``ValueError`` on anything malformed)."""
    if isinstance(node, dict):
        if len(node) != 1:
            raise ValueError(f"malformed index entry {str(node)[:80]}")
        ((tag, v),) = node.items()
        if tag == "tensor" and isinstance(v, str):
            out[v] = None
        elif tag == "float" and v in ("nan", "inf", "-inf"):
            pass
        elif tag == "dict" and isinstance(v, list):
            for pair in v:
                if not (
                    isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], _SCALARS)
                ):
                    raise ValueError(f"malformed index dict item {str(pair)[:80]}")
                _tensor_keys(pair[1], out)
        elif tag in ("list", "tuple") and isinstance(v, list):
            for x in v:
                _tensor_keys(x, out)
        else:
            raise ValueError(f"malformed index entry {str(node)[:80]}")
    elif not isinstance(node, (*_SCALARS, float)):
        raise ValueError(f"malformed index value {str(node)[:80]}")


def _decode(node: Any, tensors: dict[str, Any]) -> Any:
    """The inverse of :func:`_encode` (``node`` already validated by :func:`_tensor_keys`)."""
    if not isinstance(node, dict):
        return node
    ((tag, v),) = node.items()
    if tag == "tensor":
        return tensors[v]
    if tag == "float":
        return float(v)
    if tag == "dict":
        return {k: _decode(x, tensors) for k, x in v}
    items = [_decode(x, tensors) for x in v]
    return items if tag == "list" else tuple(items)


# DCP's ``.metadata`` is a pickle of these classes; nothing else is rebuilt from it.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP metadata and refuses every other global (so no payload can run)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (not DCP metadata)")


class _SafeReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` is read by :class:`_MetadataUnpickler`, and
    whose storage entries must be files inside the checkpoint directory."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _read_metadata(f)
        for info in (metadata.storage_data or {}).values():
            rel = Path(str(getattr(info, "relative_path", "")))
            if rel.is_absolute() or ".." in rel.parts or len(rel.parts) != 1:
                raise ValueError(f"storage entry {str(rel)!r} is not a file of the checkpoint")
        return metadata


def _read_metadata(f: IO[bytes] | io.IOBase) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise ValueError(f"unreadable DCP metadata ({e})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"unreadable DCP metadata (a {type(metadata).__name__})")
    return metadata


_OPTIONS = StateDictOptions(strict=True)


def _root(prepared: Prepared) -> nn.Module:
    """The module whose attribute paths are its state dict's keys, as DCP's state dicts
    need: a :class:`~lowprec.scalify.transform.Scalified` wrapper's keys are those of the
    model it wraps (no ``module.``), so that model."""
    return prepared.model.module if isinstance(prepared.model, Scalified) else prepared.model


def _optimizer_extra(optimizer: Any) -> dict[str, Any]:
    """What ``get_state_dict`` drops of a sharded optimizer's state: the generator of a
    lean optimizer (``{}`` for others)."""
    gen = getattr(optimizer, "generator", None)
    return {"generator": gen.get_state()} if isinstance(gen, torch.Generator) else {}


def _optimizer_kind(optimizer: Any) -> str:
    """The optimizer's class, with the inner optimizer's for a wrapper (``MasterWeights``):
    ``"MasterWeights(AdamW)"``, ``"LeanAdamW"``, ``"SGD"``."""
    inner = getattr(optimizer, "optimizer", None)
    name = type(optimizer).__name__
    return f"{name}({type(inner).__name__})" if isinstance(inner, torch.optim.Optimizer) else name


def _live_state(prepared: Prepared) -> dict[str, Any]:
    """The model and optimizer state of ``prepared`` (sharded: DCP's own state dicts,
    by parameter name, and :func:`_optimizer_extra`), plus the scaler and the recipe."""
    extra: dict[str, Any] = {}
    if is_sharded(prepared):
        model, optim = get_state_dict(_root(prepared), prepared.optimizer, options=_OPTIONS)
        mode = "fsdp"
        extra = _optimizer_extra(prepared.optimizer)
    else:
        model, optim = unwrap(prepared.model).state_dict(), prepared.optimizer.state_dict()
        mode = "replicated"
    return {
        "model": model,
        "optimizer": optim,
        "optimizer_extra": extra,
        "scaler": prepared.scaler.state_dict(),
        "calibration": prepared.calibration_progress(),
        "recipe": prepared.recipe.to_dict(),
        "layout": mode,
        "optimizer_kind": _optimizer_kind(prepared.optimizer),
    }


def save(prepared: Prepared, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write ``prepared``'s state and ``extra`` to the DCP directory ``path`` (every rank
    calls it). See the module docstring for what is saved."""
    state = {**_live_state(prepared), "extra": extra or {}}
    tensors: dict[str, Any] = {}
    index = {"format": FORMAT, "state": _encode(state, "", tensors)}
    data = json.dumps(index, allow_nan=False).encode("utf-8")
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dcp_save({_INDEX: blob, **tensors}, checkpoint_id=str(path))


def load(prepared: Prepared, path: str | Path) -> dict[str, Any]:
    """Restore ``prepared`` from the DCP directory ``path`` (every rank calls it) and
    return the ``extra`` that :func:`save` stored. ``ValueError`` if it was saved with
    another recipe, layout (FSDP2 shards vs a replicated model) or optimizer class (an
    AdamW state would load its rates and moments into an SGD)."""
    path = str(path)
    reader = _SafeReader(path)
    try:
        meta = reader.read_metadata().state_dict_metadata
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {path}: not a readable DCP checkpoint ({e})") from None
    index_md = meta.get(_INDEX)
    if not isinstance(index_md, TensorStorageMetadata):
        if _LEGACY in meta:
            raise ValueError(
                f"checkpoint {path}: written in lowprec checkpoint format 1, whose structure is "
                f"a pickle; lowprec {FORMAT} reads format {FORMAT} only and never unpickles a "
                "checkpoint. Save it again with this version from the run that wrote it"
            )
        raise ValueError(f"checkpoint {path}: not a lowprec checkpoint (no {_INDEX!r})")
    box = {_INDEX: torch.empty(index_md.size, dtype=torch.uint8)}
    dcp_load(box, storage_reader=_SafeReader(path))
    try:
        index = json.loads(bytes(box[_INDEX].numpy()).decode("utf-8"))
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ValueError(f"format {index.get('format') if isinstance(index, dict) else '?'}")
        keys: dict[str, None] = {}
        _tensor_keys(index["state"], keys)
        skeleton = _decode(index["state"], {k: k for k in keys})  # keys stand in for tensors
        if not isinstance(skeleton, dict) or not {"recipe", "layout", "extra"} <= set(skeleton):
            raise ValueError("missing recipe, layout or extra")
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint {path}: malformed lowprec index ({e})") from None
    for k in keys:
        if not isinstance(meta.get(k), TensorStorageMetadata):
            raise ValueError(f"checkpoint {path}: the index names tensor {k!r}, which is missing")
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
    saved_kind = skeleton.get("optimizer_kind")  # (absent from checkpoints before it)
    if saved_kind is not None and saved_kind != live["optimizer_kind"]:
        raise ValueError(
            f"checkpoint {path}: saved with optimizer {saved_kind}, this run has "
            f"{live['optimizer_kind']}: its state and hyperparameters would load into the "
            "wrong optimizer"
        )
    # The template: this run's own tensors (DTensors: the shards this rank needs), and for
    # what this run does not hold yet (loaded optimizer moments, extra) the saved shapes.
    template: dict[str, Any] = {}
    _encode(live, "", template)
    wanted: dict[str, Any] = {}
    for key in keys:  # tensors only: DCP is never asked for a pickled object
        md = meta[key]
        assert isinstance(md, TensorStorageMetadata)
        own = template.get(key)
        if isinstance(own, torch.Tensor) and tuple(own.shape) == tuple(md.size):
            wanted[key] = own if isinstance(own, DTensor) else torch.empty_like(own)
        else:
            wanted[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp_load(wanted, storage_reader=_SafeReader(path))
    state = _decode(index["state"], wanted)
    if live["layout"] == "fsdp":
        set_state_dict(
            _root(prepared),
            prepared.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_OPTIONS,
        )
        saved_gen = (state.get("optimizer_extra") or {}).get("generator")
        gen = getattr(prepared.optimizer, "generator", None)
        if isinstance(gen, torch.Generator) and isinstance(saved_gen, torch.Tensor):
            gen.set_state(saved_gen.cpu())
    else:
        unwrap(prepared.model).load_state_dict(state["model"])
        prepared.optimizer.load_state_dict(state["optimizer"])
    prepared.scaler.load_state_dict(state["scaler"])
    prepared.resume_calibration(state.get("calibration"))
    extra: dict[str, Any] = state["extra"]
    return extra
