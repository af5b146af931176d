"""Float8 conversion of HF transformers MoE models (experts with 3-D weights, routers).

Tiny random configs of each family, built from their config classes (no download).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")

from lowprec.float8 import (  # noqa: E402
    Float8Config,
    Float8Experts,
    Float8Linear,
    apply,
    convert_back,
)
from lowprec.float8.config import GEMMS  # noqa: E402
from lowprec.float8.experts import experts_flags, is_experts, router_ids  # noqa: E402
from lowprec.float8.router import Float8Router  # noqa: E402
from tests import _moe  # noqa: E402
from tests._helpers import assert_compiled_equals_eager  # noqa: E402

FAMILIES = _moe.FAMILIES


def _model(family: str, layers: int = 2, seed: int = 0) -> nn.Module:
    return _moe.model(family, layers, seed, routers=False)


def _pair(family: str, config: Any = "tensorwise", **kw: Any) -> tuple[nn.Module, nn.Module]:
    plain = _model(family, **kw)
    conv = _model(family, **kw)
    conv.load_state_dict(plain.state_dict())
    return plain, apply(conv, config)


def _matmul_share(plain: nn.Module, conv: nn.Module) -> float:
    """Share of matmul weights (linear weights and 3-D expert weights; embeddings, the LM
    head and the routers excluded) that sit in float8 modules of ``conv``."""
    routers = {n for n, m in plain.named_modules() if id(m) in router_ids(plain)}
    total = fp8 = 0
    for n, m in conv.named_modules():
        if n in routers or n.endswith("lm_head"):
            continue
        if isinstance(m, Float8Experts) or is_experts(m):
            k = sum(p.numel() for p in m.parameters(recurse=False) if p.dim() == 3)
        elif isinstance(m, nn.Linear):
            k = m.weight.numel()
        else:
            continue
        total += k
        fp8 += k if isinstance(m, (Float8Experts, Float8Linear)) else 0
    return fp8 / total


# Measured on these configs (tensorwise): 100% of the matmul weights for every family.
@pytest.mark.parametrize("family", FAMILIES)
def test_share_keys_output_backward_and_convert_back(family: str) -> None:
    plain, conv = _pair(family)
    share = _matmul_share(plain, conv)
    assert share >= 0.95, share
    assert any(isinstance(m, Float8Experts) for m in conv.modules())
    for i in router_ids(plain):  # routers stay the plain modules
        assert not any(isinstance(m, Float8Linear) and id(m) == i for m in conv.modules())
    assert list(conv.state_dict()) == list(plain.state_dict())
    ids = _moe.ids()
    ref = plain(input_ids=ids).logits
    out = conv(input_ids=ids, labels=ids)
    # E4M3 rounds each operand by at most 2^-4 relatively (3 mantissa bits), so a GEMM's
    # output errs by at most ~2^-3 of Σ|a||b| and, with errors of random sign, by about
    # 2^-4 of its norm; a token's logits pass through ~10 GEMMs in series (2 layers of
    # q/k/v/o, up, down, and the head), which adds up to sqrt(10)·2^-4 ≈ 0.2 of the
    # logits' norm where routing does not flip. Bound: 0.25.
    rel = float((out.logits - ref).norm() / ref.norm())
    assert rel < 0.25, rel
    out.loss.backward()
    for n, p in conv.named_parameters():
        assert p.grad is None or bool(torch.isfinite(p.grad).all()), n
    experts = [m for m in conv.modules() if isinstance(m, Float8Experts)]
    assert all(p.grad is not None for m in experts for p in m.parameters(recurse=False))
    # checkpoints load both ways, strictly
    plain.load_state_dict(conv.state_dict())
    conv.load_state_dict(plain.state_dict())
    back = convert_back(conv)
    assert [type(m) for m in back.modules()] == [type(m) for m in plain.modules()]
    torch.testing.assert_close(back(input_ids=ids).logits, ref, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_high_precision_experts_equal_the_plain_model(family: str) -> None:
    """With all three GEMMs in high precision, Float8Experts computes what the model's
    grouped_mm experts compute, the same kernels in the same order: logits and gradients
    equal to float32 rounding (1e-6 relative)."""
    hp = Float8Config.from_name("tensorwise", high_precision_gemms=GEMMS)
    plain = _model(family)
    conv = _model(family)
    conv.load_state_dict(plain.state_dict())
    conv = apply(conv, hp, module_filter=lambda m, fqn: fqn.endswith("experts"))
    ids = _moe.ids()
    a, b = plain(input_ids=ids, labels=ids), conv(input_ids=ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-6, atol=1e-6)
    a.loss.backward()
    b.loss.backward()
    pg = dict(plain.named_parameters())
    for n, p in conv.named_parameters():
        if pg[n].grad is not None:
            torch.testing.assert_close(p.grad, pg[n].grad, rtol=1e-5, atol=1e-7)


def _router(model: nn.Module) -> nn.Module:
    """The first MoE layer's router (``gate`` or ``router``)."""
    ids = router_ids(model)
    return next(
        m
        for n, m in model.named_modules()
        if id(m) in ids and n.endswith(("gate", "router")) and not n.endswith("_gate")
    )


