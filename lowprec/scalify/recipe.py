"""The technique's entry point, :func:`apply`, and the recipes' hook :func:`apply_scalify`.

``apply(model, config)`` runs ``model`` in scaled arithmetic under ``config`` (a
:class:`~lowprec.scalify.ScalifyConfig` or a preset name). The recipes' ``fp16``: every
ScaledTensor's data in FP16; ``fp8``: matmul inputs cast to FP8 (E4M3 for activations and
weights, E5M2 for gradients, per-tensor power-of-two scales), FP16 data elsewhere. Scales
only propagate (policy ``"static"``): no unit scaling, no loss scaling. Parameters stay
FP32 (the master copy) and receive plain FP32 ``.grad``.
"""

from __future__ import annotations

from torch import nn

from lowprec.scalify.config import ScalifyConfig
from lowprec.scalify.transform import Scalified

__all__ = ["SCALIFY_FORMATS", "apply", "apply_scalify"]

SCALIFY_FORMATS = ("fp16", "fp8")


def apply(model: nn.Module, config: ScalifyConfig | str) -> Scalified:
    """``model`` run in scaled arithmetic under ``config``: a :class:`ScalifyConfig` or a
    preset name of :meth:`ScalifyConfig.from_name`. Returns a :class:`Scalified` wrapper
    that keeps ``model`` (and its state_dict keys).

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 2)
        >>> m = apply(lin, "fp8-dynamic")
        >>> m.config.data_format, m.config.rescale, m.module is lin
        ('fp8', 'max', True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(config, str):
        config = ScalifyConfig.from_name(config)
    if not isinstance(config, ScalifyConfig):
        raise TypeError(
            f"config must be a ScalifyConfig or a preset name, got {type(config).__name__}"
        )
    return Scalified(model, config)


def apply_scalify(model: nn.Module, *, data_format: str) -> nn.Module:
    """The recipes' hook: :func:`apply` with the preset ``data_format`` (``"fp16"`` or
    ``"fp8"``: static scales).

    Example:
        >>> import torch
        >>> from lowprec.jobs.model import CharGPT, ModelConfig
        >>> m = apply_scalify(CharGPT(ModelConfig(width=32, depth=1, heads=2)), data_format="fp16")
        >>> logits, loss = m(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
        >>> type(loss).__name__, loss.dtype, next(iter(m.state_dict()))
        ('Tensor', torch.float32, 'tok.weight')
    """  # noqa: E501
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if data_format not in SCALIFY_FORMATS:
        raise ValueError(f"data_format must be one of {list(SCALIFY_FORMATS)}, got {data_format!r}")
    return apply(model, data_format)
