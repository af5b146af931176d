"""Unit scaling and u-μP on HF transformers MoE models (``lowprec.unit.moe``).

Tiny random configs of each family (``tests/_moe.py``, no download). The experts'
and router's maths is checked against the plain HF modules holding the *effective*
weights of the unit model (``W/√fan_in`` for the experts, ``W/H`` for the router), in
float64, where the module doc's factors make the two exactly equal.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("transformers")

from lowprec.unit import UnitConfig, apply, umup_param_groups
from lowprec.unit.mode import UnitMode, plain_ops
from lowprec.unit.moe import convert_moe, is_experts, routing_moment, share_token_counts
from tests import _moe
from tests._helpers import assert_compiled_equals_eager, world_of_one


def _blocks(m: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    """``(block, router, experts)`` of each MoE layer of ``m``."""
    out = []
    for blk in m.modules():
        ex = getattr(blk, "experts", None)
        r = getattr(blk, "gate", None) or getattr(blk, "router", None)
        if ex is not None and r is not None and ex.__class__.__name__.endswith("Experts"):
            out.append((blk, r, ex))
    return out


@pytest.mark.parametrize("family", _moe.FAMILIES)
def test_conversion_runs_and_names_experts_and_routers(family: str) -> None:
    u = apply(_moe.model(family), "default")
    conv = u.unit_report["converted_modules"]
    blocks = _blocks(u)
    assert blocks
    assert sum(": experts, rho=" in c for c in conv) == len(blocks)
    assert sum(": router)" in c for c in conv) == len(blocks)
    assert not [x for x in u.unit_report["unsupported"] if "xpert" in x or "outer" in x]
    out = u(_moe.ids(), labels=_moe.ids())
    out.loss.backward()
    for _, r, ex in blocks:
        assert all(torch.isfinite(p.grad).all() for p in ex.parameters(recurse=False))
        assert torch.isfinite(r.weight.grad).all() and r.weight.grad.abs().sum() > 0


def test_unit_reinit_and_state_dict_keys_unchanged() -> None:
    plain = _moe.model("qwen3_moe")
    u = apply(plain)
    assert list(u.state_dict()) == list(plain.state_dict())
    for _, r, ex in _blocks(u):
        w = ex.gate_up_proj
        w_std, r_std = float(w.detach().std()), float(r.weight.detach().std())
        assert abs(w_std - 1.0) < 0.1 and abs(r_std - 1.0) < 0.25  # 6144 and 128 draws
    again = apply(plain, reinit=False)  # weights kept: the plain model's N(0, 0.05²)
    assert torch.equal(again.model.layers[0].mlp.experts.gate_up_proj,
                       plain.model.layers[0].mlp.experts.gate_up_proj)  # fmt: skip


# ---- the experts' maths against the plain module with effective weights -----------------


def _reference(ex_plain: nn.Module, ex_unit: Any, gain: float = 1.0) -> nn.Module:
    """A float64 copy of the plain experts module holding the unit module's effective
    weights (``W/√fan_in``; a custom gate's gain folded into the down projection)."""
    ref = copy.deepcopy(ex_plain).double()
    ref.config._experts_implementation = "eager"
    up, down = ("gate_up_proj" if ex_unit.has_gate else "up_proj"), "down_proj"
    with torch.no_grad():
        for name, g in ((up, 1.0), (down, gain)):
            w = getattr(ex_unit, name).detach().double()
            fan_in = w.shape[-2] if ex_unit.is_transposed else w.shape[-1]
            getattr(ref, name).copy_(w * g / math.sqrt(fan_in))
            if ex_unit.has_bias:
                getattr(ref, name + "_bias").copy_(getattr(ex_unit, name + "_bias").double())
    return ref


def _routing(
    t: int, k: int, n_exp: int, seed: int, skip: int | None = None
) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    experts = [e for e in range(n_exp) if e != skip]
    idx = torch.stack([torch.tensor(experts)[torch.randperm(len(experts), generator=g)[:k]]
                       for _ in range(t)])  # fmt: skip
    w = torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1
    return idx, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("skip", [None, 1])
def test_experts_forward_and_gradients_match_plain_maths(family: str, skip: int | None) -> None:
    """Forward = the plain experts on effective weights × α; ∂x exact; ∂p × 1/(α√H);
    ∂W_e and ∂b_e × √(k/n_e); an expert that receives no token (``skip``): ∂W_e = 0."""
    plain = _moe.model(family, layers=1)
    u = apply(plain).double()
    (_, _, ex), (_, _, ex_plain) = _blocks(u)[0], _blocks(plain)[0]
    gain = float(ex.__dict__.get("_unit_gate_gain", 1.0))
    assert (gain != 1.0) == (family == "gpt_oss")  # GPT-OSS's clamped SwiGLU: measured gain
    ref = _reference(ex_plain, ex, gain)
    n_exp, h = ex.down_proj.shape[0], u.config.hidden_size
    t, k = 24, 2
    idx, w = _routing(t, k, n_exp, seed=3, skip=skip)
    x = torch.randn(t, h, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ws = [w.clone().requires_grad_(True) for _ in range(2)]
    y_unit = ex(xs[0], idx, ws[0])  # (outside the unit mode: the plain SiLU, as ref)
    y_ref = ref(xs[1], idx, ws[1])
    alpha = ex.__dict__["_unit_rho"] ** -0.5
    torch.testing.assert_close(y_unit, alpha * y_ref, rtol=1e-10, atol=1e-10)
    g = torch.randn(t, h, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y_unit.backward(g)
    (alpha * y_ref).backward(g)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ws[0].grad, ws[1].grad / (alpha * math.sqrt(h)), rtol=1e-10,
                               atol=1e-12)  # fmt: skip
    counts = torch.bincount(idx.reshape(-1), minlength=n_exp).double()
    factor = (k / counts.clamp(min=1)).sqrt()
    for name, p in ex.named_parameters(recurse=False):
        want = getattr(ref, name).grad * factor.view(-1, *[1] * (p.dim() - 1))
        if name == "down_proj" and gain != 1.0:  # ref's effective weight carries the gain
            want = want * gain
        torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-12)
        if skip is not None:
            assert float(p.grad[skip].abs().max()) == 0.0


def test_combination_factor_is_the_expected_sum_of_squared_weights() -> None:
    """α = 1/√ρ: ρ is E[Σ_j p_j²] of the router at unit init (flat: 1/k renormalised,
    k/E² not), and the experts' output has unit RMS for unit inputs."""
    for family, renorm in (("mixtral", True), ("qwen3_moe", False)):
        u = apply(_moe.model(family, layers=1))
        _, r, ex = _blocks(u)[0]
        rho, k, n = ex.__dict__["_unit_rho"], 2, 4
        lo, hi = (1 / k, 1.0) if renorm else (k / n**2, 1.0 / k)
        assert lo <= rho <= hi
        x = torch.randn(4096, u.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), UnitMode(u._unit_config):
            _, p, i = r(x)
            y = ex(x, i, p)
        assert abs(float(p.double().square().sum(-1).mean()) - rho) < 0.02  # same weights law
        assert abs(float(y.pow(2).mean().sqrt()) - 1.0) < 0.1  # RMS of 4096·32 entries


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_the_moe_factors_give_unit_output_and_gradients(family: str) -> None:
    """What α, √k and 1/(α√H) set, on 8192 unit-normal tokens with a unit-normal output
    gradient (width 64): the experts' output, the routing weights' gradient and the down
    projection's weight gradient (its input, the gate's output, is unit) have RMS within
    0.1 of 1 (measured 0.96-1.07). (∂x and the up projection's gradient carry the dense
    rules' own factors, as a dense MLP's do: measured 1.2-1.8.)"""
    u = apply(_moe.model(family, hidden=64))
    _, r, ex = _blocks(u)[0]
    x = torch.randn(8192, 64, generator=torch.Generator().manual_seed(0))
    with UnitMode(u._unit_config):
        _, p, i = r(x)
        p = p.detach().requires_grad_(True)
        y = ex(x, i, p)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    for v in (y.detach(), p.grad, ex.down_proj.grad):
        assert abs(float(v.pow(2).mean().sqrt()) - 1.0) < 0.1


@pytest.mark.parametrize(("family", "factor"), [("deepseek_v3", 2**-0.5), ("qwen2_moe", 0.8793)])
def test_a_shared_expert_sum_is_a_unit_add(family: str, factor: float) -> None:
    """Routed + shared expert: output ×1/√(1 + v_s), forward only (DeepSeek-V3: v_s = 1;
    Qwen2-MoE: the σ-gated shared expert, v_s = E[σ(Z)²] = 0.2933), so the block's output
    has unit RMS (measured on 4096 unit-normal tokens: within 0.1) and the gradient into
    each branch is the plain one."""
    u = apply(_moe.model(family))
    blk = _blocks(u)[0][0]
    assert any(f"shared expert: output /{1 / factor:.4g}" in c
               for c in u.unit_report["converted_modules"])  # fmt: skip
    hook = next(iter(blk._forward_hooks.values()))
    assert hook.factor == pytest.approx(factor, abs=1e-4)
    x = torch.randn(1, 4096, u.config.hidden_size, generator=torch.Generator().manual_seed(0))
    xs = x.clone().requires_grad_(True)
    with UnitMode(u._unit_config):
        y = blk(xs)
        y.backward(torch.ones_like(y))
    assert abs(float(y.detach().pow(2).mean().sqrt()) - 1.0) < 0.1
    g_hooked = xs.grad.clone()
    xs.grad = None
    with UnitMode(u._unit_config):
        blk._forward_hooks.clear()
        blk(xs).backward(torch.ones_like(y))
    torch.testing.assert_close(g_hooked, xs.grad)  # forward only: the same gradients


def test_routing_moment_arguments() -> None:
    _, r, _ = _blocks(apply(_moe.model("mixtral", layers=1)))[0]
    before = r.weight.detach().clone()
    a = routing_moment(r)
    b = routing_moment(r, samples=2048, seed=7)
    assert a != b and abs(a - b) < 0.02  # another draw of the same expectation
    assert torch.equal(r.weight, before)  # the router's weight restored
    with pytest.raises(ValueError, match="samples"):
        routing_moment(r, samples=0)
    with pytest.raises(TypeError, match="router"):
        routing_moment(nn.Linear(4, 4))


# ---- routing and the load-balancing loss -------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_routing_is_the_plain_routers_on_the_same_hidden_states(family: str) -> None:
    """Each router's (logits, weights, indices) in the unit model are what the plain router
    computes with weight ``W/H`` from the hidden states the unit router received."""
    plain = _moe.model(family)
    u = apply(plain)
    seen: list[tuple[nn.Module, Tensor, Any]] = []
    hooks = [r.register_forward_hook(lambda m, a, o: seen.append((m, a[0], o)))
             for _, r, _ in _blocks(u)]  # fmt: skip
    u(_moe.ids())
    for hk in hooks:
        hk.remove()
    plain_routers = {
        id(ru): rp for (_, ru, _), (_, rp, _) in zip(_blocks(u), _blocks(plain), strict=True)
    }
    assert len(seen) == len(plain_routers)
    for r, x, (logits, p, i) in seen:
        ref = copy.deepcopy(plain_routers[id(r)])
        with torch.no_grad():
            ref.weight.copy_(r.weight / r.weight.shape[1])
            if getattr(ref, "bias", None) is not None:
                ref.bias.copy_(r.bias)
            rl, rp, ri = ref(x)
        torch.testing.assert_close(logits, rl, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p, rp, rtol=1e-5, atol=1e-6)
        assert torch.equal(i, ri)


def test_router_gradient_is_the_plain_one_scaled() -> None:
    """In a Qwen3-MoE block: ∂W_router = ∂W_eff(plain)/(α√H·√T) (readout backward 1/√T,
    routing weights' gradient 1/(α√H))."""
    plain = _moe.model("qwen3_moe", layers=1)
    u = apply(plain).double()
    (blk, r, ex), (blk_p, _, _) = _blocks(u)[0], _blocks(plain)[0]
    ref = copy.deepcopy(blk_p).double()
    ref.experts = _reference(_blocks(plain)[0][2], ex)
    h = u.config.hidden_size
    with torch.no_grad():
        ref.gate.weight.copy_(r.weight / h)
    x = torch.randn(1, 40, h, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    alpha = ex.__dict__["_unit_rho"] ** -0.5
    y, y_ref = blk(x), ref(x) * alpha
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    want = ref.gate.weight.grad / (alpha * math.sqrt(h) * math.sqrt(40))
    # Qwen3's router takes its softmax in float32 (dtype=torch.float) in both models: its
    # backward rounds the two differently scaled gradients at 2⁻²⁴, and g − Σ p·g cancels
    # (measured 3e-5 relative at worst): 1e-4, float64 elsewhere.
    torch.testing.assert_close(r.weight.grad, want, rtol=1e-4, atol=1e-9)


def test_load_balancing_loss_is_the_plain_function_of_the_router_logits() -> None:
    import transformers.models.mixtral.modeling_mixtral as mm

    u = apply(_moe.model("mixtral", output_router_logits=True, router_aux_loss_coef=0.1))
    ids = _moe.ids()
    out = u(ids, labels=ids)
    f = getattr(mm.load_balancing_loss_func, "__wrapped__", mm.load_balancing_loss_func)
    want = f(out.router_logits, u.config.num_local_experts, u.config.num_experts_per_tok)
    torch.testing.assert_close(out.aux_loss, want, rtol=1e-6, atol=1e-7)
    with UnitMode(UnitConfig()):  # the unit softmax would change it: why it runs plain
        unit_sm = f(out.router_logits, 4, 2)
    assert abs(float(unit_sm.detach()) - float(want.detach())) > 1e-3
    with UnitMode(UnitConfig()), plain_ops():
        torch.testing.assert_close(f(out.router_logits, 4, 2), want)


# ---- residual stream at init --------------------------------------------------------------

# Measured RMS of the residual stream after each layer (depth 4, width 64, 8×64 tokens,
# seeds 0-2): Qwen3-MoE 1.017-1.143, Mixtral 0.996-1.175 (docs/unit-scaling.md, "MoE").
# It grows with depth: attention averages positions, so the next layer's values correlate
# across positions, which the attention rule (independent values) does not see.
_RMS_TOL = 0.25


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_residual_stream_stays_near_unit_scale_at_init(family: str) -> None:
    """The stream's RMS after each of 4 layers is within ±0.25 of 1: the RMS of 32768
    entries has a sampling error far below that; what remains is the unit rules'
    approximations (independence across positions, finite width), measured at 1.00-1.18
    over seeds 0-2 (docs/unit-scaling.md)."""
    for seed in range(3):
        u = apply(_moe.model(family, layers=4, seed=seed, hidden=64))
        rms: list[float] = []

        def record(m: nn.Module, a: Any, o: Any, rms: list[float] = rms) -> None:
            rms.append(float((o[0] if isinstance(o, tuple) else o).pow(2).mean().sqrt()))

        for layer in u.model.layers:
            layer.register_forward_hook(record)
        with torch.no_grad():
            u(_moe.ids(8, 64, seed=seed))
        assert len(rms) == 4
        assert all(abs(v - 1.0) < _RMS_TOL for v in rms), (family, seed, rms)


# ---- u-μP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_umup_groups_hold_expert_and_router_parameters(family: str) -> None:
    u = apply(_moe.model(family))
    cfg = u.config
    h, i = (
        cfg.hidden_size,
        (cfg.intermediate_size if family == "gpt_oss" else cfg.moe_intermediate_size),
    )
    for depth in (None, 4):
        mult = {
            id(p): g["lr_mult"] for g in umup_param_groups(u, 1.0, depth=depth) for p in g["params"]
        }
        d = 1.0 if depth is None else depth**-0.5
        for _, r, ex in _blocks(u):
            assert mult[id(ex.gate_up_proj)] == pytest.approx(h**-0.5 * d)
            assert mult[id(ex.down_proj)] == pytest.approx(i**-0.5 * d)
            assert mult[id(r.weight)] == 1.0  # the router: output-like, the readout's rule
            if family == "gpt_oss":
                assert mult[id(ex.gate_up_proj_bias)] == pytest.approx(h**-0.5)
                assert mult[id(ex.down_proj_bias)] == pytest.approx(i**-0.5)
                assert mult[id(r.bias)] == pytest.approx(h**-0.5)


# ---- training -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("preset", ["default", "float8"])
def test_a_few_fp16_steps_reduce_the_loss(family: str, preset: str) -> None:
    """FP16 parameters and activations (no loss scaling), u-μP AdamW groups."""
    torch.manual_seed(0)
    u = apply(_moe.model(family), preset).half()
    opt = torch.optim.AdamW(umup_param_groups(u, 2.0**-4), eps=1e-4)
    ids = _moe.ids(4, 16)
    losses = []
    for _ in range(8):
        loss = u(ids, labels=ids).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in u.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_float8_rounds_the_expert_gemms() -> None:
    """With ``float8`` every expert GEMM's operands are E4M3 values: the output differs
    from the unrounded one by about E4M3's unit roundoff (2⁻⁴), not more; the router's
    logits are not rounded."""
    plain = _moe.model("qwen3_moe", layers=1)
    a, b = apply(plain), apply(plain, "float8", reinit=False)
    b.load_state_dict(a.state_dict())
    (_, _, ea), (_, _, eb) = _blocks(a)[0], _blocks(b)[0]
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    idx, w = _routing(32, 2, 4, seed=0)
    with torch.no_grad(), UnitMode(a._unit_config):
        ya = ea(x, idx, w.float())
    with torch.no_grad(), UnitMode(b._unit_config):
        yb = eb(x, idx, w.float())
    rel = float((ya - yb).norm() / ya.norm())
    assert 2.0**-8 < rel < 2.0**-3
    (_, ra, _), (_, rb, _) = _blocks(a)[0], _blocks(b)[0]
    with torch.no_grad(), UnitMode(b._unit_config):
        la = ra(x)[0]
        lb = rb(x)[0]
    assert torch.equal(la, lb)  # the router is not rounded to FP8


# ---- bad input ----------------------------------------------------------------------------


def test_bad_input_names_the_argument() -> None:
    u = apply(_moe.model("qwen3_moe", layers=1))
    _, _, ex = _blocks(u)[0]
    x = torch.randn(3, 32)
    idx = torch.tensor([[0, 1], [2, 3], [1, 4]])
    with pytest.raises(ValueError, match="top_k_index"):
        ex(x, idx, torch.full((3, 2), 0.5))
    with pytest.raises(TypeError, match="hidden_states"):
        ex([1.0], idx, torch.full((3, 2), 0.5))
    ex._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        ex(x, idx.clamp(max=3), torch.full((3, 2), 0.5))


def test_share_token_counts_arguments_and_a_world_of_one() -> None:
    """Without a process group: ``RuntimeError``; a group that is not one: ``TypeError``
    naming ``group``. In a world of one the shared counts are the rank's own: the loss and
    every gradient are bit for bit those of the model that shares nothing (the 2-rank case:
    ``tests/distributed/test_unit_loss.py``)."""
    import torch.distributed as dist

    u = apply(_moe.model("qwen3_moe", layers=1))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="no process group"):
            share_token_counts(u)
    ids = torch.randint(0, _moe.VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(u)
    with world_of_one():
        with pytest.raises(TypeError, match="group must be"):
            share_token_counts(u, group="world")  # type: ignore[arg-type]
        assert share_token_counts(u) == 1
        assert share_token_counts(nn.Linear(2, 2)) == 0
        for m in (u, ref):
            m(input_ids=ids, labels=ids).loss.backward()
    for (n, a), (_, b) in zip(u.named_parameters(), ref.named_parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), n
        assert a.grad is None or torch.equal(a.grad, b.grad), n


def test_experts_without_a_router_are_refused_by_name() -> None:
    m = _moe.model("qwen3_moe", layers=1)
    blk = m.model.layers[0].mlp
    blk.router_elsewhere = blk.gate
    del blk.gate
    assert is_experts(blk.experts)
    with pytest.raises(NotImplementedError, match=r"mlp\.experts .*no router"):
        convert_moe(m, UnitConfig())


# ---- torch.compile --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "family",
    [
        "qwen2_moe",
        "mixtral",
        "deepseek_v3",
    ],
)
def test_compiled_loss_and_gradients_are_eagers(family: str) -> None:
    """``torch.compile`` of a unit MoE model: before, Dynamo's handling of the experts'
    data-dependent graph break inside the layer loop failed with ``arange(...,
    device=torch.Size)`` (the unit mode's ``__torch_function__`` compiled as a frame of
    its own, ``lowprec.core.modes``), and with that fixed computed the experts with the
    unit linear's scale twice (losses off by 0.02-0.05); DeepSeek-V3's attention lost
    its keys' backward scales (``tests/models/test_compiled_functions.py``). The ``eager``
    backend runs the traced ops with eager's kernels in eager's order: loss and every
    gradient equal exactly (inductor's are within float32 rounding, 1e-6 relative)."""
    m = apply(_moe.model(family, layers=1), "default")  # (one layer: each failure showed)
    assert_compiled_equals_eager(m, _moe.ids(), 6)
