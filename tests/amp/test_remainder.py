"""BF16 + 16-bit remainder = the FP32 master, bit for bit (lowprec.amp.remainder)."""

from __future__ import annotations

import pytest
import torch

from lowprec.amp import join_fp32, split_fp32


def _all_finite_patterns() -> torch.Tensor:
    """Random 32-bit patterns (every sign, binade, subnormals, zeros) that are finite."""
    g = torch.Generator().manual_seed(0)
    b = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64)
    edges = torch.tensor([0, -(2**31), 1, 0x8000, 0x18000, 0x7F7FFFFF, 0x3F808000, 0x3F818000])
    x = torch.cat([b, edges]).to(torch.int32).view(torch.float32)
    return x[torch.isfinite(x)]


def test_split_then_join_is_bit_exact() -> None:
    x = _all_finite_patterns()
    hi, lo = split_fp32(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(join_fp32(hi, lo).view(torch.int32), x.view(torch.int32))


def test_remainder_is_the_low_16_bits_and_hi_rounds_to_nearest() -> None:
    x = _all_finite_patterns()
    hi, lo = split_fp32(x)
    low = x.view(torch.int32) & 0xFFFF
    assert torch.equal(lo.to(torch.int32) & 0xFFFF, low)
    # Round to nearest: equal to torch's BF16 cast except on exact ties (low bits 0x8000,
    # where hi goes away from zero) and beyond BF16's largest finite value.
    ok = (low != 0x8000) & (x.abs() < 3.3e38)
    assert torch.equal(hi[ok], x[ok].bfloat16())
    tie = low == 0x8000
    assert torch.all(hi[tie].float().abs() > x[tie].abs())


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match="x must be a float32 tensor"):
        split_fp32(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="lo must be an int16 tensor"):
        join_fp32(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2))
    with pytest.raises(ValueError, match="lo: shape"):
        join_fp32(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int16))
