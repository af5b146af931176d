"""Mixed precision: loss scaling, FP32 master weights, FP32 sensitive ops.

Loss scaling multiplies the loss by ``S`` before ``backward`` so that small gradients stay
above the format's smallest subnormal (FP16: ``2^-24``), then divides the gradients by ``S``
in FP32 before the update. A step whose gradients hold Inf/NaN is skipped.

The API follows ``torch.amp.GradScaler``::

    scaler = DynamicLossScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)        # optional: to clip gradients first
    scaler.step(optimizer)            # skipped if a gradient is Inf/NaN
    scaler.update()                   # dynamic: back off on overflow, grow when stable

Every step appends ``StepRecord(scale, skipped)`` to ``scaler.history``.

:class:`MasterWeights` keeps FP32 copies of FP16/BF16 parameters: gradients are copied to
FP32, the inner optimizer updates the FP32 copies, and the result is written back (rounded
to nearest, or stochastically for BF16).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from lowprec.analysis.stats import grad_stats
from lowprec.core.rounding import quantize

__all__ = [
    "DynamicLossScaler",
    "Fp16MatmulInFp32",
    "LossScaler",
    "MasterWeights",
    "MatmulInFp32",
    "NoLossScaler",
    "StaticLossScaler",
    "StepRecord",
    "cross_entropy_fp32",
    "grad_stats",
    "layer_norm_fp32",
    "native_bf16_matmul",
    "softmax_fp32",
]


@dataclass(frozen=True)
class StepRecord:
    """What a loss scaler did at one step: the scale used and whether it skipped."""

    scale: float
    skipped: bool


def _params(optimizer: Any) -> list[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


class LossScaler:
    """Base class: scale ``S`` fixed at construction, skip on Inf/NaN gradients."""

    def __init__(self, scale: float = 1.0) -> None:
        _check_positive("scale", scale)
        self._scale = float(scale)
        self.history: list[StepRecord] = []
        self._unscaled: set[int] = set()
        self._found_inf: bool = False

    @property
    def loss_scale(self) -> float:
        return self._scale

    @property
    def skipped_steps(self) -> int:
        return sum(r.skipped for r in self.history)

    def scale(self, loss: Tensor) -> Tensor:
        """``loss · S``, computed in FP32."""
        if not isinstance(loss, Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__}")
        return loss.float() * self._scale

    def unscale_(self, optimizer: Any) -> None:
        """Divide the optimizer's gradients by ``S`` (in FP32 for FP32 gradients) and record
        whether any is Inf/NaN. Call at most once per step (``step`` calls it otherwise)."""
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer this step")
        if isinstance(optimizer, MasterWeights):
            optimizer.copy_grads()
        inv = 1.0 / self._scale
        found: Tensor | None = None  # accumulated on the gradients' device: one sync
        for p in _params(optimizer):
            if p.grad is None:
                continue
            if inv != 1.0:
                p.grad.mul_(inv)
            bad = ~torch.isfinite(p.grad).all()
            found = bad if found is None else found | bad.to(found.device)
        self._found_inf = found is not None and bool(found)
        self._unscaled.add(id(optimizer))

    def step(self, optimizer: Any) -> bool:
        """Unscale if not done, then ``optimizer.step()`` unless a gradient is Inf/NaN.

        Returns True if the update was applied."""
        if id(optimizer) not in self._unscaled:
            self.unscale_(optimizer)
        skipped = self._found_inf
        self.history.append(StepRecord(self._scale, skipped))
        if not skipped:
            optimizer.step()
        return not skipped

    def update(self) -> None:
        """End the step (a fixed scale does not change)."""
        self._unscaled.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "type": type(self).__name__,
            "scale": self._scale,
            "history": [(r.scale, r.skipped) for r in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("type") != type(self).__name__:
            raise ValueError(
                f"state: saved by {state.get('type')}, cannot load into {type(self).__name__}"
            )
        self._scale = float(state["scale"])
        self.history = [StepRecord(float(s), bool(k)) for s, k in state["history"]]


class NoLossScaler(LossScaler):
    """No loss scaling and no skipping: the update is applied whatever the gradients hold."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def step(self, optimizer: Any) -> bool:
        if isinstance(optimizer, MasterWeights):
            optimizer.copy_grads()
        self.history.append(StepRecord(1.0, False))
        optimizer.step()
        return True


class StaticLossScaler(LossScaler):
    """A fixed loss scale ``S``; steps with Inf/NaN gradients are skipped.

    Example:
        >>> s = StaticLossScaler(1024.0)
        >>> s.scale(torch.tensor(0.5)).item()
        512.0
    """


