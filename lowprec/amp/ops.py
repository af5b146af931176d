"""FP32 for precision-sensitive ops, and FP16/BF16 matrix products with FP32 accumulation.

* :func:`softmax_fp32`, :func:`layer_norm_fp32`, :func:`cross_entropy_fp32`: the op in
  FP32, the result in the input's dtype (the loss in FP32).
* :class:`SensitiveInFp32`: a torch function mode running every softmax, normalisation
  and loss of any model that way (what a recipe's ``compute()`` runs under).
* :class:`MatmulInFp32` (:class:`Fp16MatmulInFp32`): a torch function mode running FP16/BF16
  matrix products as FP32 products rounded once; :func:`native_bf16_matmul` says whether
  the CPU has BF16 matrix instructions.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from lowprec.core.modes import eager_frames, is_plain

__all__ = [
    "Fp16MatmulInFp32",
    "MatmulInFp32",
    "SensitiveInFp32",
    "cross_entropy_fp32",
    "layer_norm_fp32",
    "native_bf16_matmul",
    "softmax_fp32",
]


def _check_float(name: str, x: object) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _up(x: Tensor) -> Tensor:
    """FP16/BF16 up to FP32; FP32 and float64 as they are (never down to FP32)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def softmax_fp32(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax computed in FP32 (no overflow in ``exp``, exact normalisation), returned in
    ``x``'s dtype. ``TypeError`` for a non-floating ``x``."""
    _check_float("x", x)
    return torch.softmax(_up(x), dim=dim).to(x.dtype)


def layer_norm_fp32(
    x: Tensor,
    normalized_shape: tuple[int, ...] | list[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """LayerNorm with mean, variance and affine in FP32, returned in ``x``'s dtype."""
    _check_float("x", x)
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(_up(x), tuple(normalized_shape), w, b, eps).to(x.dtype)


def cross_entropy_fp32(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over all positions, in FP32 (``logits`` ``(..., V)``)."""
    _check_float("logits", logits)
    return F.cross_entropy(_up(logits).flatten(0, -2), targets.flatten())


_LOW = (torch.float16, torch.bfloat16)

# softmax and normalisations: computed in FP32, the result rounded to the input's dtype
_KEEP_DTYPE = {
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, Tensor.softmax,
    Tensor.log_softmax, F.layer_norm, F.group_norm, F.rms_norm, F.normalize,
}  # fmt: skip
# losses: computed and returned in FP32 (torch.autocast's choice)
_LOSSES = {
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.kl_div,
    F.poisson_nll_loss, F.gaussian_nll_loss, F.soft_margin_loss,
    F.multilabel_soft_margin_loss, F.cosine_embedding_loss, F.margin_ranking_loss,
    F.hinge_embedding_loss, F.triplet_margin_loss, F.multi_margin_loss,
    F.multilabel_margin_loss,
}  # fmt: skip


def _up_low(a: Any) -> Any:
    return a.float() if is_plain(a) and a.dtype in _LOW else a


@eager_frames
class SensitiveInFp32(TorchFunctionMode):
    """Run softmax, the normalisations and the losses of FP16/BF16 tensors in FP32.

    Inside this context ``softmax``/``log_softmax`` (functional, ``torch.`` and tensor
    methods), ``F.layer_norm``, ``F.group_norm``, ``F.rms_norm``, ``F.normalize`` and
    every ``torch.nn.functional`` loss upcast their FP16/BF16 tensor arguments (exactly),
    compute in FP32, and return: the normalisations and softmaxes rounded once to their
    first tensor argument's dtype (the model stays in its dtype), the losses in FP32.
    This is ``torch.autocast``'s FP32 list for these ops, for a model whose parameters
    are FP16/BF16 (a recipe's ``param_dtype``): its LayerNorm statistics, softmax sums
    and log-probabilities are FP32 sums instead of FP16/BF16 ones. Other calls, FP32
    inputs and tensor subclasses (``ScaledTensor``, ``DTensor``) pass unchanged; under
    ``torch.autocast`` it does nothing (autocast decides). BatchNorm is not here: a
    recipe keeps BatchNorm modules in FP32 (their running statistics accumulate in
    place), and torch's kernels take FP16/BF16 inputs with FP32 weights and statistics.
    A torch *function* mode, so ``torch.compile`` traces through it.

    Example:
        >>> x = torch.randn(4, 8).half()
        >>> with SensitiveInFp32():
        ...     y, loss = torch.softmax(x, -1), F.cross_entropy(x, torch.zeros(4).long())
        >>> y.dtype, loss.dtype
        (torch.float16, torch.float32)
    """

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        loss = func in _LOSSES
        if not (loss or func in _KEEP_DTYPE):
            return func(*args, **kwargs)
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        if (
            first is None
            or not is_plain(first)
            or first.dtype not in _LOW
            or torch.is_autocast_enabled(first.device.type)
        ):
            return func(*args, **kwargs)
        out = func(*tree_map(_up_low, args), **tree_map(_up_low, kwargs))
        return out if loss else out.to(first.dtype)


# ---------------------------------------------------------------------------------------
# FP16 matmuls on CPU
# ---------------------------------------------------------------------------------------

_MATMULS = {
    F.linear,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    Tensor.matmul,
    Tensor.__matmul__,
    Tensor.mm,
    Tensor.bmm,
}


@eager_frames
class MatmulInFp32(TorchFunctionMode):
    """Run FP16 or BF16 matrix products as FP32 products rounded once to that dtype.

    Inside this context, ``F.linear``, ``matmul``/``@``, ``mm``, ``bmm``, ``addmm`` and
    ``baddbmm`` with ``dtype`` inputs upcast them (exactly: every FP16/BF16 value is an
    FP32 value), multiply in FP32 and round the result to ``dtype`` once: the numerics of
    an FP16/BF16 GEMM with FP32 accumulation, as on GPUs and in oneDNN's native BF16
    kernels, up to the order of the FP32 sums. The casts are part of the autograd graph, so
    the backward products run the same way and gradients arrive in ``dtype``. Tensors stay
    in ``dtype`` everywhere: storage, activations and gradients keep its range, precision,
    subnormals and underflow.

    Under ``torch.autocast`` to ``dtype`` (CPU) it does nothing: autocast would cast the
    FP32 inputs back, and it also governs the backward products, which a function mode
    does not see.

    It exists because torch's CPU FP16 GEMM on CPUs without AVX512-FP16, and its BF16 GEMM
    on CPUs without AVX512-BF16 (see :func:`native_bf16_matmul`), are emulated and much
    slower than FP32 (timings: ``docs/mixed-precision.md``); on CUDA it is not needed. It is a
    torch *function* mode, so ``torch.compile`` traces through it.
    """

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        super().__init__()
        self.dtype = dtype

    def _up(self, a: Any) -> Any:
        return a.float() if isinstance(a, Tensor) and a.dtype == self.dtype else a

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _MATMULS:
            return func(*args, **kwargs)
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == self.dtype:
            return func(*args, **kwargs)  # autocast would cast the FP32 inputs back anyway
        if any(isinstance(a, Tensor) and a.dtype == self.dtype for a in (*args, *kwargs.values())):
            return func(*tree_map(self._up, args), **tree_map(self._up, kwargs)).to(self.dtype)
        return func(*args, **kwargs)


class Fp16MatmulInFp32(MatmulInFp32):
    """:class:`MatmulInFp32` for FP16: FP16 matrix products as FP32 products rounded once
    to FP16."""

    def __init__(self) -> None:
        super().__init__(torch.float16)


@functools.lru_cache(maxsize=1)
def native_bf16_matmul() -> bool:
    """Whether this CPU has BF16 matrix instructions (x86 ``avx512_bf16``/``amx_bf16``,
    Arm ``bf16``), read once from ``/proc/cpuinfo``; ``True`` where it cannot be read (then
    torch's own kernels are used). Without them torch's CPU BF16 GEMM is emulated and slow,
    and the recipes run BF16 products with :class:`MatmulInFp32` instead."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(val.split())
    if not flags:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
