"""The float8 presets (registered in :data:`lowprec.float8.config.PRESETS` when
:mod:`lowprec.float8` is imported; :meth:`~lowprec.float8.Float8Config.from_name` reads
them): per-tensor (dynamic, delayed, static), row-wise, block-wise, MX and NVFP4 casts, the
scale-free ``naive`` cast, torchao's ``rowwise-gw-hp``, and formats per GEMM.
"""

from __future__ import annotations

from typing import Any

from lowprec.float8.config import PRESETS, CastConfig, _e4, _e5

__all__: list[str] = []


def _preset(name: str, inp: CastConfig, w: CastConfig, go: CastConfig, **kw: Any) -> None:
    PRESETS.add(name, input=inp, weight=w, grad_output=go, **kw)


_preset("tensorwise", _e4(), _e4(), _e5())
_preset(
    "delayed",
    _e4(scaling="delayed"),
    _e4(scaling="delayed"),
    _e5(scaling="delayed"),
)
# Weights move every step and their amax is cheap to take, so only the activations and
# gradients are calibrated and frozen.
_preset("static", _e4(scaling="static"), _e4(), _e5(scaling="static"))
_preset(
    "rowwise",
    _e4(granularity="axis"),
    _e4(granularity="axis"),
    _e5(granularity="axis"),
    fp8_saved_activations=False,
)
_preset(
    "blockwise",
    _e4(granularity="block:1x128"),
    _e4(granularity="block:128x128"),
    _e5(granularity="block:1x128"),
    fp8_saved_activations=False,
)
# MX block scales rounded up (NVIDIA's MXFP8 recipe), not OCP's floor, by measurement
# (benchmarks/bench_mx_scale.py: never worse, up to 11 dB better on weight gradients);
# MXFP4 keeps the floor, which measured better there (E2M1 has too few levels to spare).
_preset(
    "mxfp8",
    _e4(granularity="mx:32", mx_scale="ceil"),
    _e4(granularity="mx:32", mx_scale="ceil"),
    _e5(granularity="mx:32", mx_scale="ceil"),
    fp8_saved_activations=False,
    emulate=True,
)
_fp4 = CastConfig("e2m1", granularity="mx:32")
_preset("mxfp4", _fp4, _fp4, _fp4, fp8_saved_activations=False, emulate=True)
_nv4 = CastConfig("e2m1", granularity="nv:16")
_preset("nvfp4", _nv4, _nv4, _nv4, fp8_saved_activations=False, emulate=True)
# torchao's rowwise_with_gw_hp: row-wise E4M3 forward and input gradient (E4M3 gradients,
# as torchao's row-wise recipes have them), the weight gradient in high precision.
_preset(
    "rowwise-gw-hp",
    _e4(granularity="axis"),
    _e4(granularity="axis"),
    _e4(granularity="axis"),
    fp8_saved_activations=False,
    high_precision_gemms=("weight_grad",),
)

# No scaling at all: a static scale of exactly 1, the values rounded to E4M3 / E5M2 as they
# are (the failure float8 scaling cures; the demo's ``fp8-naive``).
_preset(
    "naive",
    _e4(scaling="static", static_scale=1.0),
    _e4(scaling="static", static_scale=1.0),
    _e5(scaling="static", static_scale=1.0),
)

# Formats per GEMM. MXFP8 forward (the mxfp8 preset's casts), both backward GEMMs in NVFP4.
_mx8 = PRESETS.get("mxfp8").replace(name="mxfp8")
_nvfp4 = PRESETS.get("nvfp4").replace(name="nvfp4")
_preset(
    "mxfp8-nvfp4-bwd",
    _mx8.input,
    _mx8.weight,
    _mx8.grad_output,
    fp8_saved_activations=False,
    emulate=True,
    gemms=(("input_grad", _nvfp4), ("weight_grad", _nvfp4)),
)
# Tensor-wise FP8 everywhere but the weight-gradient GEMM, which runs in NVFP4 (the forward's
# tensor-wise input is then not shared with it: the high-precision input is saved).
_preset("tensorwise-wgrad-nvfp4", _e4(), _e4(), _e5(), gemms=(("weight_grad", _nvfp4),))

# FP4 training as published (NVIDIA, arXiv 2509.25149; Transformer Engine's
# NVFP4BlockScaling): E2M1 with E4M3 scales per 16 and an FP32 tensor scale; the weight on
# 16x16 blocks (the forward and input-gradient GEMMs multiply one quantized weight);
# gradients rounded stochastically, everything else to nearest; a random Hadamard
# transform of 16 on the weight-gradient GEMM's inputs only. Which layers stay in BF16
# is the recipe's (lowprec.recipes: float8_skip, layers).
_preset(
    "nvfp4-train",
    _nv4,
    CastConfig("e2m1", granularity="nv:16x16"),
    CastConfig("e2m1", granularity="nv:16", rounding="stochastic"),
    fp8_saved_activations=False,
    emulate=True,
    hadamard=("weight_grad",),
    hadamard_block=16,
)
# The same recipe in MXFP4: E8M0 scales per 32 (OCP's floor, as mxfp4), 32x32 weight blocks,
# a Hadamard transform of 32 on the weight gradient.
_preset(
    "mxfp4-train",
    _fp4,
    CastConfig("e2m1", granularity="mx:32x32"),
    CastConfig("e2m1", granularity="mx:32", rounding="stochastic"),
    fp8_saved_activations=False,
    emulate=True,
    hadamard=("weight_grad",),
    hadamard_block=32,
)
# DeepSeek-V3: E4M3 everywhere (gradients too) with 1x128 activation / gradient and 128x128
# weight blocks and power-of-two scales. Its FP32 promotion of the accumulation (Hopper's
# FP8 GEMM keeps about 14 bits) needs nothing here: the emulation accumulates in FP32.
_preset(
    "fp8-deepseek",
    _e4(granularity="block:1x128", power_of_two=True),
    _e4(granularity="block:128x128", power_of_two=True),
    _e4(granularity="block:1x128", power_of_two=True),
    fp8_saved_activations=False,
)
