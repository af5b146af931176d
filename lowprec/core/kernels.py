"""Compiled kernels behind the eager API: fused rounding and scaling for large tensors.

Eager, every step of a rounding or scaling is a full pass over the tensor, and torch's casts
between float32 and the float8 dtypes are scalar loops on the CPU. A caller who never uses
``torch.compile`` still gets those passes fused into one vectorised loop: eager calls on a
large CPU tensor run small functions compiled by ``torch.compile`` (``dynamic=True``, so
one compilation serves every size) and cached per format, dtype and broadcast pattern:

* :func:`run_quantize`: rounding into a format without a torch dtype (E2M1, the FP6
  formats, E8M0, TF32, ...) on the bit pattern (:func:`lowprec.core.bits.round_bits`,
  the rounding of :func:`lowprec.core.rounding.quantize`);
* :func:`run_scaled_encode`: ``x / scale`` (block-wise broadcast) rounded into a 1-byte
  float8 format, saturating (:func:`lowprec.core.bits.encode`): the quantize step of
  every float8 GEMM operand (:func:`lowprec.float8.quant.quantize_parts`);
* :func:`run_group_quantize`: the same for row, block and MX/NVFP4 scales, with the
  group ``amax`` reduction and the scale rule fused in;
* :func:`run_block_amax`: the largest magnitude of each block, in one read;
* :func:`run_decode`: a float8 payload back to float32/bfloat16, optionally times its
  scale (:func:`lowprec.core.bits.decode`): the emulated GEMM's operands;
* :func:`run_round_trip`: quantize-dequantize to float32 in one pass (scalify's FP8
  rounding of matmul inputs);
* :func:`run_group_round_trip`: :func:`run_group_quantize` and :func:`run_decode` in one
  pass: an emulated GEMM's block-scaled operand (block, MX, NVFP4) without its payload.

Contract: a kernel returns the bits of the eager ops it replaces, laid out as they lay out
their result (``tests/core/test_kernels.py`` and ``tests/core/test_fast_paths.py`` compare
them; the one exception is the payload of a NaN times a NaN scale, which is NaN either way).
A kernel is used only when all of these hold:

* eager mode (not already inside ``torch.compile``) on a CPU tensor (float32, float16 or
  bfloat16; a float8 payload for decoding) with at least ``min_numel`` elements (small
  tensors would pay the call overhead and, the first time, a compilation of a few seconds
  for no gain), and not inside :func:`lowprec.core.layout.reference_paths`. The float8
  operand quantize of :func:`lowprec.float8.quant.quantize_parts` (:func:`run_scaled_encode`,
  :func:`run_group_quantize`) also runs on CUDA tensors (:func:`quantize_devices`), as
  Triton kernels with eager CUDA's float32 arithmetic (correctly rounded division,
  subnormals kept): eager, its steps would each write a full-size float32 temporary;
* for stochastic rounding (:func:`run_quantize` with ``rand``), the draws are taken eagerly
  from the caller's ``torch.Generator`` (:func:`lowprec.core.bits.draw_bits`, as the eager
  path takes them) and the kernel rounds with them: the same bits; its ``min_numel``
  default is ``2**14`` (the eager path is about twenty passes and a kernel wins early);
* the switch is on: environment variable ``LOWPREC_EAGER_KERNELS`` = ``auto`` (default)
  or ``1``; ``0`` turns the kernels off. ``LOWPREC_EAGER_KERNELS_MIN_NUMEL`` sets
  ``min_numel`` (default ``2**19``; ``2**16`` for :func:`run_round_trip`, which replaces
  four eager passes, one of them a scalar float8 cast, and wins from about ``2**15``).

The first call per key compiles (inductor's on-disk caches make later processes faster).
If compilation fails (no C++ compiler, say), the kernels are turned off for the process
with one WARNING and the eager ops run: same bits, slower.

The kernels trace the bit arithmetic of :mod:`lowprec.core.bits` on the views of
:mod:`lowprec.core.layout`; the rounding API (:mod:`lowprec.core.rounding`) sits above them
and calls them, never the other way round.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from collections.abc import Callable

import torch
from torch import Tensor

from lowprec.core import layout
from lowprec.core.bits import (
    BYTE_FORMATS,
    counter_bits,
    decode,
    encode,
    round_bits,
    storage_dtype,
)
from lowprec.core.formats import Format
from lowprec.core.warn import warn_once

__all__ = [
    "enabled",
    "min_numel",
    "quantize_devices",
    "run_decode",
    "run_group_quantize",
    "run_group_round_trip",
    "run_kernel",
    "run_quantize",
    "run_quantize_counter",
    "run_round_trip",
    "run_scaled_encode",
]

_LOG = logging.getLogger(__name__)
_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
_CACHE: dict[tuple[object, ...], Callable[..., Tensor]] = {}
_BROKEN: list[str] = []  # why the kernels were turned off (empty: they work)


def enabled() -> bool:
    """Whether ``LOWPREC_EAGER_KERNELS`` allows compiled kernels (``auto``/``1``, default)
    and none failed to compile in this process."""
    flag = os.environ.get("LOWPREC_EAGER_KERNELS", "auto").strip().lower()
    if flag not in ("auto", "1", "0", "on", "off", "true", "false"):
        raise ValueError(f"LOWPREC_EAGER_KERNELS must be 'auto', '1' or '0', got {flag!r}")
    return flag in ("auto", "1", "on", "true") and not _BROKEN


MIN_NUMEL = 1 << 19  # the default threshold
ROUND_TRIP_MIN_NUMEL = 1 << 16  # run_round_trip's default threshold
MIN_NUMEL_SR = 1 << 14  # stochastic run_quantize's default threshold


def min_numel(default: int = MIN_NUMEL) -> int:
    """Smallest tensor (elements) for which a compiled kernel is used:
    ``LOWPREC_EAGER_KERNELS_MIN_NUMEL`` if set (for every kernel), else ``default``."""
    text = os.environ.get("LOWPREC_EAGER_KERNELS_MIN_NUMEL")
    if text is None:
        return default
    try:
        n = int(text)
    except ValueError:
        raise ValueError(
            f"LOWPREC_EAGER_KERNELS_MIN_NUMEL must be an integer, got {text!r}"
        ) from None
    if n < 1:
        raise ValueError(f"LOWPREC_EAGER_KERNELS_MIN_NUMEL must be >= 1, got {n}")
    return n


def applies(
    x: Tensor,
    dtypes: tuple[torch.dtype, ...] = _INPUTS,
    threshold: int = MIN_NUMEL,
    devices: tuple[str, ...] = ("cpu",),
) -> bool:
    """Whether an eager call on ``x`` should use a compiled kernel (module docstring;
    not for an ``x`` that autograd records: the kernel runs without autograd). ``dtypes``:
    the input dtypes the kernel takes (default: float32, float16, bfloat16);
    ``threshold``: the kernel's default :func:`min_numel`; ``devices``: the device types
    the caller's kernel serves (default the CPU; :func:`quantize_devices` for the float8
    operand quantize kernels)."""
    return (
        x.device.type in devices
        and x.dtype in dtypes
        and not (x.requires_grad and torch.is_grad_enabled())
        and x.numel() >= min_numel(threshold)
        and not torch.compiler.is_compiling()
        and enabled()
    )


def takes(
    t: Tensor,
    fmt: Format | None = None,
    threshold: int = MIN_NUMEL,
    devices: tuple[str, ...] = ("cpu",),
) -> bool:
    """Whether an eager call should run the kernels below on ``t`` (:func:`applies`, and
    not inside :func:`lowprec.core.layout.reference_paths`): ``fmt`` given, ``t`` is
    to be encoded into ``fmt`` (a format :func:`encodes` takes) or is a 1-byte payload of
    it; ``fmt=None``, ``t`` is a float payload holding its values. ``devices``: as for
    :func:`applies`."""
    if not layout.fast_paths():
        return False
    if fmt is None:
        return applies(t, threshold=threshold, devices=devices)
    if not encodes(fmt):
        return False
    dtypes = (*_INPUTS, BYTE_FORMATS[fmt]) if fmt in BYTE_FORMATS else _INPUTS
    return applies(t, dtypes, threshold, devices)


@functools.cache
def _cuda_exact_options() -> dict[str, str | int | bool | Callable[..., object]] | None:
    """Inductor options under which its Triton kernels compute float32 as eager CUDA does:
    correctly rounded division (``x / y`` is otherwise an approximate ``div.full``),
    subnormals kept (not flushed to zero), no multiply-add contraction and every cast kept.
    ``None`` where this torch has no option for either of the first two: the kernels then
    stay on the CPU (:func:`quantize_devices`)."""
    from torch._inductor import config as ic

    en = getattr(ic, "eager_numerics", None)
    if en is not None and hasattr(en, "division_rounding"):
        div = "eager_numerics.division_rounding"
    elif hasattr(ic, "emulate_divison_rounding"):  # (the option's spelling up to torch 2.12)
        div = "emulate_divison_rounding"
    else:
        return None
    if en is None or not hasattr(en, "disable_ftz"):
        return None
    return {div: True, "eager_numerics.disable_ftz": True, "emulate_precision_casts": True}


def quantize_devices() -> tuple[str, ...]:
    """Device types of the float8 operand quantize kernels (:func:`run_scaled_encode` and
    :func:`run_group_quantize` as :func:`lowprec.float8.quant.quantize_parts` calls them):
    the CPU, and CUDA where inductor can write them with eager CUDA's float32 arithmetic
    (:func:`_cuda_exact_options`; Triton kernels: one pass instead of eager's chain of
    full-size float32 temporaries). Under ``torch.compile`` (where no kernel runs) the CPU
    alone, without reading inductor's configuration."""
    if torch.compiler.is_compiling():
        return ("cpu",)
    return ("cpu", "cuda") if _cuda_exact_options() is not None else ("cpu",)


