"""Row-local block weights gathered in their narrow format under FSDP2.

The ``blocks=True`` layouts of :func:`lowprec.distributed.float8_fsdp.enable_fp8_all_gather`
(its module docstring gives the numerics): a row-wise, ``1xB``, MX or ``RxB``-tile weight
is quantized along its in-features on each rank, rows of ``Q_K(W)`` with no collective;
the payload (1 byte per element, E2M1 codes two per byte) and its scales (float32, MX
scales as 1-byte E8M0) are gathered and dequantized into ``param_dtype``. Where the shards
do not allow it the shard is gathered as it is (one WARNING naming the reason).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh

from lowprec.core.codes import from_bits, to_bits
from lowprec.core.formats import get_format
from lowprec.core.rounding import storage_dtype
from lowprec.core.warn import warn_once
from lowprec.float8.linear import Float8Linear
from lowprec.float8.quant import dequantize_parts, quantize_parts

__all__ = ["block_reason", "post_gather", "pre_gather"]

# The warnings are enable_fp8_all_gather's: its logger.
log = logging.getLogger("lowprec.distributed.float8_fsdp")


def block_reason(layer: Float8Linear) -> str | None:
    """Why ``layer``'s weight cannot be gathered narrow with row-local block scales
    (``None``: it can, given even shards; see the module docstring)."""
    c = layer.recipe.weight
    g = c.bound_granularity(1)
    fmt = get_format(c.fmt)
    if g.kind == "tensor":
        return "tensor-wise static scale" if c.scaling == "static" else None
    if c.scaling != "dynamic":
        return f"{c.scaling} block scales"
    if g.kind == "nv":
        return "nv:16 needs the global amax for its second-level scale"
    if type(layer)._gemm_weight is not Float8Linear._gemm_weight:
        return "the weight is stored transposed: FSDP2's row shards split in-features"
    if not (fmt.torch_dtype is not None and fmt.torch_dtype.itemsize == 1) and fmt.total_bits > 4:
        return f"{fmt.name} has no 1-byte storage"
    return None


def pre_gather(
    hp: Tensor, layer: Float8Linear, mesh: DeviceMesh, outer_size: torch.Size, mp_policy: Any
) -> tuple[tuple[Tensor, ...], Any]:
    """The all-gather inputs of a row-local block weight: this shard's ``Q_K(W_r)`` payload
    and scales, or (when the shards do not allow it) the shard itself in ``param_dtype``."""
    cast = layer.recipe.weight
    g = cast.bound_granularity(1)
    fmt = get_format(cast.fmt)
    pd = getattr(mp_policy, "param_dtype", None)
    w = hp if pd is None else hp.to(pd)
    n, k, ws = int(outer_size[0]), int(outer_size[1]), mesh.size()
    rows = -(-n // ws)
    packed = fmt.torch_dtype is None or fmt.torch_dtype.itemsize != 1
    reason = None
    if n % ws:
        reason = f"its {n} rows do not divide over {ws} ranks"
    elif g.kind == "block" and rows % g.block[0]:
        reason = f"a shard's {rows} rows are not whole {g.block[0]}-row tiles"
    elif packed and g.kind == "axis" and k % 2:
        reason = f"an odd row length ({k}) cannot pack two 4-bit codes per byte"
    if reason is not None:
        warn_once(
            log,
            f"float8-fsdp-blocks:{layer.recipe.name}:{n}x{k}:{ws}",
            "enable_fp8_all_gather: a %dx%d %s weight is gathered in its own dtype: %s",
            n,
            k,
            cast.describe(),
            reason,
        )
        if w.shape[0] != rows:  # FSDP pads every shard to this
            padded = w.new_zeros((rows, *w.shape[1:]))
            padded[: w.shape[0]] = w
            w = padded
        return (w,), ("plain",)
    data, scale, _ = quantize_parts(w, cast, 1)  # rows of Q_K(W): no collective needed
    if packed:  # E2M1: two 4-bit codes per byte
        codes = to_bits(torch.nan_to_num(data.float(), nan=0.0), fmt).to(torch.uint8)
        payload = codes[:, 0::2] | (codes[:, 1::2] << 4)
    else:
        payload = data.view(torch.uint8)
    e8m0 = g.kind == "mx"  # MX scales are powers of two (or NaN): exact in E8M0
    sc = scale.to(torch.float8_e8m0fnu).view(torch.uint8) if e8m0 else scale.float()
    return (payload, sc), ("blocks", cast.fmt, (n, k), packed, e8m0)


def post_gather(
    outputs: tuple[Tensor, ...], meta: Any, param_dtype: torch.dtype, out: Tensor | None
) -> tuple[Tensor, tuple[Tensor, ...]] | None:
    """The unsharded weight from :func:`pre_gather`' gathered inputs: the gathered shard
    (``"plain"``) or ``deq(Q_K(W))`` in ``param_dtype`` (``"blocks"``)."""
    if meta[0] == "plain":
        (raw,) = outputs
        return None if out is not None else (raw, (raw,))
    _, fmt_name, shape, packed, e8m0 = meta
    payload, sraw = outputs
    fmt = get_format(fmt_name)
    if packed:
        codes = torch.stack((payload & 15, payload >> 4), dim=-1).flatten(-2)
        data = from_bits(codes.long(), fmt)
    else:
        data = payload.view(storage_dtype(fmt)).float()
    scale = sraw.view(torch.float8_e8m0fnu).float() if e8m0 else sraw
    pad = tuple(shape) if tuple(data.shape) != tuple(shape) else None
    # contiguous: FSDP2 reads the unsharded weight with as_strided at the original shape's
    # contiguous strides, and a crop of the padded blocks is a view with the padded row
    # stride (in_features not a multiple of the block width gave a garbage forward)
    w = dequantize_parts(data, scale, pad, param_dtype).contiguous()
    if out is None:
        return w, (w,)
    # A re-gather (backward) into the storage FSDP2 freed after forward: the saved weight
    # is refilled with the same values, so autograd's version check must not see a write.
    with torch.no_grad(), _unsafe_preserve_version_counter(out):
        out.copy_(w.view(out.shape))
    return None
