"""Numerics tracking: statistics of every named tensor of a model, forward and backward.

``with track(model, formats=["fp16", "e4m3fn", "e5m2"], every=k) as t:`` records, every
``k``-th forward pass of ``model`` (one training step), for each leaf module that owns
parameters or produces a tensor:

=================  =================================================  ============
kind               tensor                                             pass
=================  =================================================  ============
``input``          the module's first tensor input                    forward
``output``         the module's output                                forward
``weight``         each parameter of the module (``<module>.<name>``)  forward
``grad_output``    the gradient flowing into the module's output      backward
``weight_grad``    each parameter's accumulated gradient              backward
=================  =================================================  ============

For a :class:`~lowprec.ScaledTensor` the stored narrow data (``.qdata``) is measured —
that is what must fit the format. Statistics (:func:`tensor_stats`) of ``x`` with
``n`` elements, ``a = |x|``:

* over the finite values (Inf/NaN are counted in ``nonfinite`` instead): ``amax = max a``,
  ``rms = sqrt(Σx²/n)``, ``mean_abs = Σa/n`` (sums in float64); ``zero`` = share of exact
  zeros, ``nonfinite`` = share of Inf/NaN (the counts come from
  :func:`lowprec.analysis.stats.count_values`, the one counting implementation);
* per format ``f``: ``below_subnormal[f]`` = share with ``0 < a < f.min_subnormal`` (these
  round to zero or to the smallest subnormal: their value is lost), ``below_normal[f]`` =
  share with ``0 < a < f.min_normal`` (subnormal or lost: fewer significant bits), and
  ``above_max[f]`` = share with ``a > f.max`` (overflow, Inf and NaN included);
* ``exp_hist``: counts of ``floor(log2 a)`` for nonzero finite ``a``, as ``{"lo": e0,
  "counts": [...]}`` (bin ``i`` is exponent ``e0 + i``).

Steps not sampled cost one integer test per hook. Records are dicts (JSON-ready);
:meth:`Tracker.save` appends them to a JSON-lines file.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lowprec._json import dumps
from lowprec.analysis.stats import count_values
from lowprec.core.formats import Format, get_format
from lowprec.core.tensor import ScaledTensor

__all__ = ["KINDS", "Tracker", "tensor_stats", "track"]

KINDS = ("input", "output", "weight", "grad_output", "weight_grad")
_EXP_OFFSET = 1100  # float64 exponents of nonzero finite values lie in [-1074, 1023]
BACKWARD_KINDS = ("grad_output", "weight_grad")


def tensor_stats(x: Tensor, formats: Sequence[str | Format]) -> dict[str, Any]:
    """The statistics described in the module docstring, for one tensor.

    Example:
        >>> import torch
        >>> s = tensor_stats(torch.tensor([0.0, 1e-9, 3.0, 1e6]), ["fp16"])
        >>> s["zero"], s["below_subnormal"]["fp16"], s["above_max"]["fp16"]
        (0.25, 0.25, 0.25)
    """
    if isinstance(x, ScaledTensor):
        x = x.qdata
    fmts = [get_format(f) for f in formats]
    bounds = [f.min_subnormal for f in fmts] + [f.min_normal for f in fmts]
    c = count_values(x, below=bounds, above=[f.max for f in fmts], moments=True)
    assert c.sumsq is not None and c.sum_abs is not None and c.amax is not None
    assert c.nonfinite is not None and c.nan is not None
    n, k = max(c.numel, 1), len(fmts)
    # floor(log2 a) of every nonzero finite value, shifted into bins >= 1 (bin 0: zero or
    # non-finite): the exponent histogram.
    v = x.detach().reshape(-1)
    if v.dtype not in (torch.float32, torch.float64):
        v = v.float()
    af = torch.where(torch.isfinite(v), v.abs(), 0.0)
    e = torch.where(af > 0, torch.frexp(af)[1] - 1 + _EXP_OFFSET, 0)
    counts = torch.bincount(e, minlength=2 * _EXP_OFFSET).tolist()
    used = [i for i, cnt in enumerate(counts) if cnt and i > 0]
    lo, hi = (used[0], used[-1]) if used else (0, -1)
    rms, mean_abs = math.sqrt(c.sumsq / n), c.sum_abs / n
    if not (math.isfinite(rms) and math.isfinite(mean_abs)) and math.isfinite(c.amax):
        # float64 values whose squares (or sum) pass float64's max: the moments of x / amax
        r = af.double() / c.amax
        rms = c.amax * math.sqrt(float((r * r).sum()) / n)
        mean_abs = c.amax * float(r.sum()) / n
    return {
        "numel": c.numel,
        "dtype": str(x.dtype).replace("torch.", ""),
        "amax": c.amax,
        "rms": rms,
        "mean_abs": mean_abs,
        "zero": c.zero / n,
        "nonfinite": c.nonfinite / n,
        "below_subnormal": {f.name: c.below[i] / n for i, f in enumerate(fmts)},
        "below_normal": {f.name: c.below[k + i] / n for i, f in enumerate(fmts)},
        "above_max": {f.name: (c.above[i] + c.nan) / n for i, f in enumerate(fmts)},
        "exp_hist": {"lo": lo - _EXP_OFFSET if used else 0, "counts": counts[lo : hi + 1]},
    }


def _first_tensor(args: Any) -> Tensor | None:
    for a in args if isinstance(args, (tuple, list)) else (args,):
        if isinstance(a, Tensor) and a.dtype.is_floating_point:
            return a
    return None


class Tracker:
    """Hooks on ``model`` recording :func:`tensor_stats` every ``every`` steps. Use
    :func:`track`; read :attr:`records`.

    With ``auto_step`` a step is one forward call of ``model`` in training mode (forward
    calls in eval mode are not recorded); without it the caller sets :attr:`step` and
    :attr:`enabled` before each step (as ``lowprec train`` does)."""

    def __init__(
        self,
        model: nn.Module,
        formats: Sequence[str | Format] = ("fp16", "e4m3fn", "e5m2"),
        every: int = 1,
        start_step: int = 0,
        auto_step: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        if not isinstance(auto_step, bool):
            raise TypeError(f"auto_step must be a bool, got {type(auto_step).__name__}")
        if isinstance(formats, str) or not formats:
            raise ValueError("formats must be a non-empty list of format names")
        self.formats = [get_format(f).name for f in formats]
        self.every = every
        self.enabled = True
        self._auto = auto_step
        self._grads_step: int | None = None
        self.records: list[dict[str, Any]] = []
        self._handles: list[RemovableHandle] = []
        if auto_step:  # a step is one forward call of the model in training mode
            self.step = start_step - 1
            self._handles.append(model.register_forward_pre_hook(self._on_step))
        else:  # the caller sets .step (and .enabled) before each step
            self.step = start_step
        names = {m: n for n, m in model.named_modules()}
        for mod, name in names.items():
            leaf = not any(True for _ in mod.children())
            own = list(mod.named_parameters(recurse=False))
            prefix = f"{name}." if name else ""  # a parameter is recorded as prefix + name
            if leaf or own:  # non-leaf modules: only their own parameters are recorded
                hook = self._forward_hook(name or "model", prefix, activations=leaf)
                self._handles.append(mod.register_forward_hook(hook))
            for pn, p in own:
                if p.requires_grad:
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(self._grad_hook(prefix + pn))
                    )

    @property
    def sampling(self) -> bool:
        return self.enabled and self.step % self.every == 0

    def _on_step(self, module: nn.Module, args: Any) -> None:
        self.enabled = module.training  # evaluation passes are neither counted nor recorded
        if module.training:
            self.step += 1
            self._grads_step = self.step if self.sampling else None

    def _record(self, name: str, kind: str, x: Tensor) -> None:
        if isinstance(x, DTensor):  # an FSDP2 shard: the whole tensor (every rank records)
            x = x.full_tensor()
        self.records.append(
            {"step": self.step, "name": name, "kind": kind, **tensor_stats(x, self.formats)}
        )

    def _forward_hook(self, name: str, prefix: str, activations: bool) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.sampling or torch.compiler.is_compiling():
                return
            for pn, p in module.named_parameters(recurse=False):
                self._record(prefix + pn, "weight", p)
            if not activations:
                return
            x = _first_tensor(args)
            if x is not None:
                self._record(name, "input", x)
            y = _first_tensor(output)
            if y is not None:
                self._record(name, "output", y)
                if y.requires_grad:
                    step = self.step
                    y.register_hook(  # type: ignore[no-untyped-call]
                        lambda g: self._on_grad_output(name, step, g)
                    )

        return hook

    def _on_grad_output(self, name: str, step: int, g: Tensor) -> None:
        if step == self.step:
            self._record(name, "grad_output", g)

    def _grad_hook(self, name: str) -> Any:
        def hook(p: Tensor) -> None:
            # auto_step: the latest sampled training forward, even if an eval pass came
            # between it and this backward; otherwise whatever the caller enabled
            on = self._grads_step == self.step if self._auto else self.sampling
            if on and p.grad is not None:
                self._record(name, "weight_grad", p.grad)

        return hook

    def remove(self) -> None:
        """Remove every hook (the records stay)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def save(self, path: str | Path) -> Path:
        """Append the records to the JSON-lines file ``path`` (strict JSON: a non-finite
        number as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``,
        :mod:`lowprec._json`)."""
        path = Path(path)
        with open(path, "a") as f:
            for r in self.records:
                f.write(dumps(r) + "\n")
        return path


@contextmanager
def track(
    model: nn.Module,
    formats: Sequence[str | Format] = ("fp16", "e4m3fn", "e5m2"),
    every: int = 1,
    start_step: int = 0,
) -> Iterator[Tracker]:
    """Record numerics of ``model`` inside the block (see the module docstring).

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with track(m, ["e4m3fn"], every=2) as t:
        ...     for _ in range(3):
        ...         m(torch.randn(2, 4)).sum().backward()
        >>> sorted({(r["step"], r["kind"]) for r in t.records if r["name"] == "0"})[:3]
        [(0, 'grad_output'), (0, 'input'), (0, 'output')]
        >>> sorted({r["step"] for r in t.records})
        [0, 2]
    """
    t = Tracker(model, formats, every, start_step)
    try:
        yield t
    finally:
        t.remove()
