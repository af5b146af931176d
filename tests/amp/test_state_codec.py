"""Block-scaled optimizer-state storage: the error bounds of lowprec.amp.state_codec."""

from __future__ import annotations

import pytest
import torch

from lowprec.amp import StateCodec, state_codecs


def _x(n: int = 3000, signed: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    # Values over many binades, as moments are: N(0,1) times 10^U(-6, 1).
    x = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 7 - 6)
    return x if signed else x.abs()


def _block_scale(x: torch.Tensor, b: int, qmax: float) -> torch.Tensor:
    """Each element's block scale amax/qmax (the oracle, recomputed here)."""
    pad = -x.numel() % b
    blocks = torch.cat([x.abs(), x.new_zeros(pad)]).view(-1, b)
    return (blocks.amax(1, keepdim=True) / qmax).expand(-1, b).reshape(-1)[: x.numel()]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_e4m3_error_within_the_formats_resolution(rounding: str) -> None:
    x, c = _x(), StateCodec("e4m3", block_size=256, rounding=rounding)
    codes, scales = c.encode(x, torch.Generator().manual_seed(0))
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel()
    assert scales is not None and scales.numel() == -(-x.numel() // 256)
    err = (c.decode(codes, scales, x.shape) - x).abs()
    # Half an ulp (3 mantissa bits: 2^-4 relative) or half the smallest subnormal step
    # (2^-9·s / 2); twice that for stochastic rounding; plus FP32's rounding of x/s, q·s.
    k = 1 if rounding == "nearest" else 2
    s = _block_scale(x, 256, 448.0)
    bound = k * (2**-4 * x.abs() + 2**-10 * s) + 2**-21 * x.abs()
    assert torch.all(err <= bound)


def test_int8_error_is_half_a_step() -> None:
    x, c = _x(), StateCodec("int8", block_size=128)
    codes, scales = c.encode(x)
    assert codes.dtype == torch.int8
    err = (c.decode(codes, scales, x.shape) - x).abs()
    s = _block_scale(x, 128, 127.0)
    assert torch.all(err <= s / 2 * (1 + 2**-20))


def test_sqrt_domain_keeps_small_second_moments() -> None:
    """sqrt(v) in E4M3 covers 2·17.8 binades of v below the block maximum; v itself in
    int8 zeroes everything below amax/254 (the failure the square root avoids)."""
    v = _x(signed=False) ** 2
    dec = {}
    for name, c in {"sqrt": StateCodec("e4m3", sqrt=True), "int8": StateCodec("int8")}.items():
        dec[name] = c.decode(*c.encode(v), v.shape)
    small = v > 0
    r, s = v.sqrt(), _block_scale(v.sqrt(), 256, 448.0)
    # √v's error: half an ulp or half a subnormal step, and below the first code (2^-9·s)
    # rounded up to it (at most that code); then |(r + e)² - r²| <= 2·r·|e| + e².
    e = torch.where(r < 2**-9 * s, 2**-9 * s, 2**-4 * r + 2**-10 * s) + 2**-21 * r
    assert torch.all((dec["sqrt"] - v).abs() <= 2 * r * e + e**2)
    assert not torch.any(dec["sqrt"][small] == 0)  # (v in int8 zeroes most of them)
    assert (dec["int8"][small] == 0).float().mean() > 0.5


@pytest.mark.parametrize("fmt", ["e4m3", "int8"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_positive_second_moment_is_never_stored_below_the_first_code(
    fmt: str, rounding: str
) -> None:
    """A block with one large second moment and small ones 10^-3..10^-14 of it in √v:
    each √v below the format's first code (2^-9·s in E4M3, s in int8) is stored as that
    code, never as 0 (where m/(√0 + eps) made an AdamW step of 372x lr); above it, the
    format's bound holds as before; a zero stays zero."""
    r = torch.cat([torch.ones(1), 10 ** -torch.linspace(3, 14, 254), torch.zeros(1)])
    c = StateCodec(fmt, block_size=256, sqrt=True, rounding=rounding)  # type: ignore[arg-type]
    for seed in range(5):
        got = c.decode(*c.encode(r**2, torch.Generator().manual_seed(seed)), r.shape).sqrt()
        first = 2**-9 / 448 if fmt == "e4m3" else 1 / 127  # the block scale is 1/qmax
        low = (r > 0) & (r < first)
        assert low.sum() > 100 and torch.allclose(got[low], torch.full_like(got[low], first))
        high = r >= first
        k = 1 if rounding == "nearest" else 2
        step = (
            2**-4 * r[high] + 2**-10 / 448 if fmt == "e4m3" else torch.full_like(r[high], 0.5 / 127)
        )
        assert torch.all((got[high] - r[high]).abs() <= k * step * (1 + 2**-20))
        assert got[-1] == 0


def test_fp32_codec_is_the_tensor_itself_and_bf16_rounds() -> None:
    x = _x()
    codes, scales = StateCodec("fp32").encode(x)
    assert codes is x and scales is None
    b, _ = StateCodec("bf16").encode(x)
    assert torch.equal(b, x.bfloat16())


def test_presets_and_bad_arguments() -> None:
    m, v = state_codecs("8bit")
    assert (m.format, v.format, v.sqrt, m.block_size) == ("e4m3", "e4m3", True, 256)
    with pytest.raises(ValueError, match="precision must be 'fp32', 'bf16' or '8bit'"):
        state_codecs("4bit")
    with pytest.raises(ValueError, match="format must be one of"):
        StateCodec("e5m2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        StateCodec("int8", block_size=0)
    with pytest.raises(ValueError, match="scales: the e4m3 codes need their block scales"):
        StateCodec("e4m3").decode(torch.zeros(3, dtype=torch.uint8), None, (3,))


def test_blocks_follow_rows_so_a_row_shard_has_the_rows_codes_and_scales() -> None:
    """Blocks never cross a row: the codes and scales of rows [3, 7) of a (7, 301) tensor,
    encoded alone (an FSDP2 shard), are those rows of the whole tensor's, bit for bit."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 301, generator=g) * 10 ** (torch.rand(7, 301, generator=g) * 6 - 5)
    c = StateCodec("e4m3", sqrt=False)
    codes, scales = c.encode(x)
    assert codes.shape == x.shape and scales is not None and scales.shape == (7, 2)
    part_codes, part_scales = c.encode(x[3:])
    assert torch.equal(part_codes, codes[3:]) and torch.equal(part_scales, scales[3:])
    # each scale is its block's amax / 448: columns [0, 256) and [256, 301) of each row
    want = torch.stack([x[:, :256].abs().amax(1), x[:, 256:].abs().amax(1)], 1) / 448
    assert torch.equal(scales, want)
    # a flat layout (an older lowprec's) is refused, not misread
    with pytest.raises(ValueError, match=r"scales: shape \(14,\)"):
        c.decode(codes, scales.reshape(-1), x.shape)
