"""lowprec.tune on small models: the choices it makes, the plan's JSON, determinism."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from lowprec.autopilot import Budget, Plan, tune
from lowprec.autopilot.cost import GEMMS
from lowprec.recipes import prepare

GAIN = 1e3
OUTLIERS = list(range(1, 64, 16))  # one in each 16-element (NVFP4) block


class TwoLayers(nn.Module):
    """``b(tanh(a(x · s)))``: ``a``'s input has outlier channels (``s = 10³`` there, its
    weight columns divided by 10³: the same function), ``b``'s input is tame."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        s = torch.ones(64)
        s[OUTLIERS] = GAIN
        self.register_buffer("s", s)
        with torch.no_grad():
            self.a.weight[:, OUTLIERS] /= GAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x * self.s)))  # type: ignore[no-any-return]


def _loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return (m(x) - y).square().mean()


def _setup() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = TwoLayers()
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)) for _ in range(2)
    ]
    return model, batches


# A generous budget: a tame layer's NVFP4 GEMMs fit (a few % loss change), the outlier
# layer's NVFP4 forward (which flushes every non-outlier input) does not.
BUDGET = Budget(loss=0.05, grad=0.5)


@pytest.fixture(scope="module")
def b200_plan() -> Plan:
    model, batches = _setup()
    return tune(model, batches, loss_fn=_loss, target="b200", budget=BUDGET)


def test_outlier_layer_gets_no_fp4_and_the_tame_layer_the_cheapest(b200_plan: Plan) -> None:
    a, b = b200_plan.layers["a"]["gemms"], b200_plan.layers["b"]["gemms"]
    assert a["forward"]["format"] not in ("mxfp4", "nvfp4")
    assert b["forward"]["format"] in ("mxfp4", "nvfp4")  # rate 4 on b200: the cheapest
    # what the plan records: the measured numbers and the safer choices, bf16 last
    fwd = b["forward"]
    assert fwd["fallbacks"][-1] == "bf16" and fwd["format"] not in fwd["fallbacks"]
    assert fwd["flops"] == 2 * 128 * 64 * 64  # 2 batches of 64 rows: 2·M·K·N
    assert 10 < fwd["sqnr_db"] < 25  # E2M1 with block scales: about 20 dB on N(0, 1)
    assert b200_plan.measured["error"] <= 1.0
    assert b200_plan.cost < 0.5


def test_the_model_is_not_modified() -> None:
    model, batches = _setup()
    before = copy.deepcopy(model.state_dict())
    tune(model, batches, loss_fn=_loss, target="cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(m) in (TwoLayers, nn.Linear) for m in model.modules())


@pytest.mark.parametrize("target", ["cpu", "h100", "h200"])
def test_targets_where_fp4_brings_nothing(target: str) -> None:
    model, batches = _setup()
    plan = tune(model, batches, loss_fn=_loss, target=target, budget=BUDGET)
    formats = {g["format"] for d in plan.layers.values() for g in d["gemms"].values()}
    assert not formats & {"mxfp4", "nvfp4"}  # on h100/h200 FP4 ties with FP8: the safer wins
    if target == "cpu":  # emulation brings no speed: everything stays BF16
        assert formats == {"bf16"} and plan.cost == 1.0
    else:
        assert plan.cost == pytest.approx(0.5)  # every GEMM in FP8 with this budget


def test_same_seed_same_plan_json() -> None:
    model, batches = _setup()
    one = tune(model, batches, loss_fn=_loss, target="b200", budget=BUDGET, seed=3)
    two = tune(model, batches, loss_fn=_loss, target="b200", budget=BUDGET, seed=3)
    assert one.to_json() == two.to_json()


def test_plan_round_trips_through_strict_json(b200_plan: Plan, tmp_path: object) -> None:
    path = b200_plan.save(tmp_path / "plan.json")  # type: ignore[operator]
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in strict JSON"))
    back = Plan.load(path)
    assert back == b200_plan
    d = json.loads(text)
    assert d["kind"] == "lowprec-plan" and d["recipe"]["layers"]
    assert set(d["layers"]["a"]["gemms"]) == set(GEMMS)
    # the recipe trains: each layer gets its per-GEMM config
    model, batches = _setup()
    p = prepare(model, back.recipe)
    cfg = p.model.b.recipe  # type: ignore[union-attr]
    assert cfg.for_gemm("forward").input.fmt == "e2m1"
    loss = _loss(p.model, batches[0])
    assert math.isfinite(float(loss.detach()))


def test_bad_arguments_name_themselves() -> None:
    model, batches = _setup()
    with pytest.raises(ValueError, match="target must be one of"):
        tune(model, batches, loss_fn=_loss, target="a100")
    with pytest.raises(ValueError, match="budget must be a finite number > 0"):
        tune(model, batches, loss_fn=_loss, budget=-1.0)
    with pytest.raises(ValueError, match="batches: need at least one batch"):
        tune(model, [], loss_fn=_loss)
    with pytest.raises(ValueError, match="not a plan"):
        Plan.from_dict({"name": "fp32"})


def test_a_layer_the_plan_does_not_name_stays_bf16(b200_plan: Plan) -> None:
    """A plan applied to a model with a layer it was not tuned on: that layer stays in the
    parameters' BF16 (its formats were never measured; it got fp8-tensorwise, silently),
    the tuned ones keep their formats."""

    class Three(TwoLayers):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(super().forward(x))  # type: ignore[no-any-return]

    torch.manual_seed(0)
    p = prepare(Three(), b200_plan.recipe)
    assert type(p.model.c) is nn.Linear and p.model.c.weight.dtype == torch.bfloat16
    assert p.model.b.recipe.for_gemm("forward").input.fmt == "e2m1"  # type: ignore[union-attr]
