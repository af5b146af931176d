r"""Data parallelism for every recipe: FSDP2 (``fully_shard``) or DDP, in the right order.

:func:`prepare` is :func:`lowprec.recipes.prepare` for a process group started by
``torchrun``. The order is fixed, and the only correct one:

1. **apply the technique** (unit scaling, scalify, the float8 conversion: the same
   :func:`lowprec.recipes.compose.apply` as on one process);
2. **shard** (``fully_shard`` on every block and the root, or wrap in
   ``DistributedDataParallel``): sharding replaces the parameters, so anything holding the
   old ones would train nothing;
3. **build the optimizer and the loss scaler** on the sharded parameters.

FSDP2 and precision. Under ``parallel="fsdp"`` the parameters stay FP32 and sharded: the
shards *are* the master weights. A recipe with ``param_dtype`` bf16/fp16 becomes FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=fp32)``: each block's
weights are all-gathered in the low-precision dtype just before its forward (and
backward), compute runs in it, and the gradients are reduce-scattered in FP32 into the
FP32 shards, which the optimizer updates. No rank ever holds an unsharded FP32 copy, and
no :class:`~lowprec.amp.MasterWeights` is built. The shards start from the initial
weights rounded to ``param_dtype``, as on one process, where the master copies start from
the cast model: the two runs then differ only by the rounding of the gradient sums.

DDP keeps the recipe exactly as on one process (low-precision parameters, FP32
``MasterWeights``, the loss scaler) and all-reduces the gradients in the parameters' dtype.

Lean training state (:mod:`lowprec.amp.lean`: ``bf16-sr``, ``bf16-remainder``,
``bf16-8bit``, ``fp8-lean``). Under FSDP2 a recipe without FP32 masters
(``master="none"`` with stochastic rounding, ``master="remainder"``) keeps its
parameters in ``param_dtype`` and shards them as they are: the BF16 shards are the
weights, there is no FP32 copy anywhere, the all-gather moves BF16 (no cast), and the
gradients are reduce-scattered in FP32 (``reduce_dtype``: the ranks' BF16 gradients are
summed in FP32, then rounded once to the BF16 gradient shard). The lean optimizer
updates each shard with its states sharded alike (``DTensor``\ s; 8-bit blocks along
rows, so a shard's codes and scales are those of one process; stochastic rounding with
the draws of the whole tensor: see :mod:`lowprec.amp.lean`). ``bf16-8bit`` (FP32
masters) keeps FSDP2's FP32 shards as masters and updates them with 8-bit states. Under
DDP the optimizer is the one-process one on every replica. In both modes the
stochastic-rounding generator is broadcast from rank 0 at :func:`prepare`, so every rank
draws the same numbers (DDP replicas stay identical; FSDP2 shards round as one process).

Unit recipes: the gradient of a unit-scaled weight is its per-token contributions summed
over the ``b`` tokens of the batch and scaled by ``b^-1/2``. On ``N`` ranks each rank
scales by ``(b/N)^-1/2``, so the plain average over ranks would not be the one-process
gradient (Adam hides the factor, but its moments would not carry over to another world
size, and SGD would take other steps). The ranks' gradients are therefore summed and
divided by ``sqrt(N)`` where the loss is one of lowprec's unit losses, and by ``N^{3/2}``
where it is the user's own mean loss (FSDP2's gradient divide factor; a DDP communication
hook; chosen at each backward: :mod:`lowprec.distributed.unit_reduce`), which gives the
one-process gradient. A unit MoE layer's expert ``e`` sums over the ``n_e`` tokens routed
to it, a count that differs between ranks: its experts share their counts over the group
(:func:`lowprec.unit.moe.share_token_counts`).

Example (one process here; under ``torchrun`` the group has N):
    >>> import tempfile
    >>> import torch.distributed as dist
    >>> from lowprec.jobs.model import CharGPT, ModelConfig
    >>> store = dist.FileStore(tempfile.mktemp(), 1)
    >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    >>> p = prepare(CharGPT(ModelConfig(width=32, depth=1, heads=2)), "bf16", parallel="fsdp")
    >>> w = p.model.head.weight
    >>> type(w).__name__, w.dtype, type(p.optimizer).__name__
    ('DTensor', torch.float32, 'AdamW')
    >>> from lowprec.distributed import shutdown
    >>> shutdown()  # gc, then destroy_process_group() (see shutdown)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from lowprec.amp import lean_optimizer
from lowprec.distributed.float8_fsdp import enable_fp8_all_gather, fp8_weights_updated
from lowprec.distributed.grad_comm import (
    enable_fp8_reduce_scatter,
    fsdp_reduce_policy,
    grad_divide_factor,
    register_fp8_allreduce,
)
from lowprec.distributed.scaling_sync import attach_scaling_sync
from lowprec.distributed.unit_reduce import UnitDivisor
from lowprec.recipes import compose
from lowprec.recipes.prepared import OptimizerFactory, Prepared, build_optimizer, factory_lr
from lowprec.recipes.presets import get_recipe
from lowprec.recipes.recipe import Recipe
from lowprec.unit.moe import share_token_counts

__all__ = [
    "GRAD_COMM",
    "PARALLEL",
    "GradComm",
    "Parallel",
    "fsdp_units",
    "mixed_precision_policy",
    "prepare",
    "shard",
    "sync_generators",
]

Parallel = Literal["fsdp", "ddp"]
PARALLEL: tuple[str, ...] = ("fsdp", "ddp")
GradComm = Literal["fp32", "bf16", "fp8"]
GRAD_COMM: tuple[str, ...] = ("fp32", "bf16", "fp8")


def _check_parallel(parallel: object) -> str:
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {list(PARALLEL)}, got {parallel!r}")
    return str(parallel)


def _check_group() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "lowprec.distributed: no process group; start the script with torchrun and call "
            "torch.distributed.init_process_group() (or lowprec.distributed.init()) first"
        )


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`shard` wraps in ``fully_shard`` before the root: every child of
    every ``nn.ModuleList`` (a transformer's blocks, HF models' ``layers``), outermost first.
    Each is all-gathered on its own, just before it runs, and freed after."""
    units: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            units += [c for c in m if not any(c is u for u in units)]
    return units


