"""The unit technique's entry point and its contracts (issue 29): the reference model is
fully handled (no WARNING, every add unit-scaled), a model's residual analysis waits for
its first call when it has no usable example inputs, every input reaches the model's own
``forward``, ``reinit`` is a default and not a required keyword, and a ``UnitConfig`` never
silently overrides a keyword."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lowprec.jobs.demo import DEMO_CONFIG
from lowprec.jobs.model import CharGPT, ModelConfig, build_model
from lowprec.recipes import prepare
from lowprec.recipes.step import train_step
from lowprec.unit import PRESETS, UnitConfig, apply, unit_scale

CFG = ModelConfig(vocab_size=65, width=32, depth=2, heads=2, seq_len=16)


def _idx(b: int = 4, t: int = 16, seed: int = 1) -> Tensor:
    return torch.randint(0, 65, (b, t), generator=torch.Generator().manual_seed(seed))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("recipe", ["fp32-unit", "fp8-unit"])
def test_demo_unit_recipes_warn_nothing(recipe: str, caplog: pytest.LogCaptureFixture) -> None:
    """``lowprec demo``'s unit recipes on its own model (the demo's shape, built and
    prepared as the demo's training job does): not one WARNING at transform time nor
    during a training step, every residual add weighted by τ (two per block) and the
    root's token + position embedding sum a unit add. Before issue 29 the transform
    warned that CharGPT's root and attention modules kept plain adds."""
    caplog.set_level(logging.WARNING)
    torch.manual_seed(0)
    cfg = ModelConfig(width=DEMO_CONFIG.width, depth=DEMO_CONFIG.depth,
                      heads=DEMO_CONFIG.heads, seq_len=DEMO_CONFIG.seq_len)  # fmt: skip
    run = prepare(build_model("reference", cfg), recipe, lambda ps: torch.optim.AdamW(ps, 3e-3))
    report = run.model.unit_report
    assert report["unsupported"] == []
    assert len(report["residual_adds"]) == 2 * cfg.depth
    assert report["unit_adds"] == ["<root>: add #0 (embed_sum)"]
    idx = _idx(2, 32)
    r = train_step(run, idx, idx)
    assert torch.isfinite(r.loss)
    assert _warnings(caplog) == []


def test_chargpt_embedding_sum_is_unit(caplog: pytest.LogCaptureFixture) -> None:
    """The root's ``tok(idx) + pos(t)``, two unit-variance lookups, leaves the root with
    unit variance: the sum's std is 1 (√2 as a plain add). 64·16·32 = 32768 values: the
    std estimate's own sd is ~0.4%, the tolerance 5%."""
    caplog.set_level(logging.WARNING)
    torch.manual_seed(0)
    u = unit_scale(CharGPT(ModelConfig(vocab_size=65, width=32, depth=1, heads=2, seq_len=16)))
    seen: list[Tensor] = []
    u.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    u(_idx(64, 16))
    assert abs(float(seen[0].std()) - 1.0) < 0.05, float(seen[0].std())
    assert _warnings(caplog) == []


class _NoDummy(CharGPT):
    """CharGPT without its example inputs: a user's model like it (a ``raise`` on the
    sequence length and a mask sliced by it, so ``torch.fx`` cannot trace the root or the
    attention)."""

    dummy_inputs = None


def _grads(u: nn.Module, idx: Tensor) -> tuple[Tensor, list[Tensor]]:
    u.zero_grad(set_to_none=True)
    loss = u(idx, idx)[1]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in u.parameters() if p.grad is not None]


def test_analysis_waits_for_the_first_call(caplog: pytest.LogCaptureFixture) -> None:
    """With no example inputs the analysis by running happens on the first call, on its
    inputs: the report is ``pending`` until then, no WARNING, and the model then equals,
    bit for bit (same init: same seed), one analysed at transform time on the same
    inputs, on the first and later calls."""
    caplog.set_level(logging.WARNING)
    torch.manual_seed(0)
    base = _NoDummy(CFG)
    idx = _idx()
    torch.manual_seed(1)
    ref = unit_scale(base, example_inputs=(idx,))
    torch.manual_seed(1)
    lazy = unit_scale(base)
    assert lazy.unit_report["analysed_by_running"] == "pending"
    assert lazy.unit_report["unit_adds"] == []
    l_ref, g_ref = _grads(ref, idx)
    for _ in range(2):  # the first call (analysis, then the forward) and a later one
        loss, grads = _grads(lazy, idx)
        assert torch.equal(loss, l_ref)
        assert len(grads) == len(g_ref) and all(
            torch.equal(a, b) for a, b in zip(grads, g_ref, strict=True)
        )
    assert lazy.unit_report == ref.unit_report
    assert lazy.unit_report["unit_adds"] == ["<root>: add #0 (embed_sum)"]
    assert _warnings(caplog) == []


