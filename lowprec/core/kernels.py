"""Compiled kernels behind the eager API: fused rounding for large CPU tensors.

Rounding into a format without a torch dtype (E2M1, the FP6 formats, E8M0, TF32, ...) runs
on the bit pattern (:func:`lowprec.core.rounding.quantize`): some fifteen elementwise
passes, each a full read and write of the tensor in eager mode. A caller who never uses
``torch.compile`` still gets those passes fused into one loop: eager calls on a large CPU
tensor run the same function compiled by ``torch.compile`` (``dynamic=True``, so one
compilation serves every size) and cached per ``(format, saturate, dtype)``.

Contract: the compiled kernel returns the same bits as the eager path (the bit rule is
integer arithmetic and exact scalings; ``tests/core/test_fast_paths.py`` compares them).
It is used only when all of these hold:

* eager mode (not already inside ``torch.compile``) on a CPU tensor of float32, float16 or
  bfloat16 with at least ``min_numel`` elements (small tensors would pay the call overhead
  and, the first time, a compilation of several seconds for no gain);
* round-to-nearest (stochastic rounding draws from a ``torch.Generator``, not compiled);
* the switch is on: environment variable ``LOWPREC_EAGER_KERNELS`` = ``auto`` (default)
  or ``1``; ``0`` turns the kernels off. ``LOWPREC_EAGER_KERNELS_MIN_NUMEL`` sets
  ``min_numel`` (default ``2**20``).

The first call per ``(format, saturate, dtype)`` compiles (inductor's on-disk caches make
later processes faster). If compilation fails (no C++ compiler, say), the kernel is turned
off for the process with one WARNING and the eager path runs: same bits, slower.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
from torch import Tensor

from lowprec.core.formats import Format
from lowprec.core.warn import warn_once

__all__ = ["enabled", "min_numel", "quantize_kernel"]

_LOG = logging.getLogger(__name__)
_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
_CACHE: dict[tuple[str, bool, torch.dtype], Callable[[Tensor], Tensor]] = {}
_BROKEN: list[str] = []  # why the kernels were turned off (empty: they work)


def enabled() -> bool:
    """Whether ``LOWPREC_EAGER_KERNELS`` allows compiled kernels (``auto``/``1``, default)
    and none failed to compile in this process."""
    flag = os.environ.get("LOWPREC_EAGER_KERNELS", "auto").strip().lower()
    if flag not in ("auto", "1", "0", "on", "off", "true", "false"):
        raise ValueError(f"LOWPREC_EAGER_KERNELS must be 'auto', '1' or '0', got {flag!r}")
    return flag in ("auto", "1", "on", "true") and not _BROKEN


def min_numel() -> int:
    """Smallest tensor (elements) for which a compiled kernel is used
    (``LOWPREC_EAGER_KERNELS_MIN_NUMEL``, default ``2**20``)."""
    text = os.environ.get("LOWPREC_EAGER_KERNELS_MIN_NUMEL", str(1 << 20))
    try:
        n = int(text)
    except ValueError:
        raise ValueError(
            f"LOWPREC_EAGER_KERNELS_MIN_NUMEL must be an integer, got {text!r}"
        ) from None
    if n < 1:
        raise ValueError(f"LOWPREC_EAGER_KERNELS_MIN_NUMEL must be >= 1, got {n}")
    return n


def applies(x: Tensor) -> bool:
    """Whether an eager call on ``x`` should use a compiled kernel (module docstring;
    not for an ``x`` that autograd records: the kernel runs without autograd)."""
    return (
        x.device.type == "cpu"
        and x.dtype in _INPUTS
        and not (x.requires_grad and torch.is_grad_enabled())
        and x.numel() >= min_numel()
        and not torch.compiler.is_compiling()
        and enabled()
    )


def quantize_kernel(fmt: Format, saturate: bool, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
    """The compiled ``quantize(x, fmt, "nearest", saturate)`` for 1-D ``x`` of ``dtype``
    (cached; one compilation serves every size)."""
    key = (fmt.name, saturate, dtype)
    fn = _CACHE.get(key)
    if fn is None:
        from lowprec.core.rounding import quantize

        def kernel(x: Tensor) -> Tensor:
            return quantize(x, fmt, "nearest", saturate)

        fn = _CACHE[key] = torch.compile(kernel, dynamic=True, fullgraph=True)
    return fn


def run_quantize(x: Tensor, fmt: Format, saturate: bool) -> Tensor | None:
    """``quantize(x, fmt, "nearest", saturate)`` by the compiled kernel, with ``x``'s
    strides; ``None`` if the kernel cannot run (the caller runs the eager path)."""
    from lowprec.core.rounding import dense_view, from_dense_view

    d = dense_view(x)
    if not d.is_contiguous():
        return None
    try:
        with torch.no_grad():
            out = quantize_kernel(fmt, saturate, x.dtype)(d.reshape(-1)).view(d.shape)
    except Exception as e:  # a missing compiler, an inductor bug: fall back, once
        _BROKEN.append(f"{type(e).__name__}: {e}")
        warn_once(
            _LOG,
            "kernels:broken",
            "lowprec: compiled eager kernels are off for this process (%s: %s); rounding "
            "runs eagerly (same results, slower). Set LOWPREC_EAGER_KERNELS=0 to skip them",
            type(e).__name__,
            str(e)[:200],
        )
        return None
    return out if d is x else from_dense_view(out, x)
