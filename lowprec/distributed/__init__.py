"""What every technique needs under ``torch.distributed``: reductions of scaling state and
found-inf across ranks, FSDP2 all-gather hooks for float8 weights, tensor parallelism and
sharded checkpoints — built on torch's own machinery (``fully_shard``, DTensor,
``torch.distributed.tensor.parallel``, ``torch.distributed.checkpoint``, ``torchrun``).
"""
