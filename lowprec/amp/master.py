"""FP32 master weights around an optimizer for FP16/BF16 parameters.

:class:`MasterWeights` keeps FP32 copies of FP16/BF16 parameters: gradients are copied to
FP32, the inner optimizer updates the FP32 copies, and the result is written back (rounded
to nearest, or stochastically for BF16/FP16: unbiased, ``E[round(m)] = m``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lowprec.core.rounding import quantize

__all__ = ["MasterWeights"]


class MasterWeights:
    """FP32 master copies of low-precision parameters around an inner optimizer.

    ``optimizer_factory(master_params)`` builds the inner optimizer on the FP32 copies.
    ``params`` may also be parameter groups (dicts with ``"params"`` and per-group options
    such as ``"lr"``): the factory then gets the same groups over the FP32 copies.
    ``step()`` copies the model's gradients to FP32 (if not yet done), runs the inner step,
    and writes the FP32 result back into the model's parameters: rounded to nearest, or
    with ``stochastic_rounding=True`` stochastically (unbiased; for BF16/FP16 parameters).

    Example:
        >>> model = nn.Linear(4, 2).bfloat16()
        >>> opt = MasterWeights(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> opt.master_params[0].dtype
        torch.float32
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_factory: Callable[[list[Any]], torch.optim.Optimizer],
        stochastic_rounding: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        given: list[Any] = list(params)
        groups: list[dict[str, Any]] | None = None
        if given and all(isinstance(g, dict) for g in given):
            groups = [dict(g) for g in given]
            for i, g in enumerate(groups):
                if "params" not in g:
                    raise ValueError(f"params: group {i} has no 'params' key")
                g["params"] = list(g["params"])
            self.model_params = [p for g in groups for p in g["params"]]
        elif any(isinstance(g, dict) for g in given):
            raise TypeError("params: mix of parameter groups (dicts) and parameters")
        else:
            self.model_params = given  # type: ignore[assignment]
        if not self.model_params:
            raise ValueError("params: no parameters given")
        self.master_params = [
            nn.Parameter(p.detach().to(torch.float32).clone()) for p in self.model_params
        ]
        if groups is None:
            self.optimizer = optimizer_factory(self.master_params)
        else:
            it = iter(self.master_params)
            master_groups = [{**g, "params": [next(it) for _ in g["params"]]} for g in groups]
            self.optimizer = optimizer_factory(master_groups)
        self.stochastic_rounding = stochastic_rounding
        self.generator = generator
        self._grads_copied = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def copy_grads(self) -> None:
        """Copy the model's gradients into the FP32 masters (once per step)."""
        if self._grads_copied:
            return
        for p, m in zip(self.model_params, self.master_params, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
        self._grads_copied = True

    @torch.no_grad()
    def step(self) -> None:
        self.copy_grads()
        self.optimizer.step()
        for p, m in zip(self.model_params, self.master_params, strict=True):
            if self.stochastic_rounding and p.dtype in (torch.bfloat16, torch.float16):
                fmt = "bf16" if p.dtype == torch.bfloat16 else "fp16"
                p.copy_(quantize(m, fmt, rounding="stochastic", generator=self.generator))
            else:
                p.copy_(m)
        self._grads_copied = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._grads_copied = False

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "master": [m.detach().clone() for m in self.master_params],
        }
        if self.generator is not None:
            out["generator"] = self.generator.get_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`: the FP32 masters, the inner optimizer's state, and
        the masters written back into the model's parameters (rounded to nearest into
        their dtype), so model and masters agree as after a ``step``. All or nothing:
        every master is checked (count, shape, floating dtype) before anything is
        assigned, and the inner optimizer's state is loaded first (a ``ValueError``
        there leaves masters and model unchanged)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        for key in ("master", "optimizer"):
            if key not in state:
                raise ValueError(f"state: no {key!r} entry")
        masters = state["master"]
        if not isinstance(masters, (list, tuple)):
            raise TypeError(
                f"state['master'] must be a list of tensors, got {type(masters).__name__}"
            )
        if len(masters) != len(self.master_params):
            raise ValueError(
                f"state: {len(masters)} master tensors for {len(self.master_params)} params"
            )
        for i, (m, s) in enumerate(zip(self.master_params, masters, strict=True)):
            if not isinstance(s, torch.Tensor) or not s.dtype.is_floating_point:
                raise TypeError(f"state['master'][{i}] must be a floating-point tensor")
            if s.shape != m.shape:
                raise ValueError(
                    f"state['master'][{i}]: shape {tuple(s.shape)}, the parameter's is "
                    f"{tuple(m.shape)}"
                )
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for p, m, s in zip(self.model_params, self.master_params, masters, strict=True):
                m.copy_(s)
                p.copy_(m)
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
        self._grads_copied = False