class _Signature(nn.Module):
    """A forward with every kind of parameter, returning what it received; fx traces it
    (and generates a forward with another signature: ``(a, b, c, d, *args, **kw)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(
        self, a: Tensor, /, b: Tensor, *args: Any, c: Tensor | None = None, d: float = 2.0,
        **kw: Any,
    ) -> tuple[Any, ...]:  # fmt: skip
        h = self.fc(a) + a  # a residual add
        return h, a, b, args, c, d, kw


class _Untraceable(_Signature):
    """The same, with a check fx cannot trace: analysed by running."""

    def forward(
        self, a: Tensor, /, b: Tensor, *args: Any, c: Tensor | None = None, d: float = 2.0,
        **kw: Any,
    ) -> tuple[Any, ...]:  # fmt: skip
        if a.shape[0] > 100:
            raise ValueError("a: too many rows")
        return super().forward(a, b, *args, c=c, d=d, **kw)


class _Parent(nn.Module):
    """A ``_Signature`` as a child (fx-rewritten there), called in every form by its parent
    (which fx cannot trace: the child's outputs are returned as they are)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = _Signature()

    def forward(self, *args: Any, **kw: Any) -> tuple[Any, ...]:
        if args[0].shape[0] > 100:
            raise ValueError("too many rows")
        return self.child(*args, **kw)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["fx root", "fx child", "run: example", "run: first call"])
def test_every_input_reaches_forward(kind: str) -> None:
    """Positional-only, positional-or-keyword, ``*args``, keyword-only, defaults and
    ``**kwargs`` all reach the model's own forward unchanged (the same objects): through
    an fx-rewritten root or child (whose generated forward has another signature: before
    issue 29 ``u(a, b, e, c=c)`` raised "multiple values for argument 'c'"), and through a
    model analysed by running, on example inputs or on its first call."""
    torch.manual_seed(0)
    a, b, c, e, f = (torch.randn(2, 4) for _ in range(5))
    build = {"fx root": _Signature, "fx child": _Parent}.get(kind, _Untraceable)
    u = unit_scale(build(), example_inputs=(a, b, e) if kind == "run: example" else None)
    ran = u.unit_report["analysed_by_running"]
    assert ran == {"fx root": False, "run: example": True}.get(kind, "pending")
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((a, b, e, f), {"c": c, "extra": f}),
        ((a,), {"b": b, "c": c, "d": 3.0}),
        ((a, b), {"c": c}),
        ((a, b), {}),
    ]
    for args, kw in calls:
        h, ga, gb, gargs, gc, gd, gkw = u(*args, **kw)
        assert ga is a and gb is b and gc is kw.get("c")
        assert len(gargs) == max(0, len(args) - 2) and all(
            x is y for x, y in zip(gargs, args[2:], strict=True)
        )
        assert gd == kw.get("d", 2.0)
        assert gkw.keys() == {k for k in kw if k not in ("b", "c", "d")}
        assert h.shape == (2, 4) and bool(torch.isfinite(h).all())
    assert len(u.unit_report["residual_adds"]) == 1, u.unit_report


def test_fx_root_and_run_analysis_compute_the_same() -> None:
    """The same model rewritten by fx (root: a ``GraphModule``, its τ 0.2, not the 0.5 it
    was traced with, so recompiled after the unit class swap) and analysed by running give
    the same output
    bit for bit: the fx root keeps the unit mode (a lost mode gives the plain linear,
    ×√fan_in = ×2 off) and its τ."""
    torch.manual_seed(0)
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    outs = []
    for cls in (_Signature, _Untraceable):
        torch.manual_seed(1)
        u = unit_scale(cls(), residual=[0.2], example_inputs=(a, b))
        outs.append((u(a, b)[0], u.unit_report["residual_adds"][0].split()[-1]))
    assert outs[0][1] == outs[1][1] == "(tau=0.2)"
    assert torch.equal(outs[0][0], outs[1][0])