def _router_io(model: nn.Module, ids: Tensor) -> tuple[list[Tensor], Any]:
    """The first router's input and outputs, and the model output (aux loss on)."""
    seen: list[Tensor] = []
    h = _router(model).register_forward_hook(lambda m, i, o: seen.extend([i[0], *o]))
    kw = (
        {}
        if isinstance(model, transformers.DeepseekV3ForCausalLM)
        else {"output_router_logits": True}
    )
    out = model(input_ids=ids, labels=ids, **kw)
    h.remove()
    return seen, out


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_and_load_balancing_loss_unchanged(family: str) -> None:
    """Experts in float8 (one MoE layer): the router sees the same hidden states, so its
    logits, top-k weights and indices and the load-balancing loss are bit for bit the plain
    model's, while the output differs (the experts ran in float8). Whole model converted:
    the router is the plain module and computes the plain router's function of its input."""
    ids = _moe.ids()
    plain = _model(family, layers=1)
    conv = _model(family, layers=1)
    conv.load_state_dict(plain.state_dict())
    conv = apply(conv, "tensorwise", module_filter=lambda m, fqn: fqn.endswith("experts"))
    (a, oa), (b, ob) = _router_io(plain, ids), _router_io(conv, ids)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    if family != "deepseek_v3":  # DeepSeek-V3 has no load-balancing loss
        assert torch.equal(oa.aux_loss, ob.aux_loss)
    assert not torch.equal(oa.logits, ob.logits)
    _, full = _pair(family, layers=1)
    r = _router(full)
    assert type(r) is type(_router(plain)) and not isinstance(r, Float8Linear)
    (x, *outs), _ = _router_io(full, ids)
    for u, v in zip(_router(plain)(x), outs, strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("config", ["rowwise", "mxfp8", "nvfp4", "blockwise"])
def test_training_steps_reduce_the_loss(family: str, config: str) -> None:
    _, conv = _pair(family, config)
    opt = torch.optim.AdamW(conv.parameters(), lr=3e-3)
    ids = _moe.ids(seed=2)
    losses = []
    for _ in range(6):
        loss = conv(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_fp8_router_converts_the_routers(family: str) -> None:
    """``fp8_router=True``: the TopKRouter becomes a Float8Router (Qwen2-MoE's
    shared_expert_gate, an nn.Linear, a Float8Linear); keys and convert_back unchanged."""
    cfg = Float8Config.from_name("tensorwise", fp8_router=True)
    plain, conv = _pair(family, cfg)
    routers = [m for m in conv.modules() if isinstance(m, Float8Router)]
    assert len(routers) == 2
    assert list(conv.state_dict()) == list(plain.state_dict())
    ids = _moe.ids()
    out = conv(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    assert all(r.weight.grad is not None for r in routers)
    ref = plain(input_ids=ids, output_router_logits=True)
    rel = float((out.router_logits[0] - ref.router_logits[0]).norm() / ref.router_logits[0].norm())
    assert 0 < rel < 0.25, rel  # the router's own GEMM in E4M3 (bound as above)
    back = convert_back(conv)
    assert [type(m) for m in back.modules()] == [type(m) for m in plain.modules()]


def test_module_filter_and_recipe_layers_apply_to_experts() -> None:
    from lowprec.recipes import get_recipe, prepare
    from lowprec.recipes.layers import LayerRule

    plain = _model("mixtral")
    seen: list[str] = []

    def pick(m: nn.Module, fqn: str) -> bool | Float8Config:
        seen.append(fqn)
        if fqn == "model.layers.0.mlp.experts":
            return Float8Config.from_name("mxfp8")
        return fqn != "model.layers.1.mlp.experts"

    conv = apply(_model("mixtral"), "tensorwise", module_filter=pick)
    assert "model.layers.0.mlp.experts" in seen
    e0, e1 = conv.model.layers[0].mlp.experts, conv.model.layers[1].mlp.experts
    assert isinstance(e0, Float8Experts) and e0.recipe.name == "mxfp8"
    assert type(e1) is type(plain.model.layers[1].mlp.experts)
    r = get_recipe("fp8-tensorwise")
    r = dataclasses.replace(r, layers=(LayerRule("*.layers.1.mlp.experts", None), *r.layers))
    p = prepare(_model("mixtral"), r)
    assert isinstance(p.model.model.layers[0].mlp.experts, Float8Experts)
    assert not isinstance(p.model.model.layers[1].mlp.experts, Float8Experts)


def test_static_config_runs_experts_dynamic_with_a_warning(caplog: Any) -> None:
    """Calibrated static scaling is not implemented for experts: dynamic, logged once."""
    with caplog.at_level(logging.WARNING, logger="lowprec.float8.experts"):
        _, conv = _pair("qwen3_moe", "static")
    ex = conv.model.layers[0].mlp.experts
    assert isinstance(ex, Float8Experts)
    assert ex.grouped_recipe.input.scaling == "dynamic"
    assert conv.model.layers[0].self_attn.q_proj.recipe.input.scaling == "static"
    assert "dynamic scaling" in caplog.text


def test_delayed_scaling_keeps_one_history_per_expert() -> None:
    """``delayed``: each expert records its own amax (its tokens' for the input, its
    matrix's for the weight; 0 for an expert without tokens) in training mode only; the
    histories are float32 buffers a plain checkpoint need not hold."""
    m = _model("mixtral")
    ex = Float8Experts(m.model.layers[0].mlp.experts, "delayed")
    hist = ex.gate_up_proj_input_amax_history
    assert hist.shape == (16, 4) and len(ex.scaling_buffers()) == 6
    x = torch.randn(6, 32)
    idx = torch.tensor([[0, 1], [1, 3], [3, 0], [0, 1], [1, 0], [3, 1]])  # expert 2: none
    ex(x, idx, torch.rand(6, 2)).sum().backward()
    want = torch.stack(
        [
            x[(idx == e).any(1)].abs().amax() if (idx == e).any() else torch.tensor(0.0)
            for e in range(4)
        ]
    )
    assert torch.equal(hist[0], want)
    assert torch.equal(
        ex.gate_up_proj_weight_amax_history[0], ex.gate_up_proj.detach().abs().amax((1, 2))
    )
    go = ex.down_proj_grad_output_amax_history[0]
    assert bool((go[[0, 1, 3]] > 0).all()) and float(go[2]) == 0.0
    ex.eval()
    ex(x, idx, torch.rand(6, 2))
    assert torch.equal(hist[1], torch.zeros(4))  # evaluation records nothing
    plain_sd = m.model.layers[0].mlp.experts.state_dict()
    ex.load_state_dict(plain_sd)  # strict: the histories are not required
    assert set(ex.state_dict()) - set(plain_sd) == set(ex.scaling_buffers())
    ex.to(torch.bfloat16)
    assert hist.dtype == torch.float32 and ex.gate_up_proj_input_amax_history.dtype == torch.float32
    with pytest.raises(ValueError, match="finite"):
        ex.load_state_dict({**plain_sd, "down_proj_input_amax_history": torch.full((16, 4), -1.0)})


def test_delayed_model_trains() -> None:
    _, conv = _pair("gpt_oss", "delayed")
    opt = torch.optim.AdamW(conv.parameters(), lr=3e-3)
    ids = _moe.ids(seed=2)
    losses = []
    for _ in range(6):
        loss = conv(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses


def test_generic_detection_of_an_unlisted_experts_class(caplog: Any) -> None:
    """A user's experts class decorated with ``use_experts_implementation`` (transposed
    weights, biases, no gate) converts; a module with 3-D weights but no flags is named
    in the WARNING."""

    class Cfg:
        _experts_implementation = "grouped_mm"

    @moe.use_experts_implementation(is_transposed=True, has_bias=True, has_gate=False)
    class MyExperts(nn.Module):
        def __init__(self, config: Any) -> None:
            super().__init__()
            self.num_experts = 3
            self.up_proj = nn.Parameter(torch.randn(3, 16, 24) * 0.2)
            self.up_proj_bias = nn.Parameter(torch.randn(3, 24) * 0.1)
            self.down_proj = nn.Parameter(torch.randn(3, 24, 16) * 0.2)
            self.down_proj_bias = nn.Parameter(torch.randn(3, 16) * 0.1)
            self.act_fn = nn.GELU()

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 4, 4))

    class Tokens(nn.Module):  # ViT's embeddings: (1, n, d) tables, no expert weights
        def __init__(self) -> None:
            super().__init__()
            self.cls_token = nn.Parameter(torch.randn(1, 1, 4))
            self.position_embeddings = nn.Parameter(torch.randn(1, 5, 4))

    holder = nn.Module()
    holder.experts = MyExperts(Cfg())
    holder.odd = Odd()
    holder.tokens = Tokens()
    x = torch.randn(7, 16)
    idx = torch.tensor([[0, 2], [2, 2], [1, 0], [0, 0], [2, 0], [2, 1], [0, 2]])
    wts = torch.rand(7, 2)
    ref = holder.experts(x, idx, wts)
    with caplog.at_level(logging.WARNING, logger="lowprec.float8.convert"):
        apply(holder, Float8Config.from_name("tensorwise", high_precision_gemms=GEMMS))
    assert isinstance(holder.experts, Float8Experts)
    assert "odd (Odd: 3-D weights, not an experts module)" in caplog.text
    assert "tokens" not in caplog.text  # (it was named as a linear-like layer)
    torch.testing.assert_close(holder.experts(x, idx, wts), ref, rtol=1e-6, atol=1e-6)


class _HandWritten(nn.Module):
    """An experts class without ``use_experts_implementation`` (as Step3p7's): concatenated
    gate/up, a per-expert loop; ``scale`` 2 makes its forward differ from the formula."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(3, 2 * 12, 16) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(3, 16, 12) * 0.2)
        self.act_fn = nn.SiLU()
        self.scale = scale

    def _apply_gate(self, h: Tensor) -> Tensor:
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            tok, pos = torch.where(top_k_index == e)
            h = self._apply_gate(x[tok] @ self.gate_up_proj[e].t())
            y = (h @ self.down_proj[e].t()) * top_k_weights[tok, pos, None] * self.scale
            out.index_add_(0, tok, y)
        return out


def test_hand_written_experts_convert_where_a_probe_agrees(caplog: Any) -> None:
    """Without the decorator's flags, a module with 3-D expert weights converts when its
    own forward equals Float8Experts' on a probe (flags inferred from the shapes); one
    whose forward computes something else stays, named in the WARNING."""
    holder = nn.Module()
    holder.experts, holder.other = _HandWritten(), _HandWritten(scale=2.0)
    assert experts_flags(holder.experts) == (True, False, False)
    assert experts_flags(holder.other) is None
    x, idx, wts = torch.randn(7, 16), torch.randint(0, 3, (7, 2)), torch.rand(7, 2)
    ref = holder.experts(x, idx, wts)
    with caplog.at_level(logging.WARNING, logger="lowprec.float8.convert"):
        apply(holder, "tensorwise")
    assert isinstance(holder.experts, Float8Experts) and type(holder.other) is _HandWritten
    assert "other (_HandWritten: 3-D weights" in caplog.text
    rel = float((holder.experts(x, idx, wts) - ref).norm() / ref.norm())
    assert 0 < rel < 0.25, rel  # the E4M3 bound of the model tests
    flags = (True, False, False)
    with pytest.raises(TypeError, match="experts"):
        Float8Experts(nn.Linear(2, 2), "tensorwise")
    assert Float8Experts(_HandWritten(scale=2.0), "tensorwise", flags=flags).has_gate


def test_bad_input_and_config_round_trip() -> None:
    c = Float8Config.from_name("rowwise", fp8_router=True)
    assert Float8Config.from_dict(c.to_dict()) == c
    assert "router=fp8" in c.describe()
    with pytest.raises(TypeError, match="fp8_router"):
        Float8Config(fp8_router=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="experts"):
        Float8Experts(nn.Linear(2, 2))
    m = _model("mixtral")
    ex = m.model.layers[0].mlp.experts
    with pytest.raises(TypeError, match="recipe"):
        Float8Experts(ex, 3)  # type: ignore[arg-type]
    f = Float8Experts(ex, "tensorwise")
    with pytest.raises(ValueError, match="top_k_index"):
        f(torch.randn(3, 32), torch.full((3, 2), 9), torch.rand(3, 2))
    with pytest.raises(TypeError, match="hidden_states"):
        f([1.0], torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="router"):
        Float8Router.from_router(nn.ReLU(), "tensorwise")


def _shrunk(config_cls: type) -> list[Any]:
    """``config_cls()`` and its sub-configs with every size a tiny one (hidden 32,
    intermediate 24, at most 4 experts), grouped_mm experts; [] if it does not build."""
    try:
        cfg = config_cls()
    except Exception:  # a config that needs arguments: skipped
        return []
    subs = [cfg] + [
        v
        for a in dir(cfg)
        if a.endswith("_config")
        and isinstance(v := getattr(cfg, a, None), transformers.PretrainedConfig)
    ]
    for sc in subs:
        for a, v in list(vars(sc).items()):
            if isinstance(v, bool) or not isinstance(v, int):
                continue
            if a in ("hidden_size", "d_model"):
                setattr(sc, a, 32)
            elif "intermediate" in a or "ffn_dim" in a:
                setattr(sc, a, 24)
            elif "expert" in a and "per_tok" not in a and "top" not in a and v > 4:
                setattr(sc, a, 4)
        sc._experts_implementation = "grouped_mm"
    return subs


@pytest.mark.slow
def test_every_experts_class_of_the_installed_transformers_converts() -> None:
    """Models we do not list: every ``…Experts`` class of the installed transformers (the
    ``use_experts_implementation`` ones, and hand-written ones such as Step3p7's) that
    builds from its (shrunk) default config is detected, computes with
    high-precision GEMMs what its grouped_mm implementation computes (1e-6 relative), and
    with tensorwise GEMMs within the E4M3 bound of the model tests (0.25 of the norm).
    (65 classes of transformers 5.24 build here; a handful need configs this generic
    shrinking cannot give them.)"""
    import importlib
    import inspect
    import pkgutil

    hp = Float8Config.from_name("tensorwise", high_precision_gemms=GEMMS)
    checked = []
    for info in pkgutil.iter_modules(transformers.models.__path__):
        name = info.name
        try:
            mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            cfg_mod = importlib.import_module(f"transformers.models.{name}.configuration_{name}")
        except Exception:  # optional dependencies of other models
            continue
        experts = [
            c
            for n, c in vars(mod).items()
            if inspect.isclass(c)
            and c.__module__ == mod.__name__
            and n.endswith("Experts")
            and hasattr(c, "_apply_gate")
        ]
        configs = [
            c for n, c in vars(cfg_mod).items() if inspect.isclass(c) and n.endswith("Config")
        ]
        for cls in experts:
            built = None
            for sc in (s for c in configs for s in _shrunk(c)):
                try:
                    torch.manual_seed(0)
                    built = cls(sc)
                    break
                except Exception:  # the wrong sub-config
                    continue
            if built is None:
                continue
            with torch.no_grad():
                for p in built.parameters():
                    p.normal_(0.0, 0.1)
            flags = experts_flags(built)  # hand-written classes too (Step3p7Experts)
            assert flags is not None, cls.__name__
            down = built.down_proj
            e, h = down.shape[0], down.shape[2] if flags[2] else down.shape[1]
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(9, h, generator=gen)
            idx = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(9)])
            w = torch.rand(idx.shape, generator=gen)  # (9, 1) where there is one expert
            ref = built(x, idx, w)
            got = Float8Experts(built, hp)(x, idx, w)
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))
            f8 = Float8Experts(built, "tensorwise")(x, idx, w)
            assert float((f8 - ref).norm() / ref.norm()) < 0.25, cls.__name__
            checked.append(cls.__name__)
    assert len(checked) >= 50, checked


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8-static", "nvfp4-train"])
def test_recipes_prepare_and_train_an_moe_model(recipe: str) -> None:
    """``prepare`` with float8 recipes: the experts convert (``fp8-static``'s calibration of
    the linears runs beside dynamic experts; ``nvfp4-train``'s stochastic rounding and
    Hadamard transforms are the linears'), and a few steps reduce the loss."""
    from lowprec.recipes import prepare

    p = prepare(_model("qwen3_moe"), recipe)
    assert sum(isinstance(m, Float8Experts) for m in p.model.modules()) == 2
    ids, losses = _moe.ids(seed=2), []
    for _ in range(4):
        with p.compute():
            loss = p.model(input_ids=ids, labels=ids).loss
            p.scaler.scale(loss).backward()
        p.scaler.step(p.optimizer)
        p.scaler.update()
        p.optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.slow
def test_compiled_loss_and_gradients_are_eagers() -> None:
    """``torch.compile`` of a converted MoE model: it failed in torch 2.13's fake-tensor
    rule for ``torch._grouped_mm`` (bf16 operands only; the emulation multiplies float32
    values); the grouped GEMMs now run outside the graph. DeepSeek-V3 (one layer, MoE;
    its keys filled in place): loss and every gradient (experts, attention, router,
    embeddings) equal eager's. (Mixtral, checked the same way by hand, too.)"""
    m = apply(_moe.model("deepseek_v3", layers=1), "rowwise")
    assert any(isinstance(x, Float8Experts) for x in m.modules())
    assert_compiled_equals_eager(m, _moe.ids(), 10)


def test_compiled_mxfp8_layer_stays_within_the_recompile_limit() -> None:
    """MXFP8 runs every linear and grouped GEMM outside the graph
    (``core.autograd.apply_outside_graph``). Called through a shared wrapper, Dynamo
    compiled that wrapper's frame once per weight shape of any of them, and one
    DeepSeek-V3 layer hit the recompile limit (a warning; here a failure). Loss and every
    gradient equal eager's."""
    m = apply(_moe.model("deepseek_v3", layers=1), "mxfp8")
    assert any(isinstance(x, Float8Experts) for x in m.modules())
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        assert_compiled_equals_eager(m, _moe.ids(), 10)


def _odd_model(family: str) -> nn.Module:
    """A one-layer model of ``family`` with ``intermediate_size=30`` (not a multiple of 4:
    the experts' rows are not 16-byte multiples), HF's eager experts (its own grouped_mm
    experts refuse the size), 3-D weights drawn as in :func:`tests._moe.model`."""
    c = _moe.config(family, layers=1)
    c.intermediate_size = 30
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(c, experts_implementation="eager")
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 3 or not bool(torch.isfinite(p).all()):
                p.normal_(0.0, 0.05)
    return m


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("config", ["hp", "tensorwise", "mxfp8"])
def test_odd_intermediate_size_trains_against_the_plain_eager_model(
    family: str, config: str
) -> None:
    """``intermediate_size=30``: the converted experts run forward and backward. With all
    three GEMMs in high precision they compute the plain model's function: logits and every
    gradient (experts' weights and, for GPT-OSS, biases) equal to float32 rounding (the
    grouped GEMM sums the same ≤ 32 products per output in another order: 1e-5 relative).
    In float8, the logits and the experts' gradients are within 0.25 of the plain model's
    in relative norm: E4M3 errs by ~2⁻⁴ of a GEMM's norm, and the few GEMMs in series of
    one layer (attention, experts, head, forward or backward) add up to well under 0.25
    (measured ≤ 0.09)."""
    plain, conv = _odd_model(family), _odd_model(family)
    conv.load_state_dict(plain.state_dict())
    hp = Float8Config.from_name("tensorwise", high_precision_gemms=GEMMS)
    conv = apply(
        conv, hp if config == "hp" else config, module_filter=lambda m, fqn: fqn.endswith("experts")
    )
    assert any(isinstance(m, Float8Experts) for m in conv.modules())
    ids = _moe.ids()
    a, b = plain(input_ids=ids, labels=ids), conv(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    pg = dict(plain.named_parameters())
    expert_params = [n for n, p in conv.named_parameters() if ".experts." in n]
    assert expert_params
    if config == "hp":
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)
        for n, p in conv.named_parameters():
            if pg[n].grad is not None:
                torch.testing.assert_close(p.grad, pg[n].grad, rtol=1e-5, atol=1e-7)
        return
    rel = float((b.logits - a.logits).norm() / a.logits.norm())
    assert rel < 0.25, rel
    for n in expert_params:
        got, want = dict(conv.named_parameters())[n].grad, pg[n].grad
        assert got is not None and want is not None, n
        rel = float((got - want).norm() / want.norm())
        assert rel < 0.25, (n, rel)


def test_experts_refuse_inputs_by_name() -> None:
    """A new user's trial: routing weights wider than the ids, ``(T, 3)`` against ``(T,
    2)``, were accepted and paired tokens with other tokens' weights (0.42 relative from
    HF's eager experts); other bad inputs raised IndexError/RuntimeError from inside."""
    experts = _moe.model("mixtral", layers=1).model.layers[0].mlp.experts
    m = Float8Experts(experts, "tensorwise")
    x, idx = torch.randn(6, 32), torch.randint(0, 4, (6, 2))
    p = torch.rand(6, 2)
    assert m(x, idx, p).shape == (6, 32)
    bad: list[tuple[tuple[object, ...], type[Exception], str]] = [
        ((x, idx, torch.rand(6, 3)), ValueError, "top_k_weights"),
        ((x, idx, torch.rand(6, 1)), ValueError, "top_k_weights"),
        ((x, idx, [[0.5, 0.5]] * 6), TypeError, "top_k_weights"),
        ((x, idx, p.long()), ValueError, "top_k_weights"),
        ((x[None], idx, p), ValueError, "hidden_states"),
        ((torch.randn(6, 31), idx, p), ValueError, "hidden_states"),
        ((x, idx.float(), p), ValueError, "top_k_index"),
        ((x, idx[:5], p[:5]), ValueError, "top_k_index"),
        ((x, idx + 4, p), ValueError, "top_k_index"),
    ]
    for args, exc, name in bad:
        with pytest.raises(exc, match=name):
            m(*args)


def test_experts_say_when_emulate_false_cannot_be_honoured(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``emulate=False`` on a machine without the grouped FP8 GEMM (here: no CUDA) was
    accepted and emulated silently for experts; linears already said so."""
    from lowprec.core.warn import _WARNED

    _WARNED.discard("float8:grouped-hw-missing")
    experts = _moe.model("mixtral", layers=1).model.layers[0].mlp.experts
    m = Float8Experts(experts, Float8Config.from_name("tensorwise", emulate=False))
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        m(torch.randn(6, 32), torch.randint(0, 4, (6, 2)), torch.rand(6, 2))
    assert "emulate=False but the hardware grouped FP8 GEMM does not apply" in caplog.text
