"""Tests for recipes and prepare()."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec.amp import DynamicLossScaler, MasterWeights, NoLossScaler, StaticLossScaler
from lowprec.cli import main
from lowprec.recipes import Policy, Recipe, get_recipe, prepare, recipe_names, register
from lowprec.scalify import ScalifyConfig

REQUIRED = ["fp32", "bf16", "fp16", "fp16-static-ls", "fp16-dynamic-ls", "amp-bf16"]


def test_required_recipes_exist_and_round_trip() -> None:
    assert set(REQUIRED) <= set(recipe_names())
    for name in REQUIRED:
        r = Recipe.from_name(name)
        assert Recipe.from_dict(r.to_dict()) == r
        assert r.description


def test_unknown_recipe_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown name 'fp8'; valid: fp32, bf16, fp16"):
        get_recipe("fp8")


@pytest.mark.parametrize(
    ("name", "dtype", "opt", "scaler"),
    [
        ("fp32", torch.float32, torch.optim.AdamW, NoLossScaler),
        ("bf16", torch.bfloat16, MasterWeights, NoLossScaler),
        ("fp16", torch.float16, MasterWeights, NoLossScaler),
        ("fp16-static-ls", torch.float16, MasterWeights, StaticLossScaler),
        ("fp16-dynamic-ls", torch.float16, MasterWeights, DynamicLossScaler),
        ("amp-bf16", torch.float32, torch.optim.AdamW, NoLossScaler),
    ],
)
def test_prepare(name: str, dtype: torch.dtype, opt: type, scaler: type) -> None:
    p = prepare(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), name)
    assert all(q.dtype == dtype for q in p.model.parameters())
    assert isinstance(p.optimizer, opt) and type(p.scaler) is scaler
    x = torch.randn(4, 8, dtype=dtype)
    with p.compute():
        out = p.model(x)
    expected = torch.bfloat16 if name == "amp-bf16" else dtype
    assert out.dtype == expected, "autocast runs the compute in BF16"


def test_prepare_trains_a_step() -> None:
    torch.manual_seed(0)
    p = prepare(nn.Linear(8, 1), "fp16-static-ls", lambda ps: torch.optim.SGD(ps, lr=0.1))
    w0 = p.model.weight.detach().clone()
    with p.compute():
        loss = p.model(torch.ones(2, 8, dtype=torch.float16)).float().mean()
        p.scaler.scale(loss).backward()
    assert p.scaler.step(p.optimizer)
    p.scaler.update()
    # d(mean)/dw = 1 per weight (2^12 scaled, exact); SGD lr 0.1 in FP32, written back to FP16.
    assert torch.equal(p.model.weight.detach(), (w0.float() - 0.1).half())


def test_recipe_validation_and_register() -> None:
    with pytest.raises(ValueError, match="param_dtype"):
        Policy(param_dtype="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="autocast needs fp32"):
        Policy(param_dtype="bf16", autocast="bf16")
    with pytest.raises(ValueError, match="master_weights only"):
        Policy(master_weights=True)
    with pytest.raises(ValueError, match="already registered"):
        register(Recipe("fp32", "again"))
    with pytest.raises(ValueError, match="unknown keys"):
        Recipe.from_dict({"name": "x", "description": "d", "bogus": 1})
    with pytest.raises(TypeError, match=r"nn\.Module"):
        prepare("model", "fp32")  # type: ignore[arg-type]


def test_cli_lists_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in REQUIRED:
        assert name in out


def test_technique_validation() -> None:
    with pytest.raises(ValueError, match="technique must be one of"):
        Recipe.from_dict({"name": "x", "description": "d", "technique": "magic"})
    with pytest.raises(ValueError, match="exactly when technique='float8'"):
        Recipe.from_dict({"name": "x", "description": "d", "technique": "float8"})
    with pytest.raises(ValueError, match="unit_fp8 needs"):
        Recipe.from_dict({"name": "x", "description": "d", "unit_fp8": True})
    with pytest.raises(ValueError, match="scalify_format must be one of"):
        Recipe.from_dict(
            {"name": "x", "description": "d", "technique": "scalify", "scalify_format": "e4m3"}
        )
    with pytest.raises(ValueError, match="keeps fp32 parameters"):
        Recipe("x", "d", Policy("bf16", True), ScalifyConfig(data_format="fp16"))
    with pytest.raises(ValueError, match="scalify_format needs"):
        Recipe.from_dict({"name": "x", "description": "d", "scalify_format": "fp16"})
    for name in ("fp32-unit", "fp16-unit", "bf16-unit", "fp8-unit", "fp16-scalify", "fp8-scalify"):
        r = get_recipe(name)
        assert Recipe.from_dict(r.to_dict()) == r


@pytest.mark.parametrize("name", ["bf16", "amp-bf16"])
@pytest.mark.parametrize("native", [True, False])
def test_bf16_recipes_use_fp32_products_without_native_bf16(
    monkeypatch: pytest.MonkeyPatch, name: str, native: bool
) -> None:
    """On a CPU without BF16 instructions the bf16 recipe takes its products in FP32 and
    rounds once (lowprec.amp.MatmulInFp32); with them, torch's own BF16 GEMM runs.
    amp-bf16 always leaves its products to autocast."""
    import lowprec.amp
    import lowprec.recipes.prepared

    monkeypatch.setattr(lowprec.recipes.prepared, "native_bf16_matmul", lambda: native)
    seen: list[torch.dtype] = []
    real = lowprec.amp.MatmulInFp32.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        seen.append(self.dtype)
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(lowprec.amp.MatmulInFp32, "__torch_function__", spy)
    torch.manual_seed(0)
    run = prepare(nn.Linear(8, 4), name, lambda ps: torch.optim.SGD(ps, lr=0.1))
    x = torch.randn(2, 8, dtype=torch.bfloat16 if name == "bf16" else torch.float32)
    with run.compute():
        y = run.model(x)
    assert y.dtype == torch.bfloat16
    assert (torch.bfloat16 in seen) is (not native and name == "bf16")


def test_prepared_load_state_dict_is_all_or_nothing() -> None:
    """Issue 14: a state whose scaler part is refused (negative scale) leaves the model,
    the optimizer (FP32 masters) and the scaler exactly as they were."""
    torch.manual_seed(0)
    src = prepare(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), "fp16-dynamic-ls")
    torch.manual_seed(1)
    dst = prepare(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), "fp16-dynamic-ls")
    before = {k: v.clone() for k, v in dst.model.state_dict().items()}
    scale_before = dst.scaler.state_dict()
    bad = src.state_dict()
    bad["scaler"] = {**bad["scaler"], "scale": -1.0}
    with pytest.raises(ValueError, match="scale"):
        dst.load_state_dict(bad)
    after = dst.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not torch.equal(before["0.weight"], src.model.state_dict()["0.weight"])
    assert dst.scaler.state_dict() == scale_before


def test_a_recipe_saved_before_the_float8_config_moved_loads() -> None:
    """Recipes saved by lowprec 0.1 (config.json, checkpoints) name their nested float8
    dataclasses by the old module path ``lowprec.float8.recipe``; they load as the same
    recipe. ``Float8Recipe`` is the documented alias of ``Float8Config``."""
    import json

    from lowprec.float8 import Float8Config, Float8Recipe

    r = get_recipe("fp8-rowwise")
    text = json.dumps(r.to_dict())
    assert "lowprec.float8.config:CastConfig" in text
    old = json.loads(text.replace("lowprec.float8.config:", "lowprec.float8.recipe:"))
    assert Recipe.from_dict(old) == r
    assert Float8Recipe is Float8Config
