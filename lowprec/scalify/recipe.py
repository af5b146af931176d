"""The hook the recipes call: the reference model in scaled arithmetic.

``fp16``: every ScaledTensor's data in FP16; ``fp8``: matmul inputs cast to FP8 (E4M3 for
activations and weights, E5M2 for gradients, per-tensor power-of-two scales), FP16 data
elsewhere. Scales only propagate (policy ``"static"``): no unit scaling, no loss scaling.
Parameters stay FP32 (the master copy) and receive plain FP32 ``.grad``.
"""

from __future__ import annotations

from torch import nn

from lowprec.scalify.transform import Scalified, scalify

__all__ = ["SCALIFY_FORMATS", "apply_scalify"]

SCALIFY_FORMATS = ("fp16", "fp8")


def apply_scalify(model: nn.Module, *, data_format: str) -> nn.Module:
    """``scalify(model, data_format)``: a :class:`~lowprec.scalify.Scalified` wrapper that
    keeps ``model`` (state_dict keys gain the prefix ``"module."``).

    Example:
        >>> import torch
        >>> from lowprec.jobs.model import CharGPT, ModelConfig
        >>> m = apply_scalify(CharGPT(ModelConfig(width=32, depth=1, heads=2)), data_format="fp16")
        >>> logits, loss = m(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        >>> type(loss).__name__, loss.dtype, next(iter(m.state_dict()))
        ('Tensor', torch.float32, 'module.tok.weight')
    """  # noqa: E501
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if data_format not in SCALIFY_FORMATS:
        raise ValueError(f"data_format must be one of {list(SCALIFY_FORMATS)}, got {data_format!r}")
    out: Scalified = scalify(model, data_format=data_format, policy="static")
    return out
