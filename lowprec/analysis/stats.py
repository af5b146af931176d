"""Statistics of tensors and gradients: the one counting implementation behind every report.

:func:`count_values` counts, in one call and one host synchronisation, for ``x`` with
``n`` elements and ``a = |x|``:

* ``zero``: exact zeros; ``nonfinite``: Inf and NaN; ``nan``: NaN;
* ``below[i]``: finite values with ``0 < a < below_bounds[i]``;
* ``above[i]``: values with ``a > above_bounds[i]`` (+Inf included, NaN not);
* with ``moments``: ``sumsq = Σ x²`` and ``sum_abs = Σ a`` over the finite values (float64
  accumulation, no float32 overflow) and ``amax = max a`` over the finite values.

Everything else counts through it: :class:`GradTally` (gradient statistics summed over
any number of gradients with one synchronisation: behind :func:`grad_stats`, re-exported
as ``lowprec.amp.grad_stats``, and :class:`~lowprec.jobs.recorder.RunRecorder`'s hooks),
:class:`GradMeter` (the training job's activation-gradient underflow) and
:func:`lowprec.analysis.tracking.tensor_stats`. A :class:`~lowprec.ScaledTensor` is measured
by its stored payload (``qdata``): that is what must fit the format. This module depends
on :mod:`lowprec.core` only, so any technique may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lowprec.core.tensor import ScaledTensor

__all__ = ["Counts", "GradMeter", "GradTally", "count_values", "grad_stats"]

_FIXED = 6  # numel, zero, nonfinite, nan, sumsq, sum_abs; then amax, below..., above...


@dataclass(frozen=True)
class Counts:
    """The result of :func:`count_values` (see the module docstring); what was not asked
    for (the moments, the Inf/NaN counts) is ``None``."""

    numel: int
    zero: int
    nonfinite: int | None
    nan: int | None
    below: tuple[int, ...]
    above: tuple[int, ...]
    sumsq: float | None = None
    sum_abs: float | None = None
    amax: float | None = None


@lru_cache(maxsize=64)
def _exact_in(dtype: torch.dtype, bounds: tuple[float, ...]) -> bool:
    return all(torch.tensor(b, dtype=dtype).item() == b for b in bounds)


def _payload(x: Tensor, bounds: tuple[float, ...]) -> Tensor:
    """``x``'s stored data, flat, in a dtype that compares it exactly with ``bounds``: its
    own (FP16/BF16/FP32/FP64 hold their values; comparing in them avoids a copy) unless
    it is FP8 (no comparison kernels) or a bound is not exact in it, then FP32."""
    if isinstance(x, ScaledTensor):
        x = x.qdata
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {type(x).__name__}")
    v = x.detach().reshape(-1)
    if v.element_size() == 1 or not _exact_in(v.dtype, bounds):
        v = v.float()
    return v


def _count_vector(
    x: Tensor, below: Sequence[float], above: Sequence[float], moments: bool, nonfinite: bool
) -> Tensor:
    """The counts of :func:`count_values` as one float64 vector on ``x``'s device (exact
    for counts below 2^53), so that several can be summed before one synchronisation:
    ``[numel, zero, nonfinite, nan, sumsq, sum_abs, amax, *below, *above]`` (entries not
    asked for are 0)."""
    v = _payload(x, (*below, *above))
    a = v.abs()
    zero = (a == 0).sum()
    none = torch.zeros((), dtype=torch.float64, device=v.device)
    parts = [torch.tensor(float(v.numel())), zero]
    if nonfinite or moments:
        finite = torch.isfinite(a)
    parts += [(~finite).sum(), torch.isnan(a).sum()] if nonfinite else [none, none]
    if moments:
        af = torch.where(finite, a, 0)
        parts += [
            torch.linalg.vector_norm(af, dtype=torch.float64) ** 2,
            af.sum(dtype=torch.float64),
            af.amax() if v.numel() else af.sum(),
        ]
    else:
        parts += [none, none, none]
    # 0 < a < b: a < b holds for the zeros too, and never for Inf or NaN
    parts += [(a < b).sum() - zero for b in below]
    parts += [(a > b).sum() for b in above]  # +Inf included; NaN compares False
    return torch.stack([t.to(device=v.device, dtype=torch.float64) for t in parts])


def _counts(vec: list[float], n_below: int, moments: bool, nonfinite: bool) -> Counts:
    # the moments (entries 4 to 6) stay floats: a sum of squares beyond float64 is +Inf
    ints = [0 if 4 <= i < _FIXED + 1 else int(c) for i, c in enumerate(vec)]
    return Counts(
        numel=ints[0],
        zero=ints[1],
        nonfinite=ints[2] if nonfinite else None,
        nan=ints[3] if nonfinite else None,
        below=tuple(ints[_FIXED + 1 : _FIXED + 1 + n_below]),
        above=tuple(ints[_FIXED + 1 + n_below :]),
        sumsq=vec[4] if moments else None,
        sum_abs=vec[5] if moments else None,
        amax=vec[6] if moments else None,
    )


def count_values(
    x: Tensor,
    below: Sequence[float] = (),
    above: Sequence[float] = (),
    moments: bool = False,
    nonfinite: bool = True,
) -> Counts:
    """Count the values of ``x`` (see the module docstring); ``nonfinite=False`` leaves out
    the Inf/NaN counts and ``moments=False`` the moments (fewer passes over ``x``).

    Example:
        >>> c = count_values(torch.tensor([0.0, 1e-9, -3.0, float("inf")]), below=[1e-6],
        ...                  above=[2.0], moments=True)
        >>> c.zero, c.nonfinite, c.below, c.above, c.sumsq, c.amax
        (1, 1, (1,), (2,), 9.0, 3.0)
    """
    vec = _count_vector(x, tuple(below), tuple(above), moments, nonfinite).tolist()
    return _counts(vec, len(below), moments, nonfinite)


class GradTally:
    """Gradient statistics summed over gradients as they come, synchronised once.

    :meth:`add` counts a gradient on its device without a host synchronisation (an FSDP2
    ``DTensor`` gradient: this rank's shard, summed over the shard group's ranks in
    :meth:`result`); :meth:`result` gives, over every value added since the last
    :meth:`reset`, ``grad_zero_share`` (exact zeros), ``grad_nonfinite_share`` (Inf/NaN)
    and ``grad_norm``, ``sqrt(Σ g²)`` over the finite values; all 0.0 when nothing was
    added. A :class:`~lowprec.ScaledTensor` gradient is counted by its stored payload.

    Example:
        >>> t = GradTally()
        >>> t.add(torch.tensor([0.0, 3.0])); t.add(torch.tensor([4.0, float("nan")]))
        >>> t.result()
        {'grad_zero_share': 0.25, 'grad_nonfinite_share': 0.25, 'grad_norm': 5.0}
    """

    def __init__(self) -> None:
        self._total: Tensor | None = None
        self._group: Any = None  # the process group of sharded (DTensor) gradients, if any

    def add(self, grad: Tensor) -> None:
        """Count the values of ``grad`` (no host synchronisation)."""
        if isinstance(grad, DTensor):  # FSDP2: count this rank's shard, sum over ranks
            self._group, grad = grad.device_mesh.get_group(), grad.to_local()
        vec = _count_vector(grad, (), (), moments=True, nonfinite=True)
        self._total = vec if self._total is None else self._total + vec.to(self._total.device)

    def reset(self) -> None:
        self._total, self._group = None, None

    def result(self) -> dict[str, float]:
        """The statistics of every value added (see the class docstring)."""
        total = self._total
        if total is not None and self._group is not None:
            total = total.clone()
            torch.distributed.all_reduce(total, group=self._group)  # counts and Σg² add
        if total is None or total[0] == 0:
            return {"grad_zero_share": 0.0, "grad_nonfinite_share": 0.0, "grad_norm": 0.0}
        c = _counts(total.tolist(), 0, moments=True, nonfinite=True)
        assert c.sumsq is not None and c.nonfinite is not None
        return {
            "grad_zero_share": c.zero / c.numel,
            "grad_nonfinite_share": c.nonfinite / c.numel,
            "grad_norm": math.sqrt(c.sumsq),
        }


def grad_stats(params: Iterable[Tensor]) -> dict[str, float]:
    """Share of gradient values that are exactly zero and that are non-finite, and the
    global gradient L2 norm ``sqrt(Σ g²)`` over the finite values, over all parameters
    that have a gradient (one synchronisation; :class:`GradTally`)."""
    tally = GradTally()
    for p in params:
        if p.grad is not None:
            tally.add(p.grad)
    return tally.result()


class GradMeter:
    """Underflow of activation gradients: the gradients flowing into the output of every
    ``nn.Linear`` of ``model`` in backward, in the compute dtype and after loss scaling.

    ``result()`` gives ``act_grad_underflow``, the share of values below the smallest
    normal number of their dtype (``|g| < finfo.tiny``: subnormal, precision lost, or
    zero), and ``act_grad_zero``, the share that are exactly zero (signal lost). A
    :class:`~lowprec.ScaledTensor` gradient (scalify) is judged by its stored payload, in
    its storage dtype: the scale carries the range.
    """

    def __init__(self, model: nn.Module) -> None:
        self.counts = [0, 0, 0]  # values, below min normal (zeros included), zero
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(self._on_grad)  # type: ignore[no-untyped-call]

    def _on_grad(self, grad: Tensor) -> None:
        data = grad.qdata if isinstance(grad, ScaledTensor) else grad
        c = count_values(data, below=[torch.finfo(data.dtype).tiny], nonfinite=False)
        self.counts[0] += c.numel
        self.counts[1] += c.zero + c.below[0]
        self.counts[2] += c.zero

    def reset(self) -> None:
        self.counts = [0, 0, 0]

    def result(self) -> dict[str, float]:
        n = max(self.counts[0], 1)
        return {"act_grad_underflow": self.counts[1] / n, "act_grad_zero": self.counts[2] / n}
