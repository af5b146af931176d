"""The reference data: the tinyshakespeare corpus as character-level batches.

``CharData`` reads the corpus shipped inside the package, splits it 90/10 into train/val,
and draws batch ``i`` of a run from a generator seeded with ``(seed, i)``, so a batch
depends only on the seed and its position: a resumed run sees the same data.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["CharData", "corpus_text"]


def corpus_text(path: str | Path | None = None) -> str:
    """The tinyshakespeare corpus shipped in ``lowprec/data/`` (or the file at ``path``)."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    return resources.files("lowprec").joinpath("data/tinyshakespeare.txt").read_text("utf-8")


class CharData:
    """Character-level batches with a deterministic order.

    ``batch(split, i)`` returns ``(x, y)`` of shape ``(batch_size, seq_len)``: ``batch_size``
    windows at offsets drawn by a generator seeded with ``seed`` and ``i`` (and the split),
    ``y`` shifted by one character.
    """

    def __init__(
        self,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        text: str | None = None,
        val_fraction: float = 0.1,
    ) -> None:
        for name, v in (("seq_len", seq_len), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        text = corpus_text() if text is None else text
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n_val = int(len(ids) * val_fraction)
        self.splits = {"train": ids[:-n_val], "val": ids[-n_val:]}
        for name, part in self.splits.items():
            if len(part) <= seq_len + 1:
                raise ValueError(f"text: the {name} split is shorter than seq_len + 1")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, split: str, index: int) -> tuple[Tensor, Tensor]:
        if split not in self.splits:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = self.splits[split]
        g = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + index * 2 + (split == "val")) % 2**63
        )
        starts = torch.randint(0, len(data) - self.seq_len - 1, (self.batch_size,), generator=g)
        offs = starts[:, None] + torch.arange(self.seq_len + 1)
        win = data[offs]
        return win[:, :-1], win[:, 1:]

    def decode(self, ids: Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())
