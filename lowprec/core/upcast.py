"""Float payloads widened to float32 or bfloat16 fast: ``upcast(data, dtype)``.

torch's eager CPU cast of a 1-byte float (E4M3 above all) to float32 is a scalar loop
per element, several times slower than reading the payload; every emulated float8 GEMM
and every scalify'd op widens its operands' payloads first. :func:`upcast` gives the
same bits (and strides) through a compiled decode kernel
(:func:`lowprec.core.kernels.run_decode`) or a table of the format's 256 codes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lowprec.core import kernels, layout
from lowprec.core.bits import BYTE_DTYPES
from lowprec.core.layout import dense_view, from_dense_view

__all__ = ["upcast"]


# 1-byte float dtypes whose eager CPU cast to float32 is a slow scalar loop (e5m2 is
# fp16's top byte, cast fast): a 256-entry table gives the same bits several times faster.
_LUT_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_LUTS: dict[tuple[torch.dtype, torch.dtype], Tensor] = {}
_LUT_MIN_NUMEL = 1 << 14  # below this the cast's own cost is negligible


def upcast(data: Tensor, dtype: torch.dtype) -> Tensor:
    """``data.to(dtype)`` (same bits and strides); eager on CPU, a large 1-byte float
    ``data`` is decoded by a compiled kernel (:mod:`lowprec.core.kernels`), else read
    through a table of its 256 codes (each entry cast by torch itself)."""
    fmt = BYTE_DTYPES.get(data.dtype)
    if fmt is not None and dtype in (torch.float32, torch.bfloat16) and kernels.takes(data, fmt):
        out = kernels.run_decode(data, fmt, dtype)
        if out is not None:
            return out
    if (
        data.dtype not in _LUT_DTYPES
        or dtype not in (torch.float32, torch.bfloat16)
        or data.numel() < _LUT_MIN_NUMEL
        or data.device.type != "cpu"
        or torch.compiler.is_compiling()
        or not layout.fast_paths()
    ):
        return data.to(dtype)
    d = dense_view(data)
    if not d.is_contiguous():
        return data.to(dtype)
    lut = _LUTS.get((data.dtype, dtype))
    if lut is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(data.dtype)
        lut = _LUTS[(data.dtype, dtype)] = codes.to(dtype)
    idx = d.view(torch.uint8).reshape(-1).to(torch.int32)
    out = torch.index_select(lut, 0, idx).view(d.shape)
    return out if d is data else from_dense_view(out, data)
