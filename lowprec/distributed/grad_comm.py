"""Gradient communication in narrow formats: an FP8 all-reduce for DDP, and a BF16 or FP8
reduce-scatter for FSDP2.

**DDP: FP8 all-reduce with shared scales** (:func:`register_fp8_allreduce`, the hook
:func:`fp8_allreduce_hook`). A sum must not be formed in FP8: each addition would round
to 2-3 mantissa bits, and a sum can exceed the scale that fits its summands. So the
all-reduce of a bucket ``g_r`` (rank ``r`` of ``N``, ``n`` elements, padded with zeros to
``m = N·⌈n/N⌉``) is a reduce-scatter then an all-gather, each with FP8 on the wire and
every sum in FP32:

1. ``a₁ = max_r amax_fin(g_r)`` (one ``all_reduce(MAX)`` of one float32; ``amax_fin`` is
   the largest *finite* magnitude), ``s₁ = compute_scale(a₁, fmt)`` (``a₁ / fmt.max``;
   :func:`lowprec.core.scales.compute_scale`), the same on every rank;
2. ``q_r = to_format(g_r / s₁, fmt, saturate=True)`` (:func:`lowprec.core.rounding.to_format`),
   split in ``N`` segments; ``all_to_all_single`` of the bytes sends segment ``j`` to rank
   ``j`` (an FP8 reduce-scatter: each rank receives the ``N`` pieces of its segment);
3. rank ``j`` sums its pieces in FP32: ``S_j = s₁ · Σ_r q_r[j] / D`` (``D``: ``divide_by``,
   ``N`` for a mean, ``√N`` for unit recipes, see :func:`grad_divide_factor`);
4. ``a₂ = max_j amax_fin(S_j)`` (a second ``all_reduce(MAX)``), ``s₂ = compute_scale(a₂,
   fmt)``; ``Q_j = to_format(S_j / s₂, fmt, saturate=True)``; ``all_gather`` of the bytes;
5. every rank writes ``s₂ · Q`` (the first ``n`` elements) into the bucket, in its dtype.

Every rank decodes the same bytes with the same ``s₂``: the replicas stay identical, as
DDP needs. Error of an element (``u = 2^-(M+1)``: half an ulp relative, ``M`` the
format's mantissa bits; ``δ = fmt.min_subnormal``; the first term of each rounding holds
in the normal range, the second below it):

    |ĝ - ḡ| ≤ Σ_r max(u·|g_r|, s₁·δ/2) / D  +  max(u·|S|, s₂·δ/2)     (ḡ = Σ_r g_r / D)

plus FP32 rounding. Values below ``s·δ/2`` (2^-18.8 of the bucket's largest for E4M3,
2^-32.8 for E5M2) flush to zero: a bucket holds many tensors, so a format's *range* matters as
much as its precision (``docs/distributed.md`` compares E4M3 and E5M2 on real gradients).

Bytes each rank sends, per element, with ring collectives: FP32 all-reduce
``2(N-1)/N · 4``; this hook ``2(N-1)/N · 1`` (``(N-1)/N`` in the all-to-all,
``(N-1)/N`` in the all-gather) plus two float32 all-reduces per bucket
(:attr:`FP8CommState.bytes_sent` counts them with that model).

Non-finite gradients (an overflow that the loss scaler must see): the scales come from the
finite values only, so the finite elements keep their accuracy, and an Inf or NaN passes
through both casts as the format holds it: ``±Inf`` stays ``±Inf`` in E5M2 and becomes
NaN in E4M3FN (no Inf code); NaN stays NaN; the FP32 sums propagate them. So an element
non-finite on any rank is non-finite on every rank after the hook, and a dynamic loss
scaler skips the step on every rank, as with an FP32 all-reduce.

The hook runs its collectives in order in the calling thread (chained futures could
issue them from other threads and interleave two buckets' collectives differently on two
ranks). With NCCL a wait only orders streams, so the backward still overlaps; with gloo
it waits on the CPU.

**FSDP2.** :func:`fsdp_reduce_policy` gives ``MixedPrecisionPolicy(param_dtype=<recipe's>,
reduce_dtype=<chosen>)``: BF16 halves the reduce-scatter's bytes, and FSDP2 sums in it
(BF16's range is FP32's, its precision 2^-9 relative per addition).
:func:`enable_fp8_reduce_scatter` sets FSDP2's custom reduce-scatter to steps 1-3 above
(FP8 on the wire, sum in FP32, into the reduce dtype's shard; no all-gather: the
gradients stay sharded), ``(N-1)/N · 1`` byte per element against ``(N-1)/N · 4``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from lowprec.core.bits import BYTE_FORMATS
from lowprec.core.formats import Format, get_format
from lowprec.core.rounding import to_format
from lowprec.core.scales import amax, compute_scale
from lowprec.recipes.presets import get_recipe
from lowprec.recipes.recipe import Recipe

__all__ = [
    "Bucket",
    "FP8CommState",
    "FP8ReduceScatter",
    "enable_fp8_reduce_scatter",
    "fp8_allreduce_hook",
    "fsdp_reduce_policy",
    "grad_divide_factor",
    "register_fp8_allreduce",
    "ring_bytes",
]

_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (all_gather_single is torch >= 2.10's name of all_gather_into_tensor)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ring_bytes(collective: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends in ``collective`` with ring algorithms, for an input of
    ``nbytes`` bytes per rank: ``"all_reduce"`` ``2(N-1)/N·nbytes``; ``"all_to_all"`` and
    ``"reduce_scatter"`` ``(N-1)/N·nbytes``; ``"all_gather"`` ``(N-1)·nbytes``."""
    n = world
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": float(n - 1),
    }
    if collective not in factors:
        raise ValueError(f"collective must be one of {sorted(factors)}, got {collective!r}")
    return factors[collective] * nbytes


