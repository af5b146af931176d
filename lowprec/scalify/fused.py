"""Fused eager kernels for scalify's pointwise and row-wise rules on large CPU tensors.

Eager, a rule on FP16 (or BF16) data upcasts each operand to float32 (a pass that writes a
new float32 tensor), runs the op in float32, and casts the result back to the storage
format (another pass). For the rules that call this module, one compiled function does
the same from the stored data to the stored result,

    r = (f(d_1·s_1, ..., d_n·s_n, *consts) / p).to(store)

computed in float32 and rounded once, as the eager rule computes it (``s_i``: an operand's
per-tensor scale, left out where it is 1; ``p``: an optional divisor, the output scale).
Inductor may order a row's sum differently from aten's kernel: the float32 values agree
to float32 rounding, the stored result to one unit of the storage format in rare ties.

The kernels are :mod:`lowprec.core.kernels`' (one cache, one switch
``LOWPREC_EAGER_KERNELS``, compiled with ``dynamic=True``): used eagerly on the CPU, for
data of at least ``2**16`` elements (``LOWPREC_EAGER_KERNELS_MIN_NUMEL``), outside
:func:`lowprec.core.layout.reference_paths`; elsewhere the rule runs its eager ops.

The rules use them only when ``LOWPREC_SCALIFY_FUSED=1`` (off by default). Inductor
compiles a dynamic-shape kernel with its first input's sizes as hints, and the code it
writes (a row's summation order, a vectorised or scalar ``exp``/``erf``) can differ with
them; the compiled kernel is cached on disk and reused by later processes, so the last
bits of a result could depend on which shapes first compiled each kernel on the machine
(the demo's fp16-scalify val loss read 2.5697 from an empty inductor cache and 2.5698 after
the test suite had compiled the kernels on small tensors). Off, results depend only on the
inputs; on, an eager FP16 step is faster (``benchmarks/README.md``, *Scaled arithmetic*).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lowprec.core import kernels
from lowprec.core.tensor import ScaledTensor
from lowprec.scalify.config import current_config
from lowprec.scalify.core import fscale

__all__ = ["MIN_NUMEL", "enabled", "fused_rule", "run_fp32", "stored"]

MIN_NUMEL = 1 << 16  # below this, the kernel call costs more than the passes it saves
_STORED = (torch.float16, torch.bfloat16)


def enabled() -> bool:
    """Whether the rules use the fused kernels: ``LOWPREC_SCALIFY_FUSED`` = ``1`` (``on``,
    ``true``); ``0`` (the default, ``off``, ``false``) leaves them off (module docstring)."""
    flag = os.environ.get("LOWPREC_SCALIFY_FUSED", "0").strip().lower()
    if flag not in ("0", "1", "on", "off", "true", "false"):
        raise ValueError(f"LOWPREC_SCALIFY_FUSED must be '0' or '1', got {flag!r}")
    return flag in ("1", "on", "true")


def run_fp32(
    func: Any,
    operands: Sequence[tuple[Tensor, Tensor | None]],
    store: torch.dtype,
    consts: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    post: Tensor | None = None,
) -> Tensor | None:
    """``(func(*(d.float() * s), *consts, **kwargs) / post).to(store)`` in one compiled
    pass, for ``operands`` ``(d, s)``: stored data ``d`` (float16/bfloat16, same shape) and
    a 0-dim float32 scale ``s`` (``None``: 1); ``post``: a 0-dim float32 divisor or
    ``None``. ``func`` returns one float32 tensor. ``None`` where the kernel does not apply
    (the caller runs its eager ops)."""
    if store not in _STORED or not operands:
        return None
    for d, s in operands:
        if d.dtype not in _STORED or not kernels.takes(d, threshold=MIN_NUMEL):
            return None
        if s is not None and (s.dim() != 0 or s.dtype != torch.float32):
            return None
    if post is not None and (post.dim() != 0 or post.dtype != torch.float32):
        return None
    kw = dict(kwargs or {})
    scaled = tuple(s is not None for _, s in operands)
    divided = post is not None

    def build() -> Callable[..., Tensor]:
        def kernel(*ts: Tensor) -> Tensor:
            rest = iter(ts[len(scaled) :])  # the scales, in operand order, then post
            vals = [
                d.float() * next(rest) if sc else d.float()
                for d, sc in zip(ts, scaled, strict=False)
            ]
            r = func(*vals, *consts, **kw)
            if divided:
                r = r / ts[-1]
            return r.to(store)  # type: ignore[no-any-return]

        return kernel

    key = (
        "scalify",
        str(func),
        consts,
        tuple(sorted(kw.items())),
        tuple((d.dtype, d.dim()) for d, _ in operands),
        scaled,
        divided,
        store,
    )
    extra = [s for _, s in operands if s is not None]
    args = [d for d, _ in operands] + extra + ([post] if post is not None else [])
    return kernels.run_kernel(key, build, *args)


def stored(x: object) -> tuple[Tensor, Tensor | None] | None:
    """A ScaledTensor operand with a per-tensor scale as :func:`run_fp32` takes it:
    ``(data, scale)``, the scale ``None`` when it is 1; ``None`` for anything else."""
    if not isinstance(x, ScaledTensor) or x.scale.numel() != 1:
        return None
    f = fscale(x.scale)
    if f is None:
        return None
    return x.qdata, None if f == 1.0 else x.scale.reshape(()).float()


def fused_rule(
    func: Any,
    ops: Sequence[object],
    work: torch.dtype,
    consts: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    divide_by: Tensor | None = None,
) -> Tensor | None:
    """A rule's stored result ``(func(d·s, ...) / p).to(store)`` from :func:`run_fp32`, or
    ``None`` (the rule runs its eager ops): only when :func:`enabled`, for float32 work and
    no automatic rescale (it reads the float32 result). ``ops``: ``(data, scale)`` pairs as
    :func:`run_fp32` takes them, or ScaledTensors with per-tensor scales (:func:`stored`;
    anything else: ``None``), read only once the checks pass (a scale read is a host
    sync); ``divide_by``: a per-tensor output scale ``s``, ``p = s`` (1 where ``s = 0``)."""
    if not enabled():
        return None
    cfg = current_config()
    if work != torch.float32 or cfg.rescale != "none":
        return None
    given = []
    for o in ops:
        pair = o if isinstance(o, tuple) else stored(o)
        if pair is None:
            return None
        given.append(pair)
    post = None
    if divide_by is not None:
        post = torch.where(divide_by > 0, divide_by, 1.0).reshape(()).float()
    return run_fp32(func, given, cfg.storage_dtype, consts, kwargs, post)
