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


def test_a_scaler_with_margin_or_power_of_two_is_refused() -> None:
    """With a ``scaler`` its own margin and power-of-two rounding make the scale: a
    ``margin=3`` or ``power_of_two=True`` passed beside it was silently ignored."""
    from lowprec.core.scalers import DynamicScaler
    from lowprec.core.tensor import quantize_scaled

    x = torch.linspace(-40.0, 40.0, 64)
    with pytest.raises(ValueError, match=r"^margin 3, power_of_two False: the scaler's own"):
        quantize_scaled(x, "e4m3fn", scaler=DynamicScaler("e4m3fn"), margin=3.0)
    with pytest.raises(ValueError, match=r"^margin 0, power_of_two True: the scaler's own"):
        quantize_scaled(x, "e4m3fn", scaler=DynamicScaler("e4m3fn"), power_of_two=True)
    with pytest.raises(ValueError, match="margin must be finite"):
        quantize_scaled(x, "e4m3fn", scaler=DynamicScaler("e4m3fn"), margin=float("nan"))
    # set on the scaler they apply: amax 40 · 2^3 / 448 and its power of two above
    want = torch.tensor(40.0 * 8 / 448).item()  # float32's rounding of the exact quotient
    st = quantize_scaled(x, "e4m3fn", scaler=DynamicScaler("e4m3fn", margin=3.0))
    assert st.scale.item() == want
    st = quantize_scaled(x, "e4m3fn", scaler=DynamicScaler("e4m3fn", power_of_two=True))
    assert st.scale.item() == 0.125  # 40/448 = 0.089 rounded up
    # and without a scaler the arguments are used
    assert (
        quantize_scaled(x, "e4m3fn", margin=3.0).scale.item() == torch.tensor(40 * 8 / 448).item()
    )
    assert quantize_scaled(x, "e4m3fn", power_of_two=True).scale.item() == 0.125


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_power_of_two_must_be_a_bool(bad: object) -> None:
    from lowprec.core.scalers import DynamicScaler
    from lowprec.core.tensor import quantize_scaled

    x = torch.ones(4)
    with pytest.raises(TypeError, match=r"^power_of_two must be a bool, got "):
        quantize_scaled(x, "e4m3fn", power_of_two=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^power_of_two must be a bool, got "):
        quantize_scaled(x, "e4m3fn", scaler=DynamicScaler("e4m3fn"), power_of_two=bad)  # type: ignore[arg-type]


def test_to_format_is_public() -> None:
    """docs/formats.md names ``lowprec.to_format``; it was only in ``lowprec.core.rounding``."""
    assert lowprec.to_format is to_format and "to_format" in lowprec.__all__


def test_scaled_casts_that_would_compute_something_else_raise() -> None:
    """``quantize_scaled`` refuses what ``CastConfig`` refuses: an unsigned element format
    (E8M0: every negative value became NaN, and 1.0 read 1.25), ``"nv"`` with another
    format than E2M1, and ``power_of_two`` with ``"mx"`` (accepted and ignored)."""
    from lowprec.core.tensor import quantize_scaled

    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="'e8m0' is unsigned"):
        quantize_scaled(x, "e8m0")
    with pytest.raises(ValueError, match="needs fmt 'e2m1', got 'e4m3fn'"):
        quantize_scaled(x, "e4m3fn", granularity="nv")
    for g in ("mx", "mx:32"):
        with pytest.raises(ValueError, match="power_of_two=True does not apply to granul"):
            quantize_scaled(x, "e2m1", granularity=g, power_of_two=True)
    # what they allow still works: MX scales are powers of two without the flag
    s = quantize_scaled(x, "e2m1", granularity="mx").scale
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))


def test_a_generator_with_nearest_rounding_raises() -> None:
    """Round-to-nearest draws nothing: a generator was accepted and left unused (its state
    unchanged), where ``seed`` with nearest rounding already raised."""
    from lowprec.core.tensor import quantize_scaled

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="generator: rounding='nearest' draws nothing"):
        lowprec.quantize(x, "e4m3fn", generator=g)
    with pytest.raises(ValueError, match="generator: rounding='nearest' draws nothing"):
        quantize_scaled(x, "e4m3fn", generator=g)
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        lowprec.quantize(x, "e4m3fn", rounding="stochastic", generator=1)  # type: ignore[arg-type]
    # with stochastic rounding the generator is used: its state moves
    before = g.get_state()
    quantize_scaled(x, "e4m3fn", rounding="stochastic", generator=g)
    assert not torch.equal(g.get_state(), before)