class Bucket(Protocol):
    """What :func:`fp8_allreduce_hook` reads of DDP's ``GradBucket``: its flat buffer."""

    def buffer(self) -> Tensor: ...


def _check_fmt(fmt: object) -> Format:
    if not isinstance(fmt, (str, Format)):
        raise TypeError(f"fmt must be a format name or Format, got {type(fmt).__name__}")
    try:
        f = get_format(fmt, arg="fmt")
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith("fmt") else f"fmt: {msg}") from None
    if f not in BYTE_FORMATS:
        names = sorted(b.name for b in BYTE_FORMATS)
        raise ValueError(f"fmt must be a 1-byte float8 format {names}, got {f.name!r}")
    return f


def _check_divide_by(divide_by: object) -> float:
    if isinstance(divide_by, bool) or not isinstance(divide_by, (int, float)):
        raise TypeError(f"divide_by must be a number, got {type(divide_by).__name__}")
    if not (math.isfinite(divide_by) and divide_by > 0):
        raise ValueError(f"divide_by must be finite and > 0, got {divide_by}")
    return float(divide_by)


@dataclass
class FP8CommState:
    """State of :func:`fp8_allreduce_hook` (and of :class:`FP8ReduceScatter`).

    ``fmt``: a 1-byte float8 format; ``divide_by``: the hook's divisor of the sum
    (``None``: the group's size, a mean; under FSDP2, FSDP2's own divide factor applies
    instead); ``group``: the process group (``None``: the world; FSDP2 passes its own).
    ``bytes_sent`` counts what this rank sent (:func:`ring_bytes` of every collective,
    scalars included); ``last_scales`` holds the shared scales ``(s₁, s₂)`` of the last
    bucket (``s₂`` is NaN for a reduce-scatter), as a float32 tensor, for inspection.
    """

    fmt: Format | str = "e4m3fn"
    divide_by: float | None = None
    group: dist.ProcessGroup | None = None
    bytes_sent: float = 0.0
    last_scales: Tensor = field(default_factory=lambda: torch.full((2,), math.nan))

    def __post_init__(self) -> None:
        self.fmt = _check_fmt(self.fmt)
        if self.divide_by is not None:
            self.divide_by = _check_divide_by(self.divide_by)
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            kind = type(self.group).__name__
            raise TypeError(f"group must be a ProcessGroup or None, got {kind}")

    @property
    def world(self) -> int:
        """The size of the group."""
        return dist.get_world_size(self.group)


