"""FSDP2's all-gather with a byte count, shared by the float8 and MoE distributed workers."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather


class CountingAllGather(DefaultAllGather):
    """FSDP2's default all-gather, counting the bytes each rank puts on the wire
    (``CountingAllGather.bytes``, summed over every instance; reset it between runs)."""

    bytes = 0

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
    ) -> Any:  # type: ignore[override]
        CountingAllGather.bytes += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)
