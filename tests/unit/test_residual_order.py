"""Residual τ follow the order the model runs its residual adds, in models that mix
modules fx traces with modules only a run can analyse (lowprec.unit.wrapper._call_order).

The schemes give branch ``l`` a τ that depends on ``l`` (running mean ``1/(l+2)``, u-μP's
``w/(1+(l+1)w)``); before, fx's adds took the first τ whatever their place in the model.
The τ checked are the ones the forward uses: the fx graphs' ``residual_add`` arguments and
the analysed modules' plans."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, fx, nn

from lowprec.unit import apply, umup_taus, unit_scale
from lowprec.unit.adds import residual_add

D = 16


class _Traced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(self.ln(x))


class _Untraced(_Traced):
    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 1e30:  # data-dependent control flow: fx cannot trace this module
            raise RuntimeError("unreachable")
        return x + self.fc(self.ln(x))


class _Blocks(nn.Module):
    """Runs ``a`` (untraced), ``b`` (traced), ``c`` (untraced), registered ``c, b, a``:
    neither registration nor discovery order is the order of the run."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.b, self.a = _Untraced(), _Traced(), _Untraced()
        self.head = nn.Linear(D, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.c(self.b(self.a(x))))


class _Root(nn.Module):
    """A traced root whose own residual add runs between two untraced blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.u1, self.ln, self.fc, self.u2 = (
            _Untraced(),
            nn.LayerNorm(D),
            nn.Linear(D, D),
            _Untraced(),
        )
        self.head = nn.Linear(D, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = self.u1(x)
        x = x + self.fc(self.ln(x))
        return self.head(self.u2(x))


def _fx_taus(m: nn.Module) -> dict[str, float]:
    """``{module name: τ}`` of the residual adds in the fx graphs of ``m``."""
    out = {}
    for name, sub in m.named_modules():
        if isinstance(sub, fx.GraphModule):
            for node in sub.graph.nodes:
                if node.op == "call_function" and node.target is residual_add:
                    out[name or "<root>"] = float(node.args[2])
    return out


def _run_taus(m: nn.Module) -> dict[str, float]:
    """``{module name: τ}`` of the residual adds the run analysed (one per module here)."""
    plans = m.__dict__["_unit_runtime"].plans
    return {name: steps[0].tau for name, steps in plans.items() if steps[0].kind == "residual"}


def _x() -> Tensor:
    return torch.randn(8, D, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("lazy", [False, True], ids=["example_inputs", "first_call"])
def test_running_mean_taus_follow_the_run(lazy: bool) -> None:
    torch.manual_seed(0)
    m = unit_scale(_Blocks(), example_inputs=None if lazy else (_x(),))
    if lazy:
        m(_x())
    expect = {"a": 1 / 2, "b": 1 / 3, "c": 1 / 4}  # residual_taus(3): 1/(l+2) in run order
    got = {**_run_taus(m), **_fx_taus(m)}
    assert got == pytest.approx(expect, rel=1e-12)
    assert [r.split(" (tau=")[0] for r in m.unit_report["residual_adds"]] == [
        "a: add #0",
        "b.add",
        "c: add #0",
    ]


def test_a_traced_roots_add_between_untraced_blocks() -> None:
    torch.manual_seed(0)
    m = unit_scale(_Root(), example_inputs=(_x(),))
    taus = umup_taus(3)
    got = {**_run_taus(m), **_fx_taus(m)}
    assert got == pytest.approx({"u1": 1 / 2, "<root>": 1 / 3, "u2": 1 / 4}, rel=1e-12)
    m2 = apply(_Root(), example_inputs=(_x(),))  # u-μP's depth rule
    got2 = {**_run_taus(m2), **_fx_taus(m2)}
    assert got2 == pytest.approx({"u1": taus[0], "<root>": taus[1], "u2": taus[2]}, rel=1e-12)


def test_an_explicit_tau_list_is_taken_in_run_order() -> None:
    torch.manual_seed(0)
    m = unit_scale(_Blocks(), residual=[0.2, 0.4, 0.6], example_inputs=(_x(),))
    got = {**_run_taus(m), **_fx_taus(m)}
    assert got == pytest.approx({"a": 0.2, "b": 0.4, "c": 0.6}, rel=1e-12)


def test_the_forward_uses_the_fx_tau() -> None:
    """Block ``b``'s output is ``√τ·branch + √(1-τ)·x`` with its τ of 1/3 (running mean,
    second in the run), ``branch`` being what its ``fc`` returned, in FP64."""
    torch.manual_seed(0)
    m = unit_scale(_Blocks(), example_inputs=(_x(),)).double()
    seen: dict[str, tuple[Tensor, Tensor]] = {}
    for name in ("b", "b.fc"):
        m.get_submodule(name).register_forward_hook(
            lambda mod, args, out, name=name: seen.update({name: (args[0], out)}) or None
        )
    with torch.no_grad():
        m(_x().double())
    (x, y), branch, t = seen["b"], seen["b.fc"][1], 1 / 3
    torch.testing.assert_close(y, t**0.5 * branch + (1 - t) ** 0.5 * x, rtol=1e-12, atol=1e-12)
