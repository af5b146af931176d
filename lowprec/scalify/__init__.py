"""Scaled arithmetic ("scalify"): every tensor is ``data × scale``, scales propagate.

:func:`scalify` runs an unchanged PyTorch module or function with its inputs, parameters
and gradients as :class:`~lowprec.core.tensor.ScaledTensor` (domain ``"scalify"``): narrow data
(FP16, BF16, or FP8 matmul inputs) times an FP32 scale that carries the range. Each aten op
has a local rule that computes the output's data from the inputs' data and picks its
scale from their scales (see :mod:`lowprec.scalify.rules` and ``rules_nn``), in forward
and backward. This subsumes loss scaling (the ``1/N`` of a mean lands in the scale),
unit scaling (the ``√K`` of a matmul) and automatic bias selection, without changing the
model's maths. Ops without a rule fall back to ``dequantize -> op -> scale 1`` and are
reported by :func:`coverage`.

API:

* :func:`apply` (the entry point: ``apply(model_or_function, config)`` with a
  :class:`ScalifyConfig` or a preset name), :func:`scalify` (its documented alias by data
  format and policy), :class:`Scalified` (the module wrapper: the original is ``.module``;
  state_dict keys are the original's).
* :class:`ScalifyConfig` (data format, power-of-two rounding ``none``/``down``/``up``,
  ``max``/``unit`` add rule, automatic rescale before each cast; presets by
  ``ScalifyConfig.from_name``), :func:`config` (a block, in the calling thread),
  :func:`current_config`, :func:`set_config` (the calling thread's default). The config is
  scoped: a scalify'd module or function runs its forward with its own config pushed on a
  thread-local stack, and the tensors it makes record that config, so its backward runs
  under it too; nothing outlives the call, and threads never see each other's configs.
* :func:`as_scaled`, :func:`scaled`, :func:`unscale`, :func:`rebalance`,
  :func:`dynamic_rescale` (``max``/``l1``/``l2``): by hand, inside a model.
* :func:`coverage` / :func:`reset_coverage`: op calls by rule and by fallback.

Inside a scalify'd module every submodule sees ScaledTensors (domain ``"scalify"``; their
gradients domain ``"scalify.grad"``) as inputs, outputs, parameters and output gradients:
forward hooks and ``Tensor.register_hook`` callbacks receive ScaledTensors (read
``.qdata`` for the stored data, ``.dequantize()`` for the value). Under ``torch.compile``
the rules are traced; set ``torch._inductor.config.emulate_precision_casts = True`` for
the eager roundings (inductor otherwise keeps fused FP16 round trips in FP32).

Example:
    >>> import torch
    >>> from lowprec.scalify import scalify, coverage, reset_coverage
    >>> torch.manual_seed(0) and None
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    >>> x = torch.randn(4, 8) * 2.0**-30  # FP16 would flush this to zero
    >>> reset_coverage()
    >>> y = scalify(mlp, data_format="fp16")(x)
    >>> y.sum().backward()
    >>> ref = mlp(x)
    >>> bool(torch.allclose(y, ref, rtol=1e-2, atol=0)), coverage().fallbacks
    (True, {})
"""

from lowprec.scalify.config import (
    Coverage,
    ScalifyConfig,
    config,
    coverage,
    current_config,
    reset_coverage,
    set_config,
)
from lowprec.scalify.entry import apply
from lowprec.scalify.ops import as_scaled, dynamic_rescale, rebalance, scaled, unscale
from lowprec.scalify.transform import Scalified, resolve_config, scalify

__all__ = [
    "Coverage",
    "Scalified",
    "ScalifyConfig",
    "apply",
    "as_scaled",
    "config",
    "coverage",
    "current_config",
    "dynamic_rescale",
    "rebalance",
    "reset_coverage",
    "resolve_config",
    "scaled",
    "scalify",
    "set_config",
    "unscale",
]
