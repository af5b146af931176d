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


# ---- depth-relative rules ------------------------------------------------------------------


def test_block_depths_outermost_lists_only() -> None:
    from lowprec.recipes.layers import block_depths

    class Expertish(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))  # nested: no blocks

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Expertish() for _ in range(5))
            self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    assert block_depths(M()) == {"layers": 5, "head": 2}
    assert block_depths(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == {"": 2}
    assert block_depths(nn.Linear(2, 2)) == {}


@pytest.mark.parametrize(
    ("pattern", "n", "want"),
    [
        # the share rounds half up: floor(P/100 * n + 1/2)
        ("*.{last:15%}.*", 12, {10, 11}),  # 1.8 -> 2
        ("*.{last:15%}.*", 4, {3}),  # 0.6 -> 1
        ("*.{last:15%}.*", 2, set()),  # 0.3 -> 0
        ("*.{last:25%}.*", 2, {1}),  # 0.5 -> 1 (half up)
        ("*.{first:2}.*", 5, {0, 1}),
        ("*.{last:0}.*", 5, set()),
        ("*.{last:9}.*", 5, {0, 1, 2, 3, 4}),  # more than n: all
        ("*.{first:100%}.*", 3, {0, 1, 2}),
        ("model.layers.{last:1}.mlp", 3, {2}),
    ],
)
def test_depth_rule_selects_blocks(pattern: str, n: int, want: set[int]) -> None:
    rule = LayerRule(pattern, None)
    assert rule.depth_relative
    depths = {"model.layers": n}
    names = [f"model.layers.{i}.mlp" for i in range(n)]
    got = {i for i, fqn in enumerate(names) if rule.matches(fqn, depths)}
    assert got == want
    # a name outside any block list, or in a nested list, never matches the token
    assert not rule.matches("model.layers.0.mlp.experts.7.up", {"model.layers": n}) or (0 in want)
    assert not rule.matches("lm_head", depths)


def test_depth_rule_needs_depths_and_valid_tokens() -> None:
    with pytest.raises(ValueError, match="depth-relative"):
        LayerRule("*.{last:1}.*").matches("blocks.0.fc")
    for bad in (
        "*.{last:1}.{first:1}",
        "*.{mid:1}.*",
        "*.{last:-1}.*",
        "*.{last:1.5}.*",
        "*.{last:101%}.*",
        "*.{last:1",
    ):
        with pytest.raises(ValueError, match="pattern"):
            LayerRule(bad)
    # plain patterns are unchanged, with or without depths
    assert LayerRule("blocks.1.*").matches("blocks.1.fc", None)
    assert not LayerRule("blocks.1.*").depth_relative


def test_fp4_train_presets_keep_the_last_blocks_in_bf16() -> None:
    """nvfp4-train's default rule: the last 15% of the blocks (and the head) stay BF16;
    it survives the recipe's JSON round trip and is replaceable."""
    from lowprec.recipes.presets import FP4_BF16_BLOCKS

    for name in ("nvfp4-train", "mxfp4-train"):
        r = get_recipe(name)
        assert r.layers == (FP4_BF16_BLOCKS,)
        assert Recipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
        model = CharGPT(ModelConfig(width=32, depth=4, heads=2, seq_len=16))
        p = prepare(model, r)
        low = {n for n, m in p.model.named_modules() if isinstance(m, Float8Linear)}
        assert low == {
            f"blocks.{i}.{leaf}"
            for i in range(3)
            for leaf in ("attn.qkv", "attn.proj", "fc", "fc_out")
        }
        assert type(p.model.blocks[3].fc) is nn.Linear and p.model.blocks[3].fc.weight.dtype == (
            torch.bfloat16
        )
    assert get_recipe("fp8-deepseek").layers == ()
    r = get_recipe("nvfp4-train", layers=())
    p = prepare(CharGPT(ModelConfig(width=32, depth=4, heads=2, seq_len=16)), r)
    assert sum(isinstance(m, Float8Linear) for m in p.model.modules()) == 16
