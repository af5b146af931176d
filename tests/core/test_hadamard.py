"""The random Hadamard transform and the seeded streams of lowprec.core.hadamard, against
FP64 oracles (an explicit block-diagonal matrix, the plain FP64 product)."""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.core.hadamard import (
    block_hadamard,
    fqn_key,
    generator,
    hadamard_matrix,
    random_hadamard,
    random_signs,
    stream_seed,
)

F64_EPS = 2.0**-53


@pytest.mark.parametrize("b", [2, 16, 32, 128])
def test_random_hadamard_is_orthogonal(b: int) -> None:
    h = random_hadamard(b, seed=3)
    # Each entry of HᵀH is a sum of b products (±1/√b)² = ±1/b, each product and partial
    # sum rounded in float64: an error below b·2^-53 per entry.
    err = (h.t() @ h - torch.eye(b, dtype=torch.float64)).abs().max()
    assert float(err) <= b * F64_EPS
    hd = hadamard_matrix(b)  # Sylvester: ±1 entries, symmetric, HdᵀHd = b·I exactly
    assert torch.equal(hd, hd.t()) and torch.equal(hd @ hd, b * torch.eye(b, dtype=torch.float64))
    s = random_signs(b, seed=3)
    assert set(s.tolist()) <= {-1.0, 1.0} and torch.equal(h, hd * s / math.sqrt(b))


def test_signs_are_a_function_of_the_seed() -> None:
    assert torch.equal(random_signs(16, 5), random_signs(16, 5))
    assert not torch.equal(random_signs(16, 5), random_signs(16, 6))
    # SplitMix64's first output for state 0 is 0xE220A8397B1DCDAF (the reference
    # implementation's published value); a change of the hash would change every stored
    # sign vector and every stochastic-rounding stream of saved runs.
    assert stream_seed(0) == 0xE220A8397B1DCDAF >> 1
    assert stream_seed(1, 2, 3) == 0x6839A3A87EF1B159 != stream_seed(1, 3, 2)
    assert fqn_key("blocks.0.mlp.fc") == 0x85A38E15  # zlib.crc32, stable across processes
    assert random_signs(16, 0).tolist()[:4] == [-1.0, -1.0, 1.0, 1.0]
    a = torch.rand(8, generator=generator(stream_seed(4, 5)))
    assert torch.equal(a, torch.rand(8, generator=generator(stream_seed(4, 5))))


@pytest.mark.parametrize("dim", [0, 1])
def test_block_hadamard_equals_the_block_diagonal_matrix(dim: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(48, 40, dtype=torch.float64)  # 40 along dim 1: padded to 48
    b, seed = 16, 11
    out = block_hadamard(x, dim, b, seed)
    n = x.shape[dim]
    padded = n + (-n % b)
    big = torch.block_diag(*[random_hadamard(b, seed)] * (padded // b))  # FP64 oracle
    xp = torch.nn.functional.pad(x, (0, padded - n) if dim == 1 else (0, 0, 0, padded - n))
    ref = xp @ big.t() if dim == 1 else big @ xp
    # each output is a b-term FP64 dot product: |err| <= b·2^-53·Σ|h||x|
    bound = b * F64_EPS * (xp.abs().max() * math.sqrt(b))
    assert out.shape == ref.shape and float((out - ref).abs().max()) <= float(bound)


@pytest.mark.parametrize(("b", "k"), [(16, 64), (32, 96), (16, 50)])
def test_both_operands_transformed_leave_the_product_unchanged(b: int, k: int) -> None:
    """(A Hᵀ)(H C) = A C in exact arithmetic; in FP64 to 1e-12 relative (the error of two
    FP64 transforms and a product: a few hundred ulps at most, ~1e-14)."""
    torch.manual_seed(1)
    a = torch.randn(24, k, dtype=torch.float64)
    a[3, 7] = 300.0  # an outlier
    c = torch.randn(k, 20, dtype=torch.float64)
    ref = a @ c
    got = block_hadamard(a, 1, b, 9) @ block_hadamard(c, 0, b, 9)
    assert float((got - ref).norm() / ref.norm()) < 1e-12
    # The outlier is spread over its block: the block's amax falls by up to √b.
    ta = block_hadamard(a, 1, b, 9)
    assert float(ta[3].abs().max()) < 300.0 / math.sqrt(b) + 4 * math.sqrt(b)


def test_block_hadamard_keeps_16_bit_inputs_in_float32_and_rejects_bad_args() -> None:
    x = torch.randn(4, 32).bfloat16()
    assert block_hadamard(x, 1, 16, 0).dtype == torch.float32
    with pytest.raises(ValueError, match="block must be a power of two"):
        block_hadamard(x, 1, 12, 0)
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        block_hadamard(x, 2, 16, 0)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        block_hadamard(torch.ones(4, 16, dtype=torch.int32), 1, 16, 0)
    with pytest.raises(TypeError, match="keys must be ints"):
        stream_seed(1, "a")  # type: ignore[arg-type]
