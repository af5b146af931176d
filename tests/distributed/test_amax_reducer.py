"""Cross-rank amax in the core scalers (2 processes, gloo, different data per rank).

The case ``case_reducer`` of ``_float8_worker.py`` runs a ``DelayedScaler`` built with
``reducer=MaxReducer()`` on each rank's own data, and a ``DynamicScaler`` given the reduced
``amax=``; the oracle is one process's scaler on the ranks' data concatenated, since
``amax(x_0 ∪ x_1) = max(amax(x_0), amax(x_1))`` exactly.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed._float8_worker import results

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return results("case_reducer", tmp_path_factory)


def test_reduced_history_is_the_one_process_history(result: dict[str, Any]) -> None:
    h0, h1 = result["history"]
    assert h0 == h1 == result["one_history"]  # exact: max is exact, one amax per tensor
    assert result["scales"][0] == result["scales"][1] == result["one_scales"]
    assert h0[0] > 0 and len(set(h0)) > 1  # non-vacuous: a real, changing history


def test_given_amax_is_used_as_is(result: dict[str, Any]) -> None:
    a0, a1 = result["dynamic_given"]
    assert a0 == a1 == result["dynamic_whole"]
