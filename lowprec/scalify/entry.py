"""The technique's entry point, :func:`apply`.

``apply(model, config)`` runs ``model`` (or a function of tensors) in scaled arithmetic
under ``config`` (a :class:`~lowprec.scalify.ScalifyConfig` or a preset name). The presets
``fp16``: every ScaledTensor's data in FP16; ``fp8``: matmul inputs cast to FP8 (E4M3 for
activations and weights, E5M2 for gradients, per-tensor power-of-two scales), FP16 data
elsewhere; scales only propagate (no unit scaling, no loss scaling). Parameters stay FP32
(the master copy) and receive plain FP32 ``.grad``. :func:`~lowprec.scalify.scalify` is the
documented alias by data format and policy.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

from torch import nn

from lowprec.scalify.config import ScalifyConfig
from lowprec.scalify.transform import Scalified, run_scalified

__all__ = ["apply"]

F = TypeVar("F")


@overload
def apply(model: nn.Module, config: ScalifyConfig | str = ...) -> Scalified: ...
@overload
def apply(model: F, config: ScalifyConfig | str = ...) -> F: ...
def apply(model: Any, config: ScalifyConfig | str = "fp16") -> Any:
    """``model`` run in scaled arithmetic under ``config``: a :class:`ScalifyConfig` or a
    preset name of :meth:`ScalifyConfig.from_name` (default ``"fp16"``). A module gives a
    :class:`Scalified` wrapper that keeps ``model`` (and its state_dict keys); a function
    of tensors gives a function of the same signature.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(4, 2)
        >>> m = apply(lin, "fp8-dynamic")
        >>> m.config.data_format, m.config.rescale, m.module is lin
        ('fp8', 'max', True)
        >>> f = apply(lambda a, b: a @ b, "fp16")
        >>> f(torch.ones(2, 4) * 2.0**30, torch.ones(4, 1)).flatten().tolist()  # 2^32: beyond FP16
        [4294967296.0, 4294967296.0]
    """
    if not (isinstance(model, nn.Module) or callable(model)):
        raise TypeError(f"model must be an nn.Module or a callable, got {type(model).__name__}")
    if isinstance(config, str):
        config = ScalifyConfig.from_name(config)
    if not isinstance(config, ScalifyConfig):
        raise TypeError(
            f"config must be a ScalifyConfig or a preset name, got {type(config).__name__}"
        )
    return run_scalified(model, config)
