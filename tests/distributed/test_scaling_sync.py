"""The same float8 scaling state on every rank (2 processes, gloo, different data per rank).

The case ``case_sync`` of ``_float8_worker.py`` (one 2-process launch shared by the float8
distributed test files) trains a delayed-scaling float8 MLP for 3
steps under DDP with and without :func:`attach_scaling_sync`, and under FSDP2 with it;
then calibrates a static recipe on different data per rank and calls
:func:`sync_scaling_state`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed._float8_worker import results

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return results("case_sync", tmp_path_factory)


@pytest.mark.parametrize("mode", ("ddp", "fsdp"))
def test_identical_histories_on_both_ranks(result: dict[str, Any], mode: str) -> None:
    rank0, rank1 = result[mode]
    assert rank0 == rank1
    # The newest input amax of the first layer is the amax of the whole global batch of
    # the last step (max over the ranks' different data), exactly.
    assert rank0["0.input_amax_history"][0] == result["global_amax_last_input"]
    assert len(rank0) == 9  # 3 layers x 3 roles


def test_without_sync_the_ranks_differ(result: dict[str, Any]) -> None:
    # The control: DDP broadcasts rank 0's buffers before each forward, then each rank
    # records its own amax, so the newest entries disagree.
    rank0, rank1 = result["ddp-unsynced"]
    assert rank0["0.input_amax_history"][0] != rank1["0.input_amax_history"][0]


def test_static_calibration_reduced(result: dict[str, Any]) -> None:
    s = result["static"]
    assert s["before"][0] != s["before"][1]  # each rank saw its own data
    assert s["after"] == [s["global_amax"]] * 2
    # The frozen scale is recomputed from the reduced maximum: identical on both ranks.
    assert s["scale"] == [s["expected_scale"]] * 2