def _shared_scale(x: Tensor, state: FP8CommState) -> Tensor:
    """``compute_scale(max over ranks of x's largest finite magnitude, fmt)``: one
    ``all_reduce(MAX)`` of one float32 (gloo's MAX would drop a NaN, hence finite)."""
    a = amax(torch.where(torch.isfinite(x), x, 0.0)).reshape(1)
    dist.all_reduce(a, op=dist.ReduceOp.MAX, group=state.group)
    state.bytes_sent += ring_bytes("all_reduce", a.nbytes, state.world)
    return compute_scale(a[0], state.fmt)


def _encode(x: Tensor, scale: Tensor, fmt: Format) -> Tensor:
    """The bytes of ``to_format(x / scale, fmt, saturate=True)``."""
    return to_format(x / scale, fmt, saturate=True).view(torch.uint8)


def _decode(codes: Tensor, fmt: Format) -> Tensor:
    return codes.view(BYTE_FORMATS[fmt]).float()


def _reduce_scatter_fp8(x: Tensor, state: FP8CommState) -> tuple[Tensor, Tensor]:
    """Steps 1-3 of the module docstring for a float32 ``x`` whose size divides by N:
    this rank's segment ``s₁ · Σ_r q_r[rank]`` (float32, not yet divided) and ``s₁``."""
    fmt = _check_fmt(state.fmt)
    n = state.world
    s1 = _shared_scale(x, state)
    codes = _encode(x, s1, fmt)
    pieces = torch.empty_like(codes)
    dist.all_to_all_single(pieces, codes, group=state.group)
    state.bytes_sent += ring_bytes("all_to_all", codes.nbytes, n)
    return _decode(pieces, fmt).view(n, -1).sum(0) * s1, s1


def fp8_allreduce_hook(state: FP8CommState, bucket: Bucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: the bucket's gradients summed over the ranks and divided
    by ``state.divide_by`` (default ``N``), with FP8 on the wire (module docstring).

    Register with ``ddp.register_comm_hook(FP8CommState(fmt), fp8_allreduce_hook)`` or
    :func:`register_fp8_allreduce`. The bucket's dtype (FP32, BF16, FP16) is kept: the
    result is cast back into it.
    """
    fmt = _check_fmt(state.fmt)
    buf = bucket.buffer()
    n, world = buf.numel(), state.world
    x = buf.detach().reshape(-1).float()
    pad = -n % world
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    seg, s1 = _reduce_scatter_fp8(x, state)
    seg = seg / (state.divide_by if state.divide_by is not None else world)
    s2 = _shared_scale(seg, state)
    codes = _encode(seg, s2, fmt)
    out = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    _all_gather(out, codes, group=state.group)
    state.bytes_sent += ring_bytes("all_gather", codes.nbytes, world)
    state.last_scales = torch.stack([s1, s2]).detach()
    buf.copy_((_decode(out, fmt) * s2)[:n].view_as(buf))
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks a hook's annotations as objects; ``from __future__ import annotations`` made
# them strings (as in lowprec.distributed.parallel).
fp8_allreduce_hook.__annotations__.update(
    bucket=torch._C._distributed_c10d.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def grad_divide_factor(recipe: str | Recipe, world: int) -> float:
    """The divisor of the gradients' sum over ``world`` ranks for ``recipe``: ``√world``
    for unit recipes (their per-rank ``b^-1/2`` scaling, after one of lowprec's unit
    losses; after a mean loss of the user's own it is ``world^{3/2}``, which
    :func:`~lowprec.distributed.prepare` sets at each backward:
    :mod:`lowprec.distributed.unit_reduce`), else ``world`` (the mean)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    return math.sqrt(world) if get_recipe(recipe).unit is not None else float(world)


def register_fp8_allreduce(
    ddp_model: DistributedDataParallel,
    fmt: str | Format = "e4m3fn",
    *,
    divide_by: float | None = None,
) -> FP8CommState:
    """Make ``ddp_model`` all-reduce its gradients in FP8 (:func:`fp8_allreduce_hook`)
    and return the hook's state (``bytes_sent``, ``last_scales``).

    ``fmt``: ``"e4m3fn"`` (default: half the rounding error of E5M2, and a range of
    ``2^18.8`` below the bucket's largest gradient, subnormals included) or ``"e5m2"``
    (``2^32.8``: for buckets whose gradients spread wider), or another 1-byte float8
    format (``docs/distributed.md`` compares the two). ``divide_by``: the divisor of the
    sum, default the group's size (the mean DDP takes); :func:`grad_divide_factor` gives
    ``√N`` for a unit recipe, whose own ``sqrt(N)`` hook this replaces (DDP takes one
    hook, before the first backward).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"ddp_model must be a DistributedDataParallel, got {type(ddp_model).__name__}"
        )
    state = FP8CommState(fmt, divide_by, ddp_model.process_group)
    ddp_model.register_comm_hook(state, fp8_allreduce_hook)
    return state


def fsdp_reduce_policy(
    recipe: str | Recipe, reduce_dtype: torch.dtype | str = torch.bfloat16
) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for ``recipe`` that reduce-scatters the gradients
    in ``reduce_dtype``: FP32 (what :func:`lowprec.distributed.mixed_precision_policy`
    gives), BF16 (half the bytes; FP32's range, 8 significant bits per partial sum) or
    FP16 (half the bytes; FSDP2 then divides by about ``√N`` before and after the sum
    against overflow). The all-gather and compute dtype is the recipe's ``param_dtype``
    (none for FP32). ``"fp32"``/``"bf16"``/``"fp16"`` name the dtypes too."""
    if isinstance(reduce_dtype, str):
        if reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(
                f"reduce_dtype must be one of {sorted(_REDUCE_DTYPES)} or a torch dtype, "
                f"got {reduce_dtype!r}"
            )
        reduce_dtype = _REDUCE_DTYPES[reduce_dtype]
    if reduce_dtype not in _REDUCE_DTYPES.values():
        raise ValueError(
            f"reduce_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
            f"got {reduce_dtype!r}"
        )
    r = get_recipe(recipe)
    low = r.torch_dtype if r.param_dtype != "fp32" else None
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce_dtype)


