"""A recipe with lean training state (lowprec.amp.lean) is refused under torch.distributed,
with a message, instead of silently training with a plain optimizer."""

from __future__ import annotations

import tempfile

import pytest
import torch.distributed as dist
from torch import nn

from lowprec.distributed.parallel import prepare


@pytest.mark.parametrize("recipe", ["fp8-lean", "bf16-sr", "bf16-remainder", "bf16-8bit"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_lean_recipes_are_refused(recipe: str, mode: str) -> None:
    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(tempfile.mktemp(), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"lean training state.*not supported"):
            prepare(nn.Linear(8, 8), recipe, mode)  # type: ignore[arg-type]
    finally:
        if own:
            dist.destroy_process_group()
