"""Every output and every gradient (the input's included) of a float8 MLP under tensor and
sequence parallelism against one process, for every layout and float8 preset.

``_tp_worker.py`` runs the layouts on 2 processes (1-D mesh: torch's ``ColwiseParallel`` /
``RowwiseParallel``, ``SequenceParallel`` norms, and lowprec's ``Float8ColwiseParallel``;
and DDP, FSDP2 and FSDP2 with the FP8 weight all-gather, against one process that
accumulates the ranks' batch slices) and on 4 (a 2-D ``dp × tp`` mesh, weights
distributed by hand); see its docstring. Data parallelism runs every dynamic preset and
FP32 (a delayed history records per rank what one process records per slice in turn). The
tests bound, per output and gradient, ``max |parallel - one process| / max |one process|``:

* **Exact cases, 1e-5.** Unit scaling (u-μP) under torch's styles: the same maths on
  shards (measured ~4e-7). Data parallelism: each rank's slice is quantized as the
  reference quantizes that slice, and the gradient average differs only in float32 order
  (measured 0). Tensor parallelism: where every scaling group of every operand lies inside one shard
  (tensor-wise scales, whose ``amax`` is reduced over the mesh, and block scales whose
  blocks the shards do not cut), the FP8 operands are those of one process bit for bit and
  only the order of float32 sums differs (measured 0 to ~1e-7).
* **Local scales, 2q.** Where a shard cuts a scaling group (a row-wise scale over a sharded
  contracted dimension, NVFP4's per-tensor factor, blocks along the batch dimension that
  ``dp`` shards), each rank scales its part of the group by its own ``amax``: a
  different, equally valid rounding of the same values. Both roundings lie within ``q``
  of the FP32 result, where ``q`` is the one-process float8 model's own difference from
  the FP32 model for that output or gradient, so they lie within ``2q`` of each other.

The placements of the local gradients do not depend on the preset, so the exact presets
(tensorwise and delayed in every layout, the block presets in the 1-D ones) pin them; the
2q bound checks that the other quantizations compose with sharding.
A lost or doubled partial sum gives O(1) differences: before the placements of the local
GEMMs' gradients were stated, the input gradient was off by 0.74 (``colrow``) and the
sequence-parallel norm gradients by up to 0.78, far above either bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._helpers import torchrun_json
from tests.distributed._tp_worker import DP_PRESETS, LAYOUTS_1D, OTHER_TECHNIQUES, PRESETS

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("_tp_worker.py")
EXACT = 1e-5

# (layout, preset) pairs whose scaling groups the shards cut: see the module docstring.
LOCAL_SCALES = {(layout, p) for layout in (*LAYOUTS_1D, "2d") for p in ("rowwise", "nvfp4")} | {
    ("2d", p) for p in ("blockwise", "mxfp8", "mxfp4")
}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp_harness")
    return {
        **torchrun_json(WORKER, 2, tmp / "tp2.json"),
        **torchrun_json(WORKER, 4, tmp / "tp4.json"),
    }


CASES = (
    [(layout, p) for layout in (*LAYOUTS_1D, "2d") for p in PRESETS]
    + [(layout, p) for layout, presets in DP_PRESETS.items() for p in presets]
    + [(layout, p) for layout in ("colrow", "sp") for p in OTHER_TECHNIQUES]
)


@pytest.mark.parametrize(("layout", "preset"), CASES)
def test_every_output_and_gradient_matches_one_process(
    result: dict[str, Any], layout: str, preset: str
) -> None:
    r = result[f"{layout}/{preset}"]
    par, q = r["parallel"], r["quantization"]
    # The input gradient and every parameter's gradient are compared, the norm's included.
    assert {"out", "x.grad", "up.weight.grad", "up.bias.grad", "down.weight.grad"} <= set(par)
    assert "down.bias.grad" in par
    if layout.startswith("sp"):
        assert {"norm.weight.grad", "norm.bias.grad"} <= set(par)
    for key, diff in par.items():
        bound = 2 * q[key] if (layout, preset) in LOCAL_SCALES else EXACT
        assert diff <= bound, (key, diff, bound)


def test_local_scale_bound_is_not_vacuous_for_8_bit_formats(result: dict[str, Any]) -> None:
    # For the 8-bit presets the 2q bound is far below the O(1) error of a lost partial sum
    # (before the fix: 0.74 to 0.80 on the input gradient). For the 4-bit ones it is not
    # always (q reaches 0.38), which is why every layout also runs the exact presets: the
    # placements of the local gradients do not depend on the preset.
    for layout, preset in LOCAL_SCALES:
        if preset in ("rowwise", "blockwise", "mxfp8"):
            q = result[f"{layout}/{preset}"]["quantization"]
            # < 0.5: below the 0.64-0.80 that the lost partial sums gave (measured max 0.31,
            # 2d mxfp8's weight gradient)
            assert max(2 * v for v in q.values()) < 0.5, (layout, preset, q)


def test_scalify_refuses_tensor_parallelism(result: dict[str, Any]) -> None:
    # Scaled arithmetic runs on plain tensors: a DTensor parameter is named, not computed
    # on (it crashed inside DTensor's view rule before).
    err = result["scalify_tp_error"]
    assert err is not None and "'up.weight' is a DTensor" in err
    assert "tensor parallelism is not supported under scalify" in err


def test_no_tile_warning_where_the_shards_hold_whole_blocks(result: dict[str, Any]) -> None:
    # Every tensor-parallel case of the harness shards 256 features over 2 ranks: whole
    # 128-wide (and 32-, 16-wide) blocks, so no warning.
    assert result["tile_warnings"] == []


def test_shards_that_cut_blocks_warn(result: dict[str, Any]) -> None:
    # A hidden width of 384 over 2 ranks: shards of 192 cut blockwise's 128-wide blocks,
    # each rank scales its part of a cut block by its own amax (a rounding within q of the
    # FP32 result, not one process's), and a WARNING now says so (it was silent).
    r = result["cut/blockwise"]
    par, q = r["parallel"], r["quantization"]
    assert any(
        "out_features = 384 split 2 ways gives shards of 192, not whole 128-wide" in m
        for m in r["warnings"]
    ), r["warnings"]
    assert any("in_features = 384" in m for m in r["warnings"]), r["warnings"]
    assert max(par.values()) > EXACT  # the rounding differs: the warning is not idle
    for key, diff in par.items():
        assert diff <= 2 * q[key], (key, diff, q[key])