def mixed_precision_policy(recipe: str | Recipe) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``recipe``: all-gather and compute in its ``param_dtype`` (none
    for FP32), reduce-scatter the gradients in FP32."""
    r = get_recipe(recipe)
    low = r.torch_dtype if r.param_dtype != "fp32" else None
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def _lean_shards(r: Recipe) -> bool:
    """Whether FSDP2 shards ``r``'s parameters in ``param_dtype`` (a lean recipe without
    FP32 masters) rather than as FP32 masters."""
    return r.policy.lean and r.policy.master_kind != "fp32"


def _check_recipe(r: Recipe, parallel: str) -> None:
    if parallel != "fsdp":
        return
    if r.stochastic_rounding and r.policy.master_kind == "fp32":
        raise ValueError(
            f"recipe: {r.name!r} rounds master weights stochastically; under FSDP2 the "
            "FP32 shards are cast by the all-gather (round to nearest); use parallel='ddp'"
        )


def shard(
    model: nn.Module,
    recipe: str | Recipe,
    parallel: Parallel,
    *,
    mesh: DeviceMesh | None = None,
    units: Callable[[nn.Module], Iterable[nn.Module]] = fsdp_units,
    ddp_kwargs: dict[str, Any] | None = None,
    fp8_all_gather: bool | Literal["blocks"] = True,
    grad_comm: GradComm = "fp32",
) -> nn.Module:
    """Step 2 of the order (see the module docstring): shard ``model``, to which the
    recipe's technique has already been applied.

    ``"fsdp"``: the parameters are rounded to ``param_dtype`` and kept in FP32 (kept in
    ``param_dtype`` for a lean recipe without FP32 masters: module docstring), then
    ``fully_shard(unit, mesh=mesh, mp_policy=mixed_precision_policy(recipe))`` for each of
    ``units(model)`` and the root; returns ``model`` itself (now an ``FSDPModule``).
    ``"ddp"``: returns ``DistributedDataParallel(model, **ddp_kwargs)``.

    With a float8 recipe, the scaling state (delayed amax histories, calibration maxima)
    is reduced with MAX over the ranks after every backward
    (:func:`lowprec.distributed.scaling_sync.attach_scaling_sync`), so every rank uses
    the same scales; under FSDP2 the eligible float8 weights are all-gathered in FP8
    (:func:`lowprec.distributed.float8_fsdp.enable_fp8_all_gather`; ``fp8_all_gather=False``
    gathers them in ``param_dtype``; ``"blocks"`` also gathers the row-local block layouts
    narrow, with ``blocks=True``).

    ``grad_comm``: the gradients' reduction on the wire (:mod:`lowprec.distributed.grad_comm`):
    ``"fp32"`` (default), ``"bf16"`` (DDP: the gradients divided, rounded to BF16 and
    all-reduced in BF16; FSDP2: ``reduce_dtype=bfloat16``), ``"fp8"`` (E4M3, the
    module's default, with shared scales, every sum in FP32: DDP's
    :func:`~lowprec.distributed.grad_comm.register_fp8_allreduce`, FSDP2's
    :func:`~lowprec.distributed.grad_comm.enable_fp8_reduce_scatter`). Unit recipes keep
    their ``√N`` divisor with every choice.
    """
    _check_group()
    r = get_recipe(recipe)
    mode = _check_parallel(parallel)
    _check_recipe(r, mode)
    if grad_comm not in GRAD_COMM:
        raise ValueError(f"grad_comm must be one of {list(GRAD_COMM)}, got {grad_comm!r}")
    if fp8_all_gather not in (True, False, "blocks"):
        raise ValueError(f"fp8_all_gather must be True, False or 'blocks', got {fp8_all_gather!r}")
    if mode == "ddp" and fp8_all_gather == "blocks":
        raise ValueError(
            "fp8_all_gather='blocks' applies to FSDP2's weight all-gather; DDP gathers no "
            "weights (its replicas hold them whole): leave fp8_all_gather at its default"
        )
    if mode == "fsdp":
        master = torch.float32 if not _lean_shards(r) else r.torch_dtype
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():  # the master copy starts from the cast weights
                    p.data = p.data.to(r.torch_dtype).to(master)
    if r.float8 is not None:
        attach_scaling_sync(model)
        if mode == "fsdp" and fp8_all_gather:
            enable_fp8_all_gather(model, blocks=fp8_all_gather == "blocks")
    if r.unit is not None:  # unit experts: gradients from every rank's token counts
        dp_group = (ddp_kwargs or {}).get("process_group") if mode == "ddp" else None
        if mode == "fsdp" and mesh is not None:
            dp_group = mesh.get_group()
        share_token_counts(model, dp_group)
    if mode == "ddp":
        ddp = DistributedDataParallel(model, **(ddp_kwargs or {}))
        group = (ddp_kwargs or {}).get("process_group")
        world = dist.get_world_size(group)
        if grad_comm == "fp8":
            state = register_fp8_allreduce(ddp, divide_by=grad_divide_factor(r, world))
            if r.unit is not None:  # the divisor follows the loss (unit_reduce)
                UnitDivisor(world, lambda f: setattr(state, "divide_by", f)).attach(model)
        elif grad_comm == "bf16" or r.unit is not None:
            low = torch.bfloat16 if grad_comm == "bf16" else None
            hook_state = [grad_divide_factor(r, world), group, low]
            ddp.register_comm_hook(hook_state, _scaled_allreduce)
            if r.unit is not None:
                UnitDivisor(world, lambda f: hook_state.__setitem__(0, f)).attach(model)
        return ddp
    policy = mixed_precision_policy(r) if grad_comm != "bf16" else fsdp_reduce_policy(r, "bf16")
    # scalify: the Scalified wrapper is the one unit (a module sharded inside it would
    # gather parameters that bypass scaled arithmetic).
    for unit in units(model) if r.scalify is None else ():
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if r.unit is not None:  # the one-process gradient of unit scaling: see the module docstring
        n = mesh.size() if mesh is not None else dist.get_world_size()
        pg = mesh.get_group() if mesh is not None else None
        premul = dist.get_backend(pg) == "nccl"  # gloo has no PREMUL_SUM: SUM, then divide
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in sharded:
            m.set_gradient_divide_factor(grad_divide_factor(r, n))
            m.set_force_sum_reduction_for_comms(not premul)

        def divide_by(f: float) -> None:
            for m in sharded:
                m.set_gradient_divide_factor(f)

        UnitDivisor(n, divide_by).attach(model)
    if grad_comm == "fp8":
        enable_fp8_reduce_scatter(model)
    return model


def _scaled_allreduce(state: list[Any], bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the gradients divided by ``state[0]`` (``N`` for the mean;
    for unit recipes as the loss asks, see the module docstring), then summed over the ranks of
    the group ``state[1]``, in the bucket's dtype or in ``state[2]`` (BF16: the bucket is
    rounded to it, summed in it, and written back)."""
    factor, group, low = state
    buf: torch.Tensor = bucket.buffer()
    t = buf.div_(factor) if low is None else buf.div(factor).to(low)
    fut: torch.futures.Future[list[torch.Tensor]] = dist.all_reduce(
        t, group=group, async_op=True
    ).get_future()

    def back(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = f.value()[0]
        return out if out is buf else buf.copy_(out)

    return fut.then(back)


# DDP checks a hook's annotations as objects; ``from __future__ import annotations`` made
# them strings.
_scaled_allreduce.__annotations__.update(
    bucket=torch._C._distributed_c10d.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def prepare(
    model: nn.Module,
    recipe: str | Recipe,
    parallel: Parallel,
    optimizer_factory: OptimizerFactory | None = None,
    generator: torch.Generator | None = None,
    *,
    mesh: DeviceMesh | None = None,
    units: Callable[[nn.Module], Iterable[nn.Module]] = fsdp_units,
    ddp_kwargs: dict[str, Any] | None = None,
    fp8_all_gather: bool | Literal["blocks"] = True,
    grad_comm: GradComm = "fp32",
    param_groups: Callable[[nn.Module, list[Any]], list[Any]] | None = None,
    sync_module_states: bool = False,
) -> Prepared:
    """:func:`lowprec.recipes.prepare` under ``torch.distributed``: apply the technique,
    shard (:func:`shard`), then build the optimizer and the loss scaler on the sharded
    parameters. Every rank calls it with the same model (same seed) and arguments.

    ``parallel``: ``"fsdp"`` (FSDP2, FP32 sharded masters or lean shards, see the module
    docstring) or ``"ddp"``. ``generator``: the stochastic-rounding generator (recipes
    that round stochastically), broadcast from rank 0. ``mesh``: FSDP2's device mesh
    (default: every rank). ``units``: the modules sharded before the root (default
    :func:`fsdp_units`). ``ddp_kwargs``: extra arguments of ``DistributedDataParallel``.
    ``fp8_all_gather``, ``grad_comm``: see :func:`shard`. ``param_groups``: as for
    :func:`lowprec.recipes.prepare`, on the sharded parameters. ``sync_module_states``:
    after the technique and before sharding, every parameter and buffer is broadcast from
    the group's first rank (DDP does so itself), so ranks whose models differ (weights
    loaded on rank 0 only; a u-μP conversion, which draws its init from torch's global
    generator, on ranks with different generator states) start from rank 0's model.
    u-μP parameter groups (unit recipes) keep their ``lr_mult`` on the sharded parameters.
    Under ``"fsdp"`` the returned :class:`~lowprec.recipes.Prepared` has a plain or lean
    optimizer (no ``MasterWeights``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    mode = _check_parallel(parallel)
    _check_group()
    r = get_recipe(recipe)
    _check_recipe(r, mode)
    if not isinstance(sync_module_states, bool):
        raise TypeError(f"sync_module_states must be a bool, got {sync_module_states!r}")
    factory = optimizer_factory or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    lr = factory_lr(factory) if r.unit is not None else 0.0
    # 1. the technique (as on one process)
    model, groups = compose.apply(
        model, r.technique, r.torch_dtype, lr, r.float8_skip, r.layers, r.name
    )
    if sync_module_states:
        pg = mesh.get_group() if mesh is not None and mode == "fsdp" else None
        if mode == "ddp":
            pg = (ddp_kwargs or {}).get("process_group")
        src = dist.get_global_rank(pg, 0) if pg is not None else 0
        with torch.no_grad():
            for t in itertools.chain(model.parameters(), model.buffers()):
                dist.broadcast(t.data, src=src, group=pg)
    names = {id(p): n for n, p in model.named_parameters()}
    named_groups = (
        [{**g, "params": [names[id(p)] for p in g["params"]]} for g in groups]
        if groups is not None
        else None
    )
    # 2. shard
    wrapped = shard(
        model,
        r,
        mode,  # type: ignore[arg-type]
        mesh=mesh,
        units=units,
        ddp_kwargs=ddp_kwargs,
        fp8_all_gather=fp8_all_gather,
        grad_comm=grad_comm,
    )
    # 3. optimizer and scaler, on the parameters sharding left
    now = dict(model.named_parameters())
    params: list[Any]
    if named_groups is not None:
        params = [{**g, "params": [now[n] for n in g["params"]]} for g in named_groups]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    if param_groups is not None:
        params = param_groups(model, params)
    optimizer: Any
    if mode == "ddp" or _lean_shards(r):  # as on one process (on the shards: lean)
        optimizer = build_optimizer(params, factory, r.policy, generator)
    elif r.policy.optimizer_state != "auto":  # the FP32 shards are the masters
        optimizer = lean_optimizer(factory(params), state=r.policy.state_precision,
                                   generator=generator)  # fmt: skip
    else:
        optimizer = factory(params)
    if mode == "fsdp" and r.float8 is not None and fp8_all_gather:
        # foreach/fused optimizer kernels leave the shards' version counters alone: the
        # FP8 all-gather's scales are refreshed after every step (float8_fsdp)
        optimizer.register_step_post_hook(lambda *_: fp8_weights_updated(model))
    group = mesh.get_group() if mesh is not None and mode == "fsdp" else None
    if mode == "ddp":
        group = (ddp_kwargs or {}).get("process_group")
    sync_generators(optimizer, group)
    return Prepared(wrapped, optimizer, r.policy.make_scaler(), r)


def sync_generators(optimizer: Any, group: Any = None) -> int:
    """Broadcast the state of ``optimizer``'s stochastic-rounding generator (a lean
    optimizer's or ``MasterWeights``' ``generator``, also of its inner ``optimizer``) from
    the group's first rank to every rank of ``group`` (default: all), so that every rank
    draws the same numbers; the number of generators synchronised."""
    n = 0
    for obj in (optimizer, getattr(optimizer, "optimizer", None)):
        gen = getattr(obj, "generator", None)
        if not isinstance(gen, torch.Generator):
            continue
        state = gen.get_state()
        backend = str(dist.get_backend(group))
        on = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else None
        buf = state.to(on) if on is not None else state.clone()
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(buf, src=src, group=group)
        gen.set_state(buf.cpu())
        n += 1
    return n


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (else ``model`` itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
