"""Tensors inside the structures a model takes and returns: pytrees and plain objects.

A scalify'd module's floating inputs enter scaled arithmetic and its outputs leave it. They
may sit in pytrees (tuples, lists, dicts, dataclasses and ``ModelOutput``\\ s registered
with ``torch.utils._pytree``), or in objects pytree does not know, such as a KV cache
(HF's ``DynamicCache`` holds its keys and values in ``cache.layers[i].keys``): the model
reads and *updates* those in place. :func:`convert` maps every tensor reachable from a
value through pytrees and, for other objects, their attributes (and the lists, tuples and
dicts in them), replacing attributes in place; ``nn.Module``\\ s are not entered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

__all__ = ["convert"]

_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)
_DEPTH = 6  # attribute levels walked into objects (a cache's layers are 2 deep)


def convert(x: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``x`` with every reachable tensor ``t`` replaced by ``fn(t)``: pytrees are rebuilt,
    other objects (caches) are updated in place and returned themselves."""
    return _convert(x, fn, 0, set())


def _convert(x: Any, fn: Callable[[Tensor], Tensor], depth: int, seen: set[int]) -> Any:
    def leaf(v: Any) -> Any:
        if isinstance(v, Tensor):
            return fn(v)
        if isinstance(v, _ATOMS) or isinstance(v, nn.Module) or depth >= _DEPTH:
            return v
        if id(v) in seen:
            return v
        seen.add(id(v))
        if isinstance(v, (list, tuple, dict)):  # a subclass pytree did not flatten
            return v
        state = getattr(v, "__dict__", None)
        if isinstance(state, dict):
            for name, val in list(state.items()):
                new = _convert(val, fn, depth + 1, seen)
                if new is not val:
                    setattr(v, name, new)
        return v

    if isinstance(x, list) and depth:  # a list inside an object: updated in place
        for i, v in enumerate(x):
            x[i] = _convert(v, fn, depth, seen)
        return x
    return tree_map(leaf, x)
