"""Issue 32 item 4: gradient communication in FP8 (DDP hook, FSDP2 reduce-scatter) and the
BF16 reduce-scatter of FSDP2 (:mod:`lowprec.distributed.grad_comm`).

One ``torchrun`` launch of ``_grad_comm_worker.py`` (2 processes, gloo) runs every
multi-process check; the argument checks run in this process.

Tolerances and why:

* the hook against the FP32 all-reduce of the same gradients, element by element: the
  bound of the module docstring (two roundings into the format, each ``u = 2^-(M+1)``
  relative or half a subnormal step times the scale), plus the bucket dtype's rounding of
  the result (BF16/FP16 buckets) and 1e-6 relative for FP32 sums: the largest error over
  the bound must be <= 1 (measured ~0.79);
* losses with the FP8 hook (or FP8 reduce-scatter) against the plain run, 6 AdamW steps:
  2e-3 relative, as the float8 recipes' 2 processes against one (test_parallel.py): the
  gradients differ by per-element roundings of 2^-4 (E4M3) / 2^-3 (E5M2) relative, which
  AdamW normalises (measured ~2.5e-4); step 1, forward only, is equal to the last bit;
* the BF16 reduce-scatter against FSDP2's FP32 one, recipe bf16: 1e-3 relative, BF16's
  2^-9 per partial sum, as bf16's 2 processes against one (measured ~1e-5).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lowprec.distributed.grad_comm import (
    FP8CommState,
    FP8ReduceScatter,
    enable_fp8_reduce_scatter,
    fsdp_reduce_policy,
    grad_divide_factor,
    register_fp8_allreduce,
    ring_bytes,
)
from tests._helpers import torchrun_json

WORKER = Path(__file__).with_name("_grad_comm_worker.py")
N_ELEM = 1001
U = {"e4m3fn": 2.0**-4, "e5m2": 2.0**-3}  # half an ulp, relative


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("grad_comm") / "out.json"
    r: dict[str, Any] = torchrun_json(WORKER, 2, out)
    return r


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_hook_within_the_format_bound_of_fp32(result: dict[str, Any]) -> None:
    assert len(result["hook"]) == 12  # 2 formats x 2 divisors x 3 bucket dtypes
    for key, r in result["hook"].items():
        fmt, _, dtype = key.split("/")
        assert r["worst"] <= 1.0, key
        assert 0 < r["rel_err"] <= 2 * U[fmt], key  # rounded, not exact, not off
        assert r["dtype"] == dtype and r["in_place"], key  # the bucket's dtype, in place
        assert r["same_result"], key  # every rank decodes the same bytes: replicas agree


@pytest.mark.slow
def test_shared_scales_identical_on_every_rank(result: dict[str, Any]) -> None:
    for key, r in result["hook"].items():
        s0, s1 = r["scales"]
        assert s0 == s1, key
        assert all(math.isfinite(s) and s > 0 for s in s0), key


@pytest.mark.slow
def test_bytes_on_the_wire_match_the_formula(result: dict[str, Any]) -> None:
    n = result["world"]
    m = N_ELEM + (-N_ELEM % n)  # padded to a multiple of N
    for key, r in result["hook"].items():
        # What the hook hands each collective (counted by wrapping torch.distributed's):
        # two float32 scalars, the m bytes of the all-to-all, an m/N-byte segment.
        assert r["seen"]["all_reduce"] == [4, 4], key
        assert r["seen"]["all_to_all_single"] == [m], key
        assert r["seen"]["all_gather_single"] == [m // n], key
        # ring model: 2(N-1)/N bytes per element, plus the two scalars' all-reduces
        assert r["bytes_sent"] == 2 * (n - 1) / n * m + 2 * (2 * (n - 1) / n * 4), key
    # 1/4 of the FP32 all-reduce of the tiny model (one bucket), plus 8 bytes
    ddp = result["ddp"]
    fp32 = ring_bytes("all_reduce", 4 * ddp["numel"], n)
    for fmt in ("e4m3fn", "e5m2"):
        assert ddp[f"{fmt}/bytes_per_step"] == fp32 / 4 + 8


@pytest.mark.slow
def test_nonfinite_propagates(result: dict[str, Any]) -> None:
    r = result["nonfinite"]  # an Inf at [3] on rank 1, a NaN at [5] on rank 0
    assert math.isnan(r["e4m3fn"]["value_3"])  # E4M3FN has no Inf: NaN
    assert r["e5m2"]["value_3"] == math.inf
    for fmt in ("e4m3fn", "e5m2"):
        assert math.isnan(r[fmt]["value_5"])
        # the scales come from the finite values: the rest is as accurate as without
        assert r[fmt]["finite_elsewhere"]
        assert r[fmt]["rel_err_elsewhere"] <= 2 * U[fmt]


@pytest.mark.slow
def test_ddp_training_with_fp8_hook_matches_fp32(result: dict[str, Any]) -> None:
    ddp = result["ddp"]
    plain = ddp["plain"]
    assert plain[-1] < plain[0]  # it trains
    for fmt in ("e4m3fn", "e5m2"):
        assert all(math.isfinite(v) for v in ddp[fmt])
        assert ddp[fmt][0] == plain[0]  # forward only
        assert ddp[fmt] != plain  # the hook ran (FP8 roundings)
        assert _rel(ddp[fmt], plain) <= 2e-3, (fmt, ddp[fmt], plain)


@pytest.mark.slow
def test_fp8_hook_composes_with_unit_scaling_divisor(result: dict[str, Any]) -> None:
    # fp16-unit reduces sum / sqrt(N); its DDP hook swapped for the FP8 one with
    # divide_by = that divisor. One step's gradients: within the FP8 roundings (2 x 2^-4
    # relative in L2) of the unit hook's, and of the same norm (a wrong divisor, N,
    # would give a ratio of 1/sqrt(2)). Losses: 5e-3, the FP8 roundings of the fp32 case
    # under u-μP's larger per-group learning rates (measured 2.0e-3).
    u = result["unit"]
    assert u["divisors"] == [math.sqrt(2), math.sqrt(2)]
    assert u["rel_l2"] <= 2 * U["e4m3fn"]
    assert abs(u["norm_ratio"] - 1) <= 0.02
    assert u["losses"][0] == u["reference"][0]
    assert _rel(u["losses"], u["reference"]) <= 5e-3


@pytest.mark.slow
def test_overflow_reaches_the_loss_scaler_on_every_rank(result: dict[str, Any]) -> None:
    # fp16-dynamic-ls under DDP with the FP8 hook; an Inf in rank 1's gradient at step 1.
    # Rank 0's own gradient after the hook is non-finite: the overflow travelled through
    # the FP8 all-reduce; both ranks skip, keep the weights, and back off the scale.
    for rank, r in enumerate(result["overflow"]):
        assert r["grad_finite"] == [True, False, True], rank
        assert r["skipped"] == [False, True, False], rank
        assert r["moved"] == [True, False, True], rank
        assert r["scales"] == [65536.0, 65536.0, 32768.0], rank


@pytest.mark.slow
def test_fsdp_fp8_reduce_scatter(result: dict[str, Any]) -> None:
    f = result["fsdp"]
    assert f["fp8"][0] == f["fp32"][0] and f["fp8"] != f["fp32"]
    assert _rel(f["fp8"], f["fp32"]) <= 2e-3
    assert f["fp8/reduce_scatters"] == 0  # FSDP2's own reduce-scatter replaced
    assert f["fp8/a2a_bytes"] == f["fp32/rs_bytes"] / 4  # FP8 payload: 1/4 of FP32
    # ring model: (N-1)/N of the payload plus one scalar all-reduce per FSDP unit (3)
    assert f["fp8/bytes_sent"] == f["fp8/a2a_bytes"] / 2 + 3 * 4


@pytest.mark.slow
def test_fsdp_bf16_reduce_scatter(result: dict[str, Any]) -> None:
    f = result["fsdp"]
    assert f["bf16-reduce/rs_bytes"] == f["fp32/rs_bytes"] / 2
    assert _rel(f["bf16-reduce"], f["bf16"]) <= 1e-3
    assert f["bf16-reduce"] != f["bf16"]  # the policy took effect


def test_fsdp_reduce_policy() -> None:
    p = fsdp_reduce_policy("bf16", torch.bfloat16)
    assert (p.param_dtype, p.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    p = fsdp_reduce_policy("fp32", "bf16")
    assert (p.param_dtype, p.reduce_dtype) == (None, torch.bfloat16)
    assert fsdp_reduce_policy("fp16", "fp32").reduce_dtype == torch.float32


def test_grad_divide_factor() -> None:
    assert grad_divide_factor("fp16-unit", 4) == 2.0  # sqrt(N): unit recipes
    assert grad_divide_factor("bf16", 4) == 4.0  # the mean
    with pytest.raises(ValueError, match="world"):
        grad_divide_factor("bf16", 0)


def test_ring_bytes() -> None:
    assert ring_bytes("all_reduce", 400, 4) == 600
    assert ring_bytes("all_to_all", 400, 4) == ring_bytes("reduce_scatter", 400, 4) == 300
    assert ring_bytes("all_gather", 100, 4) == 300
    with pytest.raises(ValueError, match="collective"):
        ring_bytes("broadcast", 4, 2)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: FP8CommState("bf16"), ValueError, "fmt must be a 1-byte float8"),
        (lambda: FP8CommState("e9m9"), ValueError, "fmt"),
        (lambda: FP8CommState(3), TypeError, "fmt"),  # type: ignore[arg-type]
        (lambda: FP8CommState("e5m2", 0.0), ValueError, "divide_by"),
        (lambda: FP8CommState("e5m2", math.inf), ValueError, "divide_by"),
        (lambda: FP8CommState("e5m2", True), TypeError, "divide_by"),
        (lambda: FP8CommState("e5m2", group="world"), TypeError, "group"),  # type: ignore[arg-type]
        (lambda: register_fp8_allreduce(nn.Linear(2, 2)), TypeError, "ddp_model"),  # type: ignore[arg-type]
        (lambda: fsdp_reduce_policy("bf16", torch.float64), ValueError, "reduce_dtype"),
        (lambda: fsdp_reduce_policy("bf16", "int8"), ValueError, "reduce_dtype"),
        (lambda: fsdp_reduce_policy("nope", "bf16"), ValueError, "nope"),
        (lambda: enable_fp8_reduce_scatter(nn.Linear(2, 2)), ValueError, "fully_shard"),
        (lambda: enable_fp8_reduce_scatter("m"), TypeError, "model"),  # type: ignore[arg-type]
        (lambda: FP8ReduceScatter("e5m2"), TypeError, "state"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments(call: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_reduce_scatter_refuses_other_ops() -> None:
    import torch.distributed as dist

    rs = FP8ReduceScatter(FP8CommState("e5m2"))
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="op"):
        rs(t, t, None, dist.ReduceOp.MAX)  # type: ignore[arg-type]