def _compile(fn: Callable[..., Tensor], device_type: str = "cpu") -> Callable[..., Tensor]:
    """``torch.compile(fn, dynamic=True, fullgraph=True)`` of a copy of ``fn`` with a code
    object of its own (on CUDA with :func:`_cuda_exact_options`). Dynamo keeps one cache,
    and one recompile limit, per code object; every kernel here is a closure of one of a
    few functions, so without the copy the kernels of different formats would share (and
    exhaust) one cache."""
    code = fn.__code__.replace()  # an equal but distinct code object
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    if device_type == "cpu":
        return torch.compile(own, dynamic=True, fullgraph=True)
    options = _cuda_exact_options()
    if options is None:
        raise RuntimeError(f"no exact float32 kernels for {device_type} in this torch")
    return torch.compile(own, dynamic=True, fullgraph=True, options=dict(options))


def run_kernel(
    key: tuple[object, ...], build: Callable[[], Callable[..., Tensor]], *args: Tensor
) -> Tensor | None:
    """The cached kernel ``key`` (made by ``build`` on first use) applied to ``args``
    without autograd; ``None`` if it cannot run (compilation failed: turned off, once)."""
    device_type = args[0].device.type
    key = (*key, device_type)  # a CPU (C++) and a CUDA (Triton) kernel apart
    fn = _CACHE.get(key)
    if fn is None:
        fn = _CACHE[key] = _compile(build(), device_type)
    # (Python numbers of the closure stay constants: with dynamic=True Dynamo would trace
    # floats, such as a cast's margin, as symbols and break on their checks, and ints, such
    # as a format's bias, as symbols whose shifts and powers of two the kernel would
    # compute for every vector. Set and restored directly: config.patch's context manager
    # cost more than a small kernel's own call.)
    cfg = torch._dynamo.config
    old = cfg.specialize_float, cfg.specialize_int
    cfg.specialize_float = cfg.specialize_int = True
    try:
        with torch.no_grad():
            return fn(*args)
    except Exception as e:  # a missing compiler, an inductor bug: fall back, once
        _broken(e)
        return None
    finally:
        cfg.specialize_float, cfg.specialize_int = old