class DynamicLossScaler(LossScaler):
    """Loss scale that backs off on overflow and grows after a run of good steps.

    After a step with Inf/NaN gradients (skipped), ``S ← max(S · backoff_factor, min_scale)``;
    after ``growth_interval`` consecutive good steps, ``S ← min(S · growth_factor, max_scale)``.
    Defaults follow ``torch.amp.GradScaler`` (``2^16``, ×2, ×0.5, 2000), with bounds.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        super().__init__(init_scale)
        _check_positive("min_scale", min_scale)
        _check_positive("max_scale", max_scale)
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise TypeError(f"growth_interval must be an int, got {type(growth_interval).__name__}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}], "
                f"got {init_scale}"
            )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self._good_steps = 0

    def update(self) -> None:
        super().update()
        if not self.history:
            return
        if self.history[-1].skipped:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self._scale = min(self._scale * self.growth_factor, self.max_scale)
                self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._good_steps = int(state["good_steps"])


def _check_positive(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v}")


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
        masters = state["master"]
        if len(masters) != len(self.master_params):
            raise ValueError(
                f"state: {len(masters)} master tensors for {len(self.master_params)} params"
            )
        with torch.no_grad():
            for m, s in zip(self.master_params, masters, strict=True):
                m.copy_(s)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])


# ---------------------------------------------------------------------------------------
# FP32 for sensitive ops
# ---------------------------------------------------------------------------------------


def softmax_fp32(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax computed in FP32 (no overflow in ``exp``, exact normalisation), returned in
    ``x``'s dtype."""
    return torch.softmax(x.float(), dim=dim).to(x.dtype)


def layer_norm_fp32(
    x: Tensor,
    normalized_shape: tuple[int, ...] | list[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """LayerNorm with mean, variance and affine in FP32, returned in ``x``'s dtype."""
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), tuple(normalized_shape), w, b, eps).to(x.dtype)


def cross_entropy_fp32(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over all positions, in FP32 (``logits`` ``(..., V)``)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


# ---------------------------------------------------------------------------------------
# FP16 matmuls on CPU
# ---------------------------------------------------------------------------------------

_MATMULS = {
    F.linear,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    Tensor.matmul,
    Tensor.__matmul__,
    Tensor.mm,
    Tensor.bmm,
}


class MatmulInFp32(TorchFunctionMode):
    """Run FP16 or BF16 matrix products as FP32 products rounded once to that dtype.

    Inside this context, ``F.linear``, ``matmul``/``@``, ``mm``, ``bmm``, ``addmm`` and
    ``baddbmm`` with ``dtype`` inputs upcast them (exactly: every FP16/BF16 value is an
    FP32 value), multiply in FP32 and round the result to ``dtype`` once: the numerics of
    an FP16/BF16 GEMM with FP32 accumulation, as on GPUs and in oneDNN's native BF16
    kernels, up to the order of the FP32 sums. The casts are part of the autograd graph, so
    the backward products run the same way and gradients arrive in ``dtype``. Tensors stay
    in ``dtype`` everywhere: storage, activations and gradients keep its range, precision,
    subnormals and underflow.

    Under ``torch.autocast`` to ``dtype`` (CPU) it does nothing: autocast would cast the
    FP32 inputs back, and it also governs the backward products, which a function mode
    does not see.

    It exists because torch's CPU FP16 GEMM is an order of magnitude slower than FP32 on
    CPUs without AVX512-FP16, and its BF16 GEMM 40x slower on CPUs without AVX512-BF16
    (measured: 2048x128 @ 128x512, 290 ms against 7 ms in FP32 on an AVX2-only EPYC); on
    CUDA it is not needed. It is a torch *function* mode, so ``torch.compile`` traces
    through it.
    """

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        super().__init__()
        self.dtype = dtype

    def _up(self, a: Any) -> Any:
        return a.float() if isinstance(a, Tensor) and a.dtype == self.dtype else a

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _MATMULS:
            return func(*args, **kwargs)
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == self.dtype:
            return func(*args, **kwargs)  # autocast would cast the FP32 inputs back anyway
        if any(isinstance(a, Tensor) and a.dtype == self.dtype for a in (*args, *kwargs.values())):
            return func(*tree_map(self._up, args), **tree_map(self._up, kwargs)).to(self.dtype)
        return func(*args, **kwargs)


class Fp16MatmulInFp32(MatmulInFp32):
    """:class:`MatmulInFp32` for FP16: FP16 matrix products as FP32 products rounded once
    to FP16."""

    def __init__(self) -> None:
        super().__init__(torch.float16)


@functools.lru_cache(maxsize=1)
def native_bf16_matmul() -> bool:
    """Whether this CPU has BF16 matrix instructions (x86 ``avx512_bf16``/``amx_bf16``,
    Arm ``bf16``), read once from ``/proc/cpuinfo``; ``True`` where it cannot be read (then
    torch's own kernels are used). Without them torch's CPU BF16 GEMM is emulated and slow,
    and the recipes run BF16 products with :class:`MatmulInFp32` instead."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(val.split())
    if not flags:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
