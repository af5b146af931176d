"""Unit recipes under DDP and FSDP2 give the one-process gradient whatever the loss.

One ``torchrun`` launch of ``_unit_loss_worker.py`` (2 processes, gloo, 4 rows per rank).
A unit-scaled weight's gradient is scaled by ``b^-1/2`` of the rows it sums over, so the
ranks' gradients are summed and divided by ``√N`` after lowprec's unit losses (whose
backward is the sum's) and by ``N^{3/2}`` after a plain mean loss
(``lowprec.distributed.unit_reduce``). With ``√N`` for every loss, a mean loss computed
outside the model (the README's ``F.cross_entropy(model(x), y)``) got exactly N = 2 times
the one-process gradient, with no error. The divisor follows the outputs the gradient
comes through: a model that computes its unit loss while the user back-propagates a mean
loss of its logits instead (``unused-unit``: every gradient was 2 times too large), and
the unit loss plus a mean term (``mixed``: the mean term's part was 2 times too large),
give the one-process gradient too.

A unit MoE layer's expert weight gradient is scaled by ``n_e^-1/2`` of the tokens routed
to it, which differ between the ranks: the experts share their counts over the group
(each rank's own count gave every expert weight a gradient off by a factor that depends on
the routing: ``test_moe_gradients_are_the_one_process_gradients``).

Tolerances, relative L2 per parameter: FP32 communication, 1e-5 (only the order of float32
sums differs); BF16 communication, 1e-2 (each bucket rounded to BF16, 2^-9 relative per
element, summed); FP8 (E4M3) communication, 0.1 (half an E4M3 step is 2^-4 relative per
element at the bucket's shared scale). Each rank's input gradient is that of one process
on the rank's half batch (1e-6: nothing reduces it), with ``mixed``'s mean term at 1/N of
its weight (it enters the model divided by N).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests._helpers import torchrun_json
from tests.distributed._unit_loss_worker import LOSSES, MODES, MOE_LOSSES, MOE_MODES

pytestmark = pytest.mark.slow

WORKER = __import__("pathlib").Path(__file__).with_name("_unit_loss_worker.py")
TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp8": 0.1}


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("unit_loss") / "out.json"
    r: dict[str, Any] = torchrun_json(WORKER, 2, out)
    return r


def _rel(a: list[float], b: list[float]) -> float:
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    den = math.sqrt(sum(y * y for y in b))
    return num / den if den else num


def _assert_grads(got: dict[str, list[float]], ref: dict[str, list[float]], tol: float) -> None:
    """Every parameter's gradient within ``tol`` (relative L2) of the reference's."""
    assert set(got) == set(ref)
    for name, g in got.items():
        assert _rel(g, ref[name]) <= tol, (name, _rel(g, ref[name]))


@pytest.mark.parametrize(("mode", "comm"), MODES)
@pytest.mark.parametrize("loss", LOSSES)
def test_gradients_are_the_one_process_gradients(
    result: dict[str, Any], loss: str, mode: str, comm: str
) -> None:
    got = result[f"{loss}/{mode}-{comm}"]
    _assert_grads(got["grads"], result[f"{loss}/reference"], TOL[comm])
    for dx, want in zip(got["dx"], result[f"{loss}/reference_dx"], strict=True):
        assert _rel(dx, want) <= 1e-6


@pytest.mark.parametrize(("mode", "comm"), MOE_MODES)
@pytest.mark.parametrize("loss", MOE_LOSSES)
def test_moe_gradients_are_the_one_process_gradients(
    result: dict[str, Any], loss: str, mode: str, comm: str
) -> None:
    got = result[f"moe/{loss}/{mode}-{comm}"]["grads"]
    assert any("experts" in n for n in got)
    _assert_grads(got, result[f"moe/{loss}/reference"], TOL[comm])