def _broken(e: Exception) -> None:
    _BROKEN.append(f"{type(e).__name__}: {e}")
    warn_once(
        _LOG,
        "kernels:broken",
        "lowprec: compiled eager kernels are off for this process (%s: %s); rounding "
        "runs eagerly (same results, slower). Set LOWPREC_EAGER_KERNELS=0 to skip them",
        type(e).__name__,
        str(e)[:200],
    )


def run_quantize(
    x: Tensor, fmt: Format, saturate: bool, rand: Tensor | None = None
) -> Tensor | None:
    """``quantize(x, fmt, "nearest", saturate)`` by a compiled kernel (on ``x`` flattened in
    storage order), with ``x``'s strides; ``None`` if the kernel cannot run (the caller
    runs the eager path). With ``rand`` (:func:`lowprec.core.bits.draw_bits` of ``x``'s
    shape, contiguous; ``x`` contiguous too): stochastic rounding with those draws."""
    d = layout.dense_view(x)
    if not d.is_contiguous():
        return None
    if rand is not None:
        if d is not x or rand.shape != x.shape or not rand.is_contiguous():
            return None

        def build_sr() -> Callable[..., Tensor]:
            def kernel(t: Tensor, r: Tensor) -> Tensor:
                return round_bits(t, fmt, "stochastic", saturate, rand=r)

            return kernel

        key = ("quantize-sr", fmt.name, saturate, x.dtype)
        out = run_kernel(key, build_sr, x.reshape(-1), rand.reshape(-1))
        return None if out is None else out.view(x.shape)

    def build() -> Callable[..., Tensor]:
        def kernel(t: Tensor) -> Tensor:  # (quantize's own path for a format without a cast)
            return round_bits(t, fmt, "nearest", saturate)

        return kernel

    out = run_kernel(("quantize", fmt.name, saturate, x.dtype), build, d.reshape(-1))
    if out is None:
        return None
    out = out.view(d.shape)
    return out if d is x else layout.from_dense_view(out, x)