def test_reinit_is_the_default_and_keep_is_named() -> None:
    """``unit_scale(model)`` re-initialises (unit-variance weights: a 64×64 N(0, 1)
    weight's std within 5% of 1, its sd ~0.9%; torch's init gives 0.07); ``reinit=False``
    keeps every weight; ``apply`` has the same default."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    for u in (unit_scale(m), apply(m), apply(m, reinit=True)):
        assert abs(float(u[0].weight.detach().std()) - 1.0) < 0.05
        assert u.unit_report["reinit"] is True
    kept = unit_scale(m, reinit=False)
    assert kept.unit_report["reinit"] is False
    assert all(torch.equal(p, q) for p, q in zip(kept.parameters(), m.parameters(), strict=True))


@pytest.mark.parametrize(
    ("kw", "named"),
    [({"float8": True}, "float8"), ({"strict": False}, "strict"),
     ({"float8": False, "strict": True}, "float8, strict")],
)  # fmt: skip
def test_config_and_keywords_are_not_both_taken(kw: dict[str, bool], named: str) -> None:
    """A config never silently overrides a keyword: both is a ValueError naming the
    keywords, even where they agree with the config."""
    with pytest.raises(ValueError, match=f"^{named}: set in the UnitConfig"):
        unit_scale(nn.Linear(4, 4), config=UnitConfig(), **kw)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float8 must be a bool"):
        unit_scale(nn.Linear(4, 4), float8=1)  # type: ignore[arg-type]
    assert unit_scale(nn.Linear(4, 4), float8=True)._unit_config == UnitConfig(float8=True)


def test_apply_takes_a_config_or_a_preset() -> None:
    """``apply(model, config_or_preset)``: a preset name builds its UnitConfig; an unknown
    name lists the valid ones; apply takes no technique keyword besides its config."""
    assert list(PRESETS) == ["default", "float8", "float8-readout"]
    m = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    for name in PRESETS:
        assert apply(m, name)._unit_config == PRESETS.get(name)
    assert apply(m, "float8")._unit_config == UnitConfig(float8=True)
    assert apply(m)._unit_config == UnitConfig()
    with pytest.raises(ValueError, match="unknown unit preset 'fp8'; valid: default, float8"):
        apply(m, "fp8")
    with pytest.raises(TypeError, match="unexpected keyword argument 'float8'"):
        apply(m, UnitConfig(), float8=True)  # type: ignore[call-arg]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(self.ln(x))  # type: ignore[no-any-return]


class _TokPos(nn.Module):
    """Token + position embeddings, then a pre-norm residual block: fx traces it."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(65, 32), nn.Embedding(16, 32)
        self.block, self.head = _Block(), nn.Linear(32, 65)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.block(x))  # type: ignore[no-any-return]


class _TokPosUntraceable(_TokPos):
    def forward(self, idx: Tensor) -> Tensor:
        if idx.shape[1] > 16:
            raise ValueError("idx: too long")
        return super().forward(idx)


def test_embedding_sum_is_unit_with_fx_too() -> None:
    """An embedding sum in a module fx traces is the same weighted unit add as one found
    by running the model: the same report entry kind and, for the same weights, the same
    output bit for bit; the sum's std is 1 (8·16·32 = 4096 values: the estimate's sd is
    ~1.1%, tolerance 6%; √2 as a plain add)."""
    idx = _idx(8, 16)
    outs, stds = [], []
    seen: list[Tensor] = []
    for cls in (_TokPos, _TokPosUntraceable):
        torch.manual_seed(1)
        u = unit_scale(cls(), example_inputs=(idx,))
        kind = "fx" if u.unit_report["analysed_by_running"] is False else "run"
        assert [a.rsplit(" ", 1)[1] for a in u.unit_report["unit_adds"]] == ["(embed_sum)"], kind
        seen.clear()
        h = u.block.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
        outs.append(u(idx).detach())
        h.remove()
        stds.append(float(seen[0].std()))
    assert torch.equal(outs[0], outs[1])
    assert all(abs(s - 1.0) < 0.06 for s in stds), stds


def test_unit_scale_names_a_bad_residual_scheme() -> None:
    """``residual`` is checked by ``unit_scale`` itself: a bad scheme name or type is an
    error naming ``residual`` (it was residual_taus' 'scheme must be one of ...')."""
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"residual must be one of \['fixed'"):
        unit_scale(model, residual="")
    with pytest.raises(TypeError, match="residual must be a scheme name"):
        unit_scale(model, residual=3)  # type: ignore[arg-type]