class FP8ReduceScatter:
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) with FP8 on the
    wire: steps 1-3 of the module docstring. The input and output keep FSDP2's reduce
    dtype; the sum is formed in FP32 and written into the output shard. Only
    ``ReduceOp.SUM`` and ``AVG``: :func:`enable_fp8_reduce_scatter` makes FSDP2 divide
    after the sum (``set_force_sum_reduction_for_comms``)."""

    def __init__(self, state: FP8CommState) -> None:
        if not isinstance(state, FP8CommState):
            raise TypeError(f"state must be an FP8CommState, got {type(state).__name__}")
        self.state = state

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A buffer for FSDP2's reduce-scatter input or output."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        """Reduce-scatter ``input_tensor`` over ``group`` into ``output_tensor``."""
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"op: FP8ReduceScatter sums (SUM or AVG), got {op!r}")
        self.state.group = group
        seg, s1 = _reduce_scatter_fp8(input_tensor.detach().reshape(-1).float(), self.state)
        if op == dist.ReduceOp.AVG:
            seg = seg / self.state.world
        self.state.last_scales = torch.stack([s1, torch.full_like(s1, math.nan)]).detach()
        output_tensor.copy_(seg.view_as(output_tensor))


def enable_fp8_reduce_scatter(model: nn.Module, fmt: str | Format = "e4m3fn") -> FP8CommState:
    """Reduce-scatter the gradients of every ``fully_shard``-ed module of ``model`` in FP8
    (:class:`FP8ReduceScatter`, one shared state, returned). Call it after sharding.
    FSDP2's gradient divide factor still applies, after the FP32 sum (for unit recipes
    the ``√N`` that :func:`lowprec.distributed.shard` sets). ``fmt``: as
    :func:`register_fp8_allreduce`. Needs torch's ``set_custom_reduce_scatter``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("model: no fully_shard-ed module; shard it first")
    if not hasattr(units[0], "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"enable_fp8_reduce_scatter needs FSDPModule.set_custom_reduce_scatter "
            f"(a newer torch than {torch.__version__})"
        )
    state = FP8CommState(fmt)
    for m in units:
        m.set_custom_reduce_scatter(FP8ReduceScatter(state))  # type: ignore[arg-type]
        m.set_force_sum_reduction_for_comms(True)
    return state