def run_quantize_counter(x: Tensor, fmt: Format, saturate: bool, keys: Tensor) -> Tensor | None:
    """Stochastic ``quantize`` of the contiguous float32 ``x`` with the counter-based draws
    :func:`lowprec.core.bits.counter_bits` ``(keys, i)`` of each element's index ``i`` in
    ``x`` (row-major), computed inside the kernel; ``None`` if the kernel cannot run."""
    if not x.is_contiguous() or x.dtype != torch.float32:
        return None

    def build() -> Callable[..., Tensor]:
        def kernel(t: Tensor, k: Tensor) -> Tensor:
            idx = torch.arange(t.numel(), device=t.device, dtype=torch.int64)
            return round_bits(t, fmt, "stochastic", saturate, rand=counter_bits(k, idx))

        return kernel

    out = run_kernel(("quantize-ctr", fmt.name, saturate), build, x.reshape(-1), keys)
    return None if out is None else out.view(x.shape)


def _encode_fn(
    fmt: Format, saturate: bool = True
) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """``(inside, after)``: ``after(inside(v))`` is ``to_format(v, fmt, saturate=saturate)``
    for a format :func:`encodes` takes; ``inside`` is traced into a kernel, ``after`` runs
    eagerly on its result. A 1-byte float8 format is encoded inside
    (:func:`lowprec.core.bits.encode`); another is rounded inside on the bit pattern, in
    float32, and cast to its storage dtype after: a narrower output would make inductor
    run the whole loop on pairs of float32 vectors, several times slower."""
    if not encodes(fmt):
        raise ValueError(f"fmt: {fmt.name} has a wider torch dtype; use its cast")
    if fmt in BYTE_FORMATS:
        return (lambda v: encode(v.float(), fmt, saturate)), (lambda q: q)
    store = storage_dtype(fmt)
    return (lambda v: round_bits(v.float(), fmt, "nearest", saturate)), (lambda q: q.to(store))


def _group_amax(t: Tensor, red: tuple[int, ...]) -> Tensor:
    """The largest ``|t|`` over the dims ``red`` (kept), float32; NaN propagates."""
    return t.abs().amax(dim=red, keepdim=True).float()


