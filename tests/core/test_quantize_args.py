"""``lowprec.quantize`` (and ``to_format``) take ``saturate`` as a bool only: a string such
as ``"no"`` is truthy and would silently clamp (a user's ``saturate="yes"`` was accepted)."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.core.rounding import to_format


@pytest.mark.parametrize("bad", ["yes", "no", 1, 0, None, torch.tensor(True)])
def test_saturate_must_be_a_bool(bad: object) -> None:
    x = torch.tensor([1.0, 500.0])
    with pytest.raises(TypeError, match=r"^saturate must be a bool, got "):
        lowprec.quantize(x, "e4m3fn", saturate=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^saturate must be a bool, got "):
        to_format(x, "e4m3fn", saturate=bad)  # type: ignore[arg-type]


def test_saturate_message_shows_the_value() -> None:
    with pytest.raises(TypeError, match=r"^saturate must be a bool, got str 'yes'$"):
        lowprec.quantize(torch.ones(2), "e4m3fn", saturate="yes")  # type: ignore[arg-type]


def test_bools_still_work() -> None:
    x = torch.tensor([500.0])
    assert lowprec.quantize(x, "e4m3fn", saturate=True).item() == 448.0  # E4M3FN's max
    assert torch.isnan(lowprec.quantize(x, "e4m3fn", saturate=False)).item()  # fn: NaN
