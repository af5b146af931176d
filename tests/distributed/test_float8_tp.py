"""Float8Linear under tensor and sequence parallelism: a 2-rank CPU mesh against one process.

The case ``case_tp`` of ``_float8_worker.py`` (one 2-process launch shared by the float8
distributed test files) trains, for 3 SGD steps, a float8 MLP under
torch's ``ColwiseParallel`` + ``RowwiseParallel`` and a pre-norm transformer block under
``SequenceParallel`` norms, :class:`Float8ColwiseParallel` (FP8 all-gather of the
sequence-sharded input) for q/k/v and the MLP's up-projection and ``RowwiseParallel`` with
sequence-sharded outputs; the same modules train on one process.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed._float8_worker import results

pytestmark = pytest.mark.slow

CASES = ("mlp-tensorwise", "mlp-delayed", "block-tensorwise", "block-delayed")


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return results("case_tp", tmp_path_factory)


@pytest.mark.parametrize("case", CASES)
def test_tp_matches_one_process(result: dict[str, Any], case: str) -> None:
    # Every shard is quantized with the scale of the whole tensor (dynamic: the amax over
    # the mesh; delayed: the history of the whole tensor's amax), so the FP8 operands are
    # those of one process. What differs is the float32 order of the row-parallel partial
    # sums and of the input-gradient sums: relative 1e-5 on the loss and the weights.
    r = result[case]
    assert r["tp"] == pytest.approx(r["ref"], rel=1e-5)
    assert r["param_rel_diff"] < 1e-5


@pytest.mark.parametrize("case", ("block-tensorwise", "block-delayed"))
def test_sequence_parallel_input_gathered_in_fp8(result: dict[str, Any], case: str) -> None:
    # The q projection receives the gathered input as a ScaledTensor of E4M3 payloads
    # (1 byte per element on the wire) equal, bit for bit, to one process quantizing the
    # whole normalized input.
    r = result[case]
    assert r["q_in_dtype"] == "torch.float8_e4m3fn"
    assert r["q_in_equal"]


@pytest.mark.parametrize(
    ("preset", "shape", "shards", "cut"),
    [
        ("blockwise", (256, 64), (2, 1), None),  # shards of 128: whole tiles
        ("blockwise", (384, 64), (2, 1), "out_features = 384 split 2 ways gives shards of 192"),
        ("blockwise", (128, 64), (2, 1), "shards of 64"),
        ("blockwise", (64, 384), (1, 2), "in_features = 384 split 2 ways"),
        ("blockwise", (64, 300), (1, 2), "shards of 150"),  # uneven: ceil(300 / 2)
        ("blockwise", (384, 64), (1, 1), None),  # one shard: one process's blocks
        ("mxfp8", (96, 64), (2, 1), "shards of 48, not whole 32-wide"),
        ("mxfp8", (128, 64), (2, 1), None),
        ("nvfp4", (40, 64), (2, 1), "shards of 20, not whole 16-wide"),
        ("tensorwise", (384, 64), (2, 1), None),  # a scale of the whole tensor
        ("rowwise", (384, 384), (2, 2), None),  # rows: a rounding the docs state
    ],
)
def test_cut_tiles(
    preset: str, shape: tuple[int, int], shards: tuple[int, int], cut: str | None
) -> None:
    from lowprec.distributed.float8_dtensor import cut_tiles
    from lowprec.float8 import Float8Config

    why = cut_tiles(Float8Config.from_name(preset), shape, shards)
    assert why is None if cut is None else (why is not None and cut in why), why


def test_cut_tiles_sees_a_per_gemm_format() -> None:
    # Tensorwise with an MX weight-gradient GEMM: the MX blocks are cut, so it warns.
    from lowprec.distributed.float8_dtensor import cut_tiles
    from lowprec.float8 import Float8Config

    c = Float8Config.from_name("tensorwise", gemms={"weight_grad": "mxfp8"})
    assert cut_tiles(c, (96, 64), (2, 1)) is not None
    with pytest.raises(ValueError, match="shape and shards must be pairs"):
        cut_tiles(c, (96, 64, 2), (2, 1))
