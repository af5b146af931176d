"""What every technique needs under ``torch.distributed``: reductions of scaling state and
found-inf across ranks, FSDP2 all-gather hooks for float8 weights, tensor parallelism and
sharded checkpoints — built on torch's own machinery (``fully_shard``, DTensor,
``torch.distributed.tensor.parallel``, ``torch.distributed.checkpoint``, ``torchrun``).
"""

# Data parallelism for every recipe (FSDP2, DDP), torchrun's process group, DCP checkpoints
# (parallel, env, checkpoint); float8 under torch.distributed: FP8 all-gather (FSDP2),
# tensor parallel, scaling state (float8_fsdp, float8_tp, scaling_sync); gradients
# reduced in FP8 or BF16 (grad_comm).
from lowprec.distributed import checkpoint
from lowprec.distributed import float8_dtensor as _float8_dtensor  # noqa: F401  (registers)
from lowprec.distributed.amax import MaxReducer, mesh_amax
from lowprec.distributed.env import init, shutdown
from lowprec.distributed.float8_fsdp import (
    enable_fp8_all_gather,
    fp8_all_gather_eligible,
    fp8_all_gather_layout,
    fp8_weights_updated,
)
from lowprec.distributed.float8_tp import Float8ColwiseParallel
from lowprec.distributed.grad_comm import (
    FP8CommState,
    enable_fp8_reduce_scatter,
    fp8_allreduce_hook,
    fsdp_reduce_policy,
    grad_divide_factor,
    register_fp8_allreduce,
)
from lowprec.distributed.parallel import (
    PARALLEL,
    fsdp_units,
    mixed_precision_policy,
    prepare,
    shard,
)
from lowprec.distributed.scaling_sync import (
    attach_scaling_sync,
    scaling_state,
    sync_scaling_state,
)

__all__ = [
    "PARALLEL",
    "FP8CommState",
    "Float8ColwiseParallel",
    "MaxReducer",
    "attach_scaling_sync",
    "checkpoint",
    "enable_fp8_all_gather",
    "enable_fp8_reduce_scatter",
    "fp8_all_gather_eligible",
    "fp8_all_gather_layout",
    "fp8_allreduce_hook",
    "fp8_weights_updated",
    "fsdp_reduce_policy",
    "fsdp_units",
    "grad_divide_factor",
    "init",
    "mesh_amax",
    "mixed_precision_policy",
    "prepare",
    "register_fp8_allreduce",
    "scaling_state",
    "shard",
    "shutdown",
    "sync_scaling_state",
]
