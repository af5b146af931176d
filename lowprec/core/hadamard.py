"""Random Hadamard transforms in blocks, and the seeded streams of stochastic rounding.

**Block Hadamard transform.** For a block size ``b`` (a power of two) and a sign vector
``s ∈ {±1}^b``, the random Hadamard matrix is

    H = (1/√b) · Hd_b · diag(s),        Hd_1 = [1],  Hd_2k = [[Hd_k, Hd_k], [Hd_k, -Hd_k]]

(Sylvester's construction; ``Hd_b`` is symmetric with ``Hd_bᵀ Hd_b = b·I``), so ``Hᵀ H = I``:
``H`` is orthogonal. :func:`block_hadamard` applies ``H`` to each run of ``b`` consecutive
elements along one dimension of a tensor (a block-diagonal orthogonal matrix ``B``).
Transforming *both* operands of a product along the contracted dimension leaves it unchanged
in exact arithmetic,

    (A Bᵀ)(B C) = A (Bᵀ B) C = A C,

where ``A`` is transformed along its dim 1 (``A Bᵀ``: each row block ``a ↦ H a``) and ``C``
along its dim 0 (``B C``: each column block ``c ↦ H c``): both are ``v ↦ H v`` on a block of
the contracted dimension. The transform spreads an outlier over its block (the block's
``amax`` falls toward its RMS), which is what a narrow format with block scales gains from.
A contracted dimension that ``b`` does not divide is zero-padded to whole blocks first
(zeros change no dot product): :func:`block_hadamard` returns the padded tensor.

**Signs.** :func:`random_signs` derives ``s`` from a seed by SplitMix64 (a fixed integer
hash, independent of torch's generators and of the device), so the seed stored in a
config *is* the stored sign vector.

**Stochastic-rounding streams.** :func:`stream_seed` mixes integers (a run seed, a layer key,
a step counter, a GEMM and a role) into one 63-bit seed by the same hash: a counter-based
stream, so the draws of a cast depend on those keys alone, not on what ran before, nor on
the number of processes (ranks that quantize the same tensor draw the same bits), and a run
resumed from its counter draws what the uninterrupted run drew. :func:`generator` is the
``torch.Generator`` seeded with it.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

__all__ = [
    "block_hadamard",
    "fqn_key",
    "generator",
    "hadamard_matrix",
    "random_hadamard",
    "random_signs",
    "stream_seed",
]

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """One SplitMix64 output for the state ``z`` (Steele, Lea, Flood 2014)."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_seed(*keys: int) -> int:
    """A 63-bit seed from the integers ``keys`` (e.g. run seed, layer key, step, GEMM,
    role): SplitMix64 applied to each key folded into the previous output. Equal keys give
    equal seeds on every process and device."""
    h = 0
    for k in keys:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"keys must be ints, got {type(k).__name__}")
        h = _splitmix64(h ^ (k & _MASK64))
    return h >> 1


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (e.g. :func:`stream_seed`)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def fqn_key(fqn: str) -> int:
    """A layer's key for :func:`stream_seed`: the CRC-32 of its fully-qualified name
    (stable across processes, unlike Python's ``hash``)."""
    if not isinstance(fqn, str):
        raise TypeError(f"fqn must be a str, got {type(fqn).__name__}")
    return zlib.crc32(fqn.encode())


def _check_block(b: int) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or b < 1 or b & (b - 1):
        raise ValueError(f"block must be a power of two >= 1, got {b!r}")


def random_signs(block: int, seed: int) -> Tensor:
    """The sign vector ``s ∈ {±1}^block`` (float64) of seed ``seed``: ``s_i`` is the sign
    given by the low bit of ``SplitMix64`` of :func:`stream_seed` ``(seed, i)``."""
    _check_block(block)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    bits = [stream_seed(seed, i) & 1 for i in range(block)]
    return torch.tensor([1.0 - 2.0 * v for v in bits], dtype=torch.float64)


def hadamard_matrix(block: int) -> Tensor:
    """Sylvester's ``Hd_block`` (float64, entries ±1, symmetric, ``Hdᵀ Hd = block·I``)."""
    _check_block(block)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_hadamard(block: int, seed: int) -> Tensor:
    """``H = (1/√block) · Hd_block · diag(random_signs(block, seed))`` in float64: an
    orthogonal matrix (``Hᵀ H = I``)."""
    return hadamard_matrix(block) * random_signs(block, seed) / math.sqrt(block)


_CACHE: dict[tuple[int, int, torch.dtype, torch.device], Tensor] = {}


def _matrix(block: int, seed: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    key = (block, seed, dtype, device)
    m = _CACHE.get(key)
    if m is None:  # Hᵀ, rounded once from float64 into dtype
        m = _CACHE[key] = random_hadamard(block, seed).t().contiguous().to(device, dtype)
    return m


def block_hadamard(x: Tensor, dim: int, block: int, seed: int) -> Tensor:
    """``x`` with ``v ↦ H v`` (``H = random_hadamard(block, seed)``) applied to every run
    of ``block`` consecutive elements along ``dim``, computed and returned in float32
    (float64 for a float64 ``x``: a 16-bit ``x`` is not rounded back); ``dim``'s size is
    zero-padded to a multiple of ``block`` first (the result has the padded size).
    Transform both operands of a product along its contracted dimension and the product
    is unchanged (module docstring).

    Example:
        >>> a, c = torch.randn(3, 32, dtype=torch.float64), torch.randn(32, 5, dtype=torch.float64)
        >>> ta, tc = block_hadamard(a, 1, 16, 7), block_hadamard(c, 0, 16, 7)
        >>> bool(torch.allclose(ta @ tc, a @ c))
        True
    """
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
    _check_block(block)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of {x.dim()} dims")
    dim %= x.dim()
    n = x.shape[dim]
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if n % block:
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, block - n % block]
        work = torch.nn.functional.pad(work, pad)
    # One (rows, block) @ (block, block) product over a contiguous copy: a batched product
    # over the blocks of a strided view would copy every block on its own (CPU bmm).
    moved = work.movedim(dim, -1).contiguous()
    blocks = moved.view(-1, block)
    out = (blocks @ _matrix(block, seed, work.dtype, x.device)).view(moved.shape)
    return out.movedim(-1, dim)
