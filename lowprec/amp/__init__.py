"""Mixed precision: loss scaling, FP32 master weights, FP32 sensitive ops.

* :mod:`~lowprec.amp.loss_scaling`: :class:`LossScaler` and its kinds (none, static,
  dynamic), with ``torch.amp.GradScaler``'s API; every step is recorded as a
  :class:`StepRecord`.
* :mod:`~lowprec.amp.master`: :class:`MasterWeights`, FP32 copies of FP16/BF16 parameters
  around an inner optimizer (round to nearest or stochastically on write-back).
* :mod:`~lowprec.amp.lean`: :class:`LeanAdamW`, :class:`LeanAdam`, :class:`LeanSGD`,
  optimizers for BF16/FP16 parameters without FP32 masters (stochastic rounding, or a
  16-bit remainder: :mod:`~lowprec.amp.remainder`) and with states in BF16 or 8 bits
  (:class:`StateCodec`); :func:`training_state_bytes` counts what a run keeps.
* :mod:`~lowprec.amp.ops`: softmax, LayerNorm and cross-entropy in FP32 (as functions, and
  for any model as :class:`SensitiveInFp32`); :class:`MatmulInFp32`, FP16/BF16 matrix
  products with FP32 accumulation on CPU.
* :func:`grad_stats` (from :mod:`lowprec.analysis.stats`): gradient statistics.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2).half()
    >>> opt = MasterWeights(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    >>> scaler = DynamicLossScaler(init_scale=2.0**10)
    >>> loss = model(torch.randn(3, 4).half()).float().square().mean()
    >>> scaler.scale(loss).backward()
    >>> scaler.step(opt), scaler.loss_scale
    (True, 1024.0)
"""

from lowprec.amp.footprint import training_state_bytes
from lowprec.amp.lean import LeanOptimizer
from lowprec.amp.lean_optimizers import LeanAdam, LeanAdamW, LeanSGD, lean_optimizer
from lowprec.amp.loss_scaling import (
    DynamicLossScaler,
    LossScaler,
    NoLossScaler,
    StaticLossScaler,
    StepRecord,
)
from lowprec.amp.master import MasterWeights
from lowprec.amp.ops import (
    Fp16MatmulInFp32,
    MatmulInFp32,
    SensitiveInFp32,
    cross_entropy_fp32,
    layer_norm_fp32,
    native_bf16_matmul,
    softmax_fp32,
)
from lowprec.amp.remainder import join_fp32, split_fp32
from lowprec.amp.state_codec import StateCodec, state_codecs
from lowprec.analysis.stats import grad_stats

__all__ = [
    "DynamicLossScaler",
    "Fp16MatmulInFp32",
    "LeanAdam",
    "LeanAdamW",
    "LeanOptimizer",
    "LeanSGD",
    "LossScaler",
    "MasterWeights",
    "MatmulInFp32",
    "NoLossScaler",
    "SensitiveInFp32",
    "StateCodec",
    "StaticLossScaler",
    "StepRecord",
    "cross_entropy_fp32",
    "grad_stats",
    "join_fp32",
    "layer_norm_fp32",
    "lean_optimizer",
    "native_bf16_matmul",
    "softmax_fp32",
    "split_fp32",
    "state_codecs",
    "training_state_bytes",
]
