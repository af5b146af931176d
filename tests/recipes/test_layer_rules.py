"""Per-layer recipes (Recipe.layers): matching, serialisation, and what prepare() builds.

Oracle for the numerics: the same model converted by hand, layer by layer, with
``Float8Linear.from_linear``; prepare() with rules must give bit-identical outputs and
gradients (it is the same conversion, chosen by pattern).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from lowprec.float8 import Float8Config, Float8Linear
from lowprec.jobs.model import CharGPT, ModelConfig
from lowprec.recipes import Recipe, get_recipe, prepare
from lowprec.recipes.layers import LayerRule, layer_config, rules_from_list

ROW = Float8Config.from_name("rowwise")
NV = Float8Config.from_name("nvfp4")
TW = Float8Config.from_name("tensorwise")


def _plan() -> Recipe:
    rules = (
        LayerRule("blocks.0.attn.*", ROW),
        LayerRule("blocks.1.fc_out", None),
        LayerRule("blocks.*.fc", NV),
        LayerRule("head", TW),  # a rule wins over float8_skip
    )
    return dataclasses.replace(get_recipe("fp8-tensorwise"), name="plan", layers=rules)


def test_first_match_wins_and_skip() -> None:
    rules = (LayerRule("a.*", ROW), LayerRule("a.b", None))
    assert layer_config(rules, "a.b", TW, ()) is ROW
    assert layer_config(rules, "c", TW, ("c",)) is None  # float8_skip
    assert layer_config(rules, "c.d", TW, ("c",)) is TW  # the last component only
    assert layer_config((LayerRule("c", NV),), "c", TW, ("c",)) is NV


def test_round_trip_through_json() -> None:
    r = _plan()
    d = json.loads(json.dumps(r.to_dict()))
    assert d["layers"][1] == {"pattern": "blocks.1.fc_out", "float8": None}
    back = Recipe.from_dict(d)
    assert back == r and back.layers[2].float8 == NV
    old = r.to_dict()
    del old["layers"]  # a recipe written before per-layer rules
    assert Recipe.from_dict(old).layers == ()


def test_prepare_applies_each_layer_its_config() -> None:
    torch.manual_seed(0)
    model = CharGPT(ModelConfig(width=32, depth=2, heads=2, seq_len=16))
    ref = copy.deepcopy(model)
    p = prepare(model, _plan())
    got = {n: m.recipe.name for n, m in p.model.named_modules() if isinstance(m, Float8Linear)}
    assert got == {
        "blocks.0.attn.qkv": "rowwise",
        "blocks.0.attn.proj": "rowwise",
        "blocks.0.fc": "nvfp4",
        "blocks.0.fc_out": "tensorwise",
        "blocks.1.attn.qkv": "tensorwise",
        "blocks.1.attn.proj": "tensorwise",
        "blocks.1.fc": "nvfp4",
        "head": "tensorwise",
    }
    assert type(p.model.blocks[1].fc_out) is nn.Linear
    # The oracle: the same conversion by hand.
    ref = ref.to(torch.bfloat16)
    for name, cfg in (
        ("blocks.0.attn.qkv", ROW),
        ("blocks.0.attn.proj", ROW),
        ("blocks.0.fc", NV),
        ("blocks.0.fc_out", TW),
        ("blocks.1.attn.qkv", TW),
        ("blocks.1.attn.proj", TW),
        ("blocks.1.fc", NV),
        ("head", TW),
    ):
        parent, _, leaf = name.rpartition(".")
        owner = ref.get_submodule(parent) if parent else ref
        setattr(owner, leaf, Float8Linear.from_linear(getattr(owner, leaf), cfg))
    idx = torch.randint(0, 65, (3, 16))
    for m in (p.model, ref):
        m(idx)[0].float().square().mean().backward()
    torch.testing.assert_close(p.model(idx)[0], ref(idx)[0], rtol=0, atol=0)
    for (n, a), (_, b) in zip(p.model.named_parameters(), ref.named_parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, n
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=n)


def test_bad_rules() -> None:
    with pytest.raises(ValueError, match="need a float8 technique"):
        get_recipe("bf16", layers=(LayerRule("x", ROW),))
    with pytest.raises(ValueError, match="pattern"):
        LayerRule("")
    with pytest.raises(TypeError, match="float8 must be a Float8Config"):
        LayerRule("x", "rowwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layers\[1\]"):
        rules_from_list([{"pattern": "a"}, {"pat": "b"}])
    with pytest.raises(ValueError, match="layers must be a list"):
        rules_from_list("a")
    with pytest.raises(TypeError, match="module_filter must return"):
        from lowprec.float8 import apply

        apply(nn.Sequential(nn.Linear(4, 4)), "tensorwise", lambda m, n: "rowwise")  # type: ignore[arg-type,return-value]
