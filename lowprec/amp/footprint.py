"""Bytes of training state per parameter: parameters, master weights, optimizer states.

:func:`training_state_bytes` counts what a run keeps between steps, by storage: every
tensor's underlying storage once (a view of another counted tensor adds nothing), after
the optimizer has created its states (call it after a step). Three parts:

* ``params``: the model's parameters (``param_dtype`` bytes each);
* ``masters``: the FP32 copies of :class:`~lowprec.amp.MasterWeights` and the 16-bit
  remainders of a :mod:`lowprec.amp.lean` optimizer with ``master="remainder"``;
* ``optimizer``: every other tensor in the optimizer's state (moments with their block
  scales, step counters).

``per_param`` is their sum over the number of model parameter elements. Gradients,
activations and module buffers are not training *state* (they are rebuilt each step, or
belong to the technique) and are not counted.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(256, 256, bias=False)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> model(torch.randn(2, 256)).sum().backward(); opt.step()
    >>> training_state_bytes(model, opt)["per_param"]  # FP32 weight + two FP32 moments (+ step)
    12.00006103515625
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["training_state_bytes"]


def _tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def training_state_bytes(model: nn.Module, optimizer: Any) -> dict[str, float]:
    """``{"params", "masters", "optimizer", "total", "numel", "per_param"}`` for ``model``
    trained by ``optimizer`` (module docstring)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    seen: set[tuple[str, int]] = set()

    def count(tensors: list[Tensor]) -> int:
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            key = (str(t.device), s.data_ptr())
            if key not in seen and s.nbytes() > 0:
                seen.add(key)
                total += s.nbytes()
        return total

    params: list[Tensor] = list(model.parameters())
    numel = sum(p.numel() for p in {id(p): p for p in params}.values())
    out = {"params": float(count(params))}
    masters: list[Tensor] = list(getattr(optimizer, "master_params", []))
    state = getattr(optimizer, "state", {})
    for st in state.values():
        if isinstance(st, dict) and isinstance(st.get("remainder"), Tensor):
            masters.append(st["remainder"])
    out["masters"] = float(count(masters))
    out["optimizer"] = float(count(_tensors(list(state.values()))))
    out["total"] = out["params"] + out["masters"] + out["optimizer"]
    out["numel"] = float(numel)
    out["per_param"] = out["total"] / max(numel, 1)
    return out
