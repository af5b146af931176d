"""A reference model with outlier features, as LLM activations have them.

Large language models grow a few hidden channels whose activations are 10²–10⁴ times
larger than the rest (Dettmers et al., LLM.int8(), 2022): the inputs of the layers after
each LayerNorm then carry a few huge columns. :func:`outlier_model` builds a
:class:`~lowprec.jobs.model.CharGPT` with that property by construction: in every block the
LayerNorm weights (``ln1``, ``ln2``) of ``channels`` channels are ``gain`` (10³), so the
inputs of ``attn.qkv`` and ``fc`` have those columns ``gain`` times larger, and the matching
input columns of ``attn.qkv.weight`` and ``fc.weight`` are divided by ``gain``, so the
function at initialisation is the plain model's.

What it does to a block-scaled 4-bit cast: a block of ``B`` elements along the contracted
dimension that holds an outlier takes its scale from it; E2M1's largest value is 6 and its
smallest non-zero 0.5, so every other element of the block, ``gain`` times smaller, rounds
to zero (and so do the divided weights in the same blocks). With one outlier in each
16-element block (the default channels, at width 64) the forward GEMMs of ``attn.qkv`` and
``fc`` lose everything but the outliers in NVFP4, while FP8 (E4M3: 17 binades of range)
keeps them all. ``attn.proj``, ``fc_out`` and ``head`` see no outliers.

Example:
    >>> m = outlier_model(ModelConfig(vocab_size=65, width=64, depth=1, heads=4, seq_len=8))
    >>> m.blocks[0].ln1.weight[[1, 17, 33, 49]].tolist()
    [1000.0, 1000.0, 1000.0, 1000.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lowprec.jobs.model import Block, CharGPT, ModelConfig

__all__ = ["DEFAULT_GAIN", "add_outliers", "outlier_channels", "outlier_model"]

DEFAULT_GAIN = 1e3


def outlier_channels(width: int, block: int = 16) -> tuple[int, ...]:
    """One channel in each ``block`` channels (the second of each): every NVFP4 block of a
    row holds one outlier."""
    return tuple(range(1, width, block))


def add_outliers(
    model: CharGPT, channels: Sequence[int] | None = None, gain: float = DEFAULT_GAIN
) -> CharGPT:
    """Give ``model`` (in place; returned) outlier ``channels`` (default
    :func:`outlier_channels`) of ``gain`` at the inputs of every block's ``attn.qkv`` and
    ``fc``, without changing its function in exact arithmetic (module docstring). On a
    trained model this is what a trained LLM looks like to a quantizer; training the
    result further with Adam is not advised (an update of ``lr`` on a divided weight
    column moves the output ``gain`` times as far)."""
    if not isinstance(model, CharGPT):
        raise TypeError(f"model must be a CharGPT, got {type(model).__name__}")
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not gain >= 1:
        raise ValueError(f"gain must be a number >= 1, got {gain!r}")
    width = model.cfg.width
    ch = list(outlier_channels(width) if channels is None else channels)
    if not ch or any(not isinstance(c, int) or not 0 <= c < width for c in ch):
        raise ValueError(f"channels must be channel indices in [0, {width}), got {ch!r}")
    with torch.no_grad():
        for block in model.blocks:
            assert isinstance(block, Block)
            pairs: tuple[tuple[nn.LayerNorm, nn.Linear], ...] = (
                (block.ln1, block.attn.qkv),
                (block.ln2, block.fc),
            )
            for ln, lin in pairs:
                ln.weight[ch] *= gain
                ln.bias[ch] *= gain
                lin.weight[:, ch] /= gain
    return model


def outlier_model(
    cfg: ModelConfig, channels: Sequence[int] | None = None, gain: float = DEFAULT_GAIN
) -> CharGPT:
    """A new :class:`CharGPT` of shape ``cfg`` (initialised from torch's global RNG) with
    :func:`add_outliers`."""
    return add_outliers(CharGPT(cfg), channels, gain)
