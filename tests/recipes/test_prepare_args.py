"""``lowprec.prepare`` checks its callables before using them: ``prepare(model, "fp32", 3)``
raised ``TypeError: 'int' object is not callable``, naming no argument."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowprec


@pytest.mark.parametrize("bad", [3, "adamw", torch.optim.AdamW([nn.Parameter(torch.ones(1))])])
def test_optimizer_factory_must_be_callable(bad: object) -> None:
    with pytest.raises(TypeError, match=r"^optimizer_factory must be a callable \(params -> "):
        lowprec.prepare(nn.Linear(2, 2), "fp32", bad)  # type: ignore[arg-type]


def test_param_groups_and_generator_are_checked() -> None:
    with pytest.raises(TypeError, match=r"^param_groups must be a callable"):
        lowprec.prepare(nn.Linear(2, 2), "fp32", param_groups=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^generator must be a torch.Generator or None, got int"):
        lowprec.prepare(nn.Linear(2, 2), "fp32", None, 0)  # type: ignore[arg-type]


def test_a_factory_or_none_is_taken() -> None:
    p = lowprec.prepare(nn.Linear(2, 2), "fp32", lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert type(p.optimizer).__name__ == "SGD"
    assert type(lowprec.prepare(nn.Linear(2, 2), "fp32", None).optimizer).__name__ == "AdamW"
