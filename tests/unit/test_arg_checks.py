"""Arguments that unit scaling accepted and ignored, or took for another value (found by a
new user's trial): each is now refused with the argument named, and the accepted values
still work."""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.unit import functional as U
from lowprec.unit import nn as unn
from lowprec.unit import umup_param_groups, umup_taus, unit_scale


def test_residual_taus_refuses_arguments_of_another_scheme() -> None:
    with pytest.raises(ValueError, match=r"tau=0\.9 applies only to scheme='fixed'"):
        U.residual_taus(3, "running-mean", tau=0.9)
    with pytest.raises(ValueError, match="weight=2 applies only to scheme='weighted'"):
        U.residual_taus(3, "fixed", weight=2)
    assert U.residual_taus(2, "fixed", tau=0.3) == [0.3, 0.3]
    assert U.residual_taus(2, "weighted", weight=1.0) == [0.5, 1 / 3]


def test_umup_numbers_are_checked() -> None:
    torch.manual_seed(0)
    model = unit_scale(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    with pytest.raises(ValueError, match="lr must be a positive float"):
        umup_param_groups(model, lr=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight_decay must be finite"):
        umup_param_groups(model, lr=0.1, weight_decay=math.nan)
    with pytest.raises(TypeError, match="residual_mult must be a number"):
        umup_taus(4, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="residual_mult must be finite"):
        umup_taus(4, math.nan)
    assert umup_taus(4, 2.0) == U.residual_taus(4, "weighted", weight=1.0)


def test_flags_must_be_bools_and_constraints_known() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with pytest.raises(TypeError, match="float8 must be a bool, got 'yes'"):
        U.matmul(a, b, float8="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="training must be a bool, got 'no'"):
        U.dropout(a, 0.5, training="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="constraint must be one of"):
        unn.Linear(4, 4, constraint="bogus")
    with pytest.raises(ValueError, match="constraint must be one of"):
        unn.Softmax(constraint="bogus")
    with pytest.raises(ValueError, match="mult must be non-zero"):
        U.softmax(a, mult=0.0)
    assert torch.equal(U.dropout(a, 0.5, training=False), a)
    assert U.softmax(a, mult=-1.0).shape == a.shape  # a negative multiplier is maths