def run_group_quantize(
    x: Tensor,
    shape: tuple[int, ...],
    fmt: Format,
    scale_fn: Callable[[Tensor], Tensor],
    key: object,
) -> tuple[Tensor, Tensor] | None:
    """``(to_format(apply_scale(x, s, "div"), fmt, saturate=True), s)`` with
    ``s = scale_fn(a)``, ``a`` the largest ``|x|`` of each group of a scale of ``shape``
    (:func:`lowprec.core.scales.amax`), in one compiled function: the amax reduction,
    the scale rule and the encode fused. ``scale_fn`` must be traceable and elementwise
    on ``a`` up to tensor-wide reductions (it is applied to ``a`` in a block view);
    ``key`` identifies it (with ``fmt``) in the cache. ``None`` if the kernel cannot run."""
    groups = layout.groups(x, shape)
    if groups is None:
        return None
    view, red = groups
    enc, after = _encode_fn(fmt)

    def build() -> Callable[..., Tensor]:
        def kernel(t: Tensor) -> tuple[Tensor, Tensor]:
            s = scale_fn(_group_amax(t, red))
            return enc(t / s), s

        return kernel  # type: ignore[return-value]

    out = run_kernel(("group", fmt.name, key, x.dtype, view.dim(), red), build, view)
    if out is None:
        return None
    q, s = out  # type: ignore[misc]
    return layout.unview(after(q), x), layout.in_scale_shape(s, x, shape)


def run_group_round_trip(
    x: Tensor,
    shape: tuple[int, ...],
    fmt: Format,
    scale_fn: Callable[[Tensor], Tensor],
    key: object,
    dtype: torch.dtype,
    multiply: bool = True,
) -> tuple[Tensor, Tensor] | None:
    """:func:`run_group_quantize` followed by :func:`run_decode`, in one compiled function
    that never stores the payload: ``(apply_scale(v, s).to(dtype), s)`` with ``v`` the
    value of ``to_format(apply_scale(x, s, "div"), fmt, saturate=True)`` and
    ``s = scale_fn(a)`` as there (``multiply=False``: ``v.to(dtype)``, the payload's
    values), laid out like ``x``, ``s`` contiguous of the scale shape ``shape`` (an
    emulated GEMM's operand, read once). ``dtype``: float32 or bfloat16 (which hold every
    value of the formats :func:`encodes` takes). ``None`` if the kernel cannot run."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if not encodes(fmt):
        raise ValueError(f"fmt: {fmt.name} has a wider torch dtype; use its cast")
    groups = layout.groups(x, shape)
    if groups is None:
        return None
    view, red = groups

    def build() -> Callable[..., Tensor]:
        def kernel(t: Tensor) -> tuple[Tensor, Tensor]:
            s = scale_fn(_group_amax(t, red))
            q = round_bits((t / s).float(), fmt, "nearest", True)  # the payload's values
            # (s is returned, so computed once per group: inlined, inductor recomputed the
            # scale rule, powers of two included, for every vector of the group)
            return (q * s if multiply else q).to(dtype), s

        return kernel  # type: ignore[return-value]

    k = ("group-round-trip", fmt.name, key, x.dtype, dtype, multiply, view.dim(), red)
    out = run_kernel(k, build, view)
    if out is None:
        return None
    v, s = out  # type: ignore[misc]
    return layout.unview(v, x), layout.in_scale_shape(s, x, shape)


def encodes(fmt: Format) -> bool:
    """Whether :func:`run_scaled_encode` takes ``fmt``: a 1-byte float8 format, or a
    format without a torch dtype (stored in a wider float dtype)."""
    return fmt in BYTE_FORMATS or fmt.torch_dtype is None


def run_block_amax(x: Tensor, shape: tuple[int, ...]) -> Tensor | None:
    """The largest ``|x|`` of each block, as float32 of the scale shape ``shape``
    (:func:`lowprec.core.scales.amax`, NaN propagating), in one pass; ``None`` if the
    kernel cannot run."""
    groups = layout.groups(x, shape)
    if groups is None:
        return None
    view, red = groups

    def build() -> Callable[..., Tensor]:
        def kernel(t: Tensor) -> Tensor:
            return _group_amax(t, red)

        return kernel

    out = run_kernel(("amax", x.dtype, view.dim(), red), build, view)
    return None if out is None else layout.in_scale_shape(out, x, shape)


def run_scaled_encode(
    x: Tensor, scale: Tensor, fmt: Format, saturate: bool = True
) -> Tensor | None:
    """``to_format(apply_scale(x, scale, "div"), fmt, saturate)`` in one pass, laid out
    like the eager ops' result, for a format :func:`encodes` takes (a 1-byte float8 one is
    rounded and encoded by :func:`lowprec.core.bits.encode`, another on the bit pattern);
    ``None`` if the kernel cannot run (the caller runs the eager path). ``scale``: float32,
    broadcast block-wise (:func:`lowprec.core.granularity.apply_scale`)."""
    enc, after = _encode_fn(fmt, saturate)
    pair = layout.block_pair(x, scale)
    if pair is None:
        return None

    def build() -> Callable[..., Tensor]:
        def kernel(t: Tensor, s: Tensor) -> Tensor:
            return enc(t / s)

        return kernel

    out = run_kernel(("encode", fmt.name, saturate, x.dtype, layout.pattern(*pair)), build, *pair)
    return None if out is None else layout.unview(after(out), x)


def run_round_trip(
    x: Tensor,
    scale: Tensor,
    fmt: Format,
    multiply: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Tensor | None:
    """``decode(to_format(x / scale, fmt, saturate=True)) * scale`` in float32, for a 1-byte
    float8 ``fmt``: the value a quantize-dequantize gives, in one pass (read ``x``, write
    the result), laid out like ``x``; ``None`` if the kernel cannot run. ``scale``:
    float32, broadcast block-wise. ``multiply=False``: the payload's values, not times the
    scale; ``dtype``: the result's, float32 or bfloat16 (each holds every float8 value)."""
    if fmt not in BYTE_FORMATS:
        raise ValueError(f"fmt: {fmt.name} is not a 1-byte float8 format")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    pair = layout.block_pair(x, scale)
    if pair is None:
        return None

    def build() -> Callable[..., Tensor]:
        def kernel(t: Tensor, s: Tensor) -> Tensor:  # (the code's value, not the code)
            q = round_bits((t / s).float(), fmt, "nearest", True)
            return (q * s if multiply else q).to(dtype)

        return kernel

    key = ("round-trip", fmt.name, x.dtype, multiply, dtype, layout.pattern(*pair))
    out = run_kernel(key, build, *pair)
    return None if out is None else layout.unview(out, x)


