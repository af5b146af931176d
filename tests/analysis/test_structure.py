"""lowprec.analysis.structure: what a transformers 5 experts module holds (the one
definition that lowprec.unit and lowprec.float8 both use)."""

from __future__ import annotations

import torch
from torch import nn

from lowprec.analysis.structure import (
    expert_weight_names,
    holds_experts,
    stated_flags,
    weight_names,
)


class _Experts(nn.Module):
    def __init__(self, has_gate: bool = True, has_bias: bool = False) -> None:
        super().__init__()
        self.has_gate, self.has_bias, self.is_transposed = has_gate, has_bias, False
        up = "gate_up_proj" if has_gate else "up_proj"
        setattr(self, up, nn.Parameter(torch.zeros(4, 6 if has_gate else 3, 5)))
        self.down_proj = nn.Parameter(torch.zeros(4, 5, 3))
        if has_bias:
            setattr(self, up + "_bias", nn.Parameter(torch.zeros(4, 6 if has_gate else 3)))
            self.down_proj_bias = nn.Parameter(torch.zeros(4, 5))
        self.act_fn = nn.SiLU()

    def _apply_gate(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_names_and_stated_flags() -> None:
    assert expert_weight_names(True) == ("gate_up_proj", "down_proj")
    assert expert_weight_names(False) == ("up_proj", "down_proj")
    assert weight_names(_Experts(has_gate=False)) == ("up_proj", "down_proj")
    assert stated_flags(_Experts(has_bias=True)) == (True, True, False)
    m = _Experts()
    m.is_transposed = 1  # type: ignore[assignment]  # not a bool: not stated
    assert stated_flags(m) is None
    assert stated_flags(nn.Linear(2, 2)) is None


def test_holds_experts_checks_what_the_flags_name() -> None:
    for gate in (True, False):
        for bias in (True, False):
            m = _Experts(gate, bias)
            assert holds_experts(m, (gate, bias, False))
    m = _Experts(True, False)
    assert not holds_experts(m, (True, True, False))  # biases named, none held
    assert not holds_experts(m, (False, False, False))  # up_proj named, gate_up_proj held
    m.down_proj = nn.Parameter(torch.zeros(4, 5))  # 2-D: not an expert weight
    assert not holds_experts(m, (True, False, False))
    m = _Experts(True, False)
    m.down_proj = nn.Parameter(
        torch.zeros(4, 5, 3, dtype=torch.float64).long(), requires_grad=False
    )
    assert not holds_experts(m, (True, False, False))  # not floating point
    m = _Experts(False, False)
    del m.act_fn
    assert not holds_experts(m, (False, False, False))  # no activation to apply
