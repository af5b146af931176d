"""``TrainConfig`` bounds its numbers by what the run's arithmetic holds, so a value is
refused when the configuration is made, naming the field, never at the first step: ``lr``
within [float32's smallest normal, 10] (``lr=1e308`` overflowed the optimizer's float32
arithmetic), every int at most ``2^63 - 1`` (``seed + 1`` seeds a ``torch.Generator``,
which takes < 2^64; ``warmup`` divides a float)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowprec.jobs.train_config import INT_MAX, LR_MAX, LR_MIN, TrainConfig
from lowprec.jobs.train_setup import build
from tests._helpers import TINY


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 1e308}, r"^lr must be .* from 1.18e-38 .* to 1e\+06, got 1e\+308"),
        ({"lr": 10**400}, r"^lr must be a positive finite number from"),  # not float()-able
        ({"lr": 1e-320}, r"^lr must be a positive finite number from"),
        ({"lr": float("nan")}, r"^lr must be a positive finite number, got nan"),
        ({"seed": 2**63}, rf"^seed must be at most 2\^63 - 1 = {INT_MAX}, got {2**63}"),
        ({"warmup": 10**400}, r"^warmup must be at most 2\^63 - 1"),
        ({"steps": 2**64}, r"^steps must be at most 2\^63 - 1"),
        ({"eval_batches": 2**64}, r"^eval_batches must be at most 2\^63 - 1"),
        ({"width": 30, "heads": 4}, r"^width \(30\) must be divisible by heads \(4\)"),
    ],
)  # fmt: skip
def test_out_of_range_values_name_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replace(TINY, **kwargs)  # type: ignore[arg-type]


def test_the_bounds_themselves_are_accepted() -> None:
    for kwargs in ({"lr": LR_MIN}, {"lr": LR_MAX}, {"seed": INT_MAX}, {"warmup": INT_MAX}):
        replace(TINY, **kwargs)  # type: ignore[arg-type]
    build(replace(TINY, seed=INT_MAX))  # torch.manual_seed(seed), Generator(seed + 1)


def test_check_together_names_flags_or_fields() -> None:
    with pytest.raises(ValueError, match=r"^--width 30 must be divisible by --heads 4$"):
        TrainConfig.check_together({"width": 30, "heads": 4}, flags=True)
    with pytest.raises(ValueError, match=r"^--width 128 must be divisible by --heads 3$"):
        TrainConfig.check_together({"heads": 3}, flags=True)  # the default width
    TrainConfig.check_together({"width": 32, "heads": 2}, flags=True)