def run_decode(
    data: Tensor, fmt: Format | None, dtype: torch.dtype, scale: Tensor | None = None
) -> Tensor | None:
    """``apply_scale(data.to(float32), scale).to(dtype)`` (without ``scale``:
    ``data.to(dtype)``) in one pass, laid out like ``data``, for a 1-byte float8 payload
    of ``fmt`` (decoded by :func:`lowprec.core.bits.decode`) or, with ``fmt=None``, a
    float payload that holds its values (E2M1 in bfloat16, say); ``None`` if the kernel
    cannot run (the caller runs the eager path)."""
    scaled = scale is not None
    byte = fmt is not None
    if fmt is not None and fmt not in BYTE_FORMATS:
        raise ValueError(f"fmt: {fmt.name} is not a 1-byte float8 format")
    pair = layout.block_pair(
        data, scale if scale is not None else torch.ones((), device=data.device)
    )
    if pair is None:
        return None

    def build() -> Callable[..., Tensor]:
        def kernel(c: Tensor, s: Tensor) -> Tensor:
            if not byte:
                return (c.float() * s).to(dtype) if scaled else c.to(dtype)
            assert fmt is not None
            return (decode(c, fmt) * s).to(dtype) if scaled else decode(c, fmt, dtype)

        return kernel

    key = (
        "decode",
        None if fmt is None else fmt.name,
        data.dtype,
        dtype,
        layout.pattern(*pair) if scaled else None,
    )
    out = run_kernel(key, build, *pair)
    return None if out is None else layout.unview(out, data)
