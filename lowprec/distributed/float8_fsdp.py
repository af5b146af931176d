"""FP8 all-gather of :class:`~lowprec.float8.Float8Linear` weights under FSDP2 (``fully_shard``).

FSDP2 all-gathers a parameter's shards before each forward (and, with
``reshard_after_forward``, again before backward). Without help it gathers the FP32 (or
``MixedPrecisionPolicy.param_dtype``) master shards, 4 (2) bytes per element, and every
rank then casts the whole weight to FP8 itself. :func:`enable_fp8_all_gather` wraps each
eligible ``Float8Linear.weight`` in :class:`Float8AllGatherWeight`, a tensor subclass that
implements FSDP2's extension points:

* ``fsdp_pre_all_gather``: quantize the local shard ``W_r`` with the scale ``s`` of the
  *whole* weight and hand FSDP the 1-byte payload ``Q(W_r / s)`` (as ``uint8``);
* ``fsdp_post_all_gather``: view the gathered bytes as FP8 and return the unsharded
  weight as a :class:`~lowprec.core.tensor.ScaledTensor` ``(Q(W / s), s)``, which
  ``Float8Linear`` uses as its weight operand without quantizing again.

Because ``s`` is the same on every rank and rounding is elementwise,
``concat_r Q(W_r / s) = Q(W / s)``: the gathered weight is bit-identical to the one a
single process quantizes, so the three GEMMs see the same operands.

**One batched all-reduce per step.** ``s = amax(W) · 2^margin / fmt.max`` (dynamic) or the
delayed scaler's scale from its history and ``amax(W)`` (delayed) needs the global
``amax(W) = max_r amax(W_r)``. At the first all-gather after the weights changed (the
optimizer step bumps each shard's version counter) the local ``amax`` of *every* wrapped
weight on that mesh is stacked into one tensor and reduced with a single
``all_reduce(MAX)``; all scales are then cached until the weights change again, so the
re-gather in backward reuses the forward's scale. The foreach and fused kernels of
``torch.optim`` (``foreach=True``, CUDA's default; ``fused=True``, the HF ``Trainer``'s)
update DTensor shards without bumping their version counter: :func:`fp8_weights_updated`
marks the weights changed, and :func:`lowprec.distributed.prepare` calls it after every
optimizer step (a step post-hook), so no call by the user is needed. For a delayed weight
the global ``amax`` is recorded in ``weight_amax_history`` once per weight update in
training mode (as a single process records it once per forward).

**Which layouts gather in the narrow format.** Tensor-wise weights with ``dynamic`` or
``delayed`` scaling (the presets ``tensorwise``, ``delayed``, ``static`` — whose weight is
dynamic) always do, as above: one payload serves all three GEMMs, bit-exactly.

With ``enable_fp8_all_gather(model, blocks=True)`` the *row-local* block layouts gather
narrow too: row-wise (``axis``), ``1xB`` blocks and MX (``mx:32``) weights, whose forward
scales (along the contracted ``K`` = in-features) each cover part of one row of ``W``,
and ``RxB`` tiles (``128x128``) when every shard's row count is a multiple of ``R``.
FSDP2 shards dim 0 (rows), so each rank quantizes its own rows, ``Q_K(W_r)`` — the rows of
``Q_K(W)``, with no collective — and gathers the payload (1 byte per element; E2M1 codes
two per byte) and its scales (float32; MX scales as 1-byte E8M0). After the gather the
weight is dequantized, ``W~ = deq(Q_K(W))`` in ``param_dtype``, and handed to
``Float8Linear`` as a plain tensor. Quantizing ``W~`` along ``K`` again gives back
``Q_K(W)``: the forward operand is that of a high-precision gather (with a BF16
``param_dtype`` a float32 row/block scale recomputed from BF16 values can move by an ulp;
MX's power-of-two scales cannot). The input-gradient
GEMM contracts the *out*-features, so it quantizes ``W~`` along ``N``: a second rounding
of that operand (at most one step of the format per element) which a high-precision
gather does not have — except for ``RxB`` tiles, the same tiles in both orientations.
Hence ``blocks`` is off by default.

**MoE experts.** The 3-D expert weights of a :class:`~lowprec.float8.Float8Experts`
(sharded on dim 0, the experts) gather in FP8 with one scale per expert, joined to the
same all-reduce: :mod:`~lowprec.distributed.fsdp_experts`.

Gathered in ``param_dtype`` (one WARNING naming the reason): static weights; ``nv:16``
(NVFP4's second-level per-tensor scale needs the global ``amax``); ``RxB`` tiles whose
shards do not hold a multiple of ``R`` rows; block weights whose rows do not divide evenly
over the ranks (FSDP2 requires every all-gather input of an unevenly sharded parameter to
have the padded shard's shape, which a scale tensor has not).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map_only

from lowprec.core.formats import get_format
from lowprec.core.granularity import Granularity
from lowprec.core.rounding import storage_dtype, to_format
from lowprec.core.tensor import ScaledTensor, register_rule
from lowprec.core.warn import warn_once
from lowprec.distributed import fsdp_blocks, fsdp_experts
from lowprec.float8.conv1d import Float8Conv1D
from lowprec.float8.experts import Float8Experts
from lowprec.float8.linear import Float8Linear

__all__ = [
    "Float8AllGatherWeight",
    "enable_fp8_all_gather",
    "fp8_all_gather_eligible",
    "fp8_all_gather_layout",
    "fp8_weights_updated",
]

log = logging.getLogger(__name__)
aten = torch.ops.aten
_DOMAIN = "float8_fsdp"
_TENSOR = Granularity.from_name("tensor")

# Ops whose results stay wrapped: what FSDP2 does to a parameter while sharding, padding,
# moving and copying it. Every other op sees the plain master tensor.
_PRESERVE = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.slice.Tensor,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.narrow.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
}


@dataclass(eq=False)
class _Slot:
    """What every shard/view of one wrapped weight shares: its layer and scale cache."""

    layer: weakref.ref[Any]  # its Float8Linear or Float8Experts
    # "tensor": one global scale; "blocks": row-local block scales; "experts": one per expert
    mode: str = "tensor"
    param: str = "weight"  # the parameter's name in its module
    sharded: weakref.ref[DTensor] | None = None  # FSDP's sharded parameter
    key: tuple[int, int, bool] | None = None  # (id, version, training) the scale is for
    scale: Tensor | None = None


@dataclass(eq=False)
class _Group:
    """The wrapped weights of one :func:`enable_fp8_all_gather` call (a model)."""

    slots: list[_Slot] = field(default_factory=list)
    reductions: int = 0  # all-reduces issued (for tests and the benchmark)
    param_dtype: torch.dtype | None = None  # FSDP2's MixedPrecisionPolicy.param_dtype


class Float8AllGatherWeight(Tensor):
    """A ``Float8Linear`` weight (or a ``Float8Experts`` expert weight) that FSDP2
    all-gathers in FP8 (see the module docstring).

    It wraps the master tensor (``._hp``) and behaves like it: every op but the few FSDP2
    uses to shard and copy parameters runs on the plain master tensor and returns plain
    tensors; in-place ops (the optimizer's) update the master tensor.
    """

    _hp: Tensor
    _slot: _Slot
    _group: _Group

    @staticmethod
    def __new__(cls, hp: Tensor, slot: _Slot, group: _Group) -> Float8AllGatherWeight:
        out: Float8AllGatherWeight = Tensor._make_wrapper_subclass(
            cls,
            hp.shape,
            strides=hp.stride(),
            storage_offset=hp.storage_offset(),
            dtype=hp.dtype,
            device=hp.device,
            layout=hp.layout,
            requires_grad=hp.requires_grad,
        )
        out._hp, out._slot, out._group = hp, slot, group
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Float8AllGatherWeight({self._hp!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Saved (torch.save, pickle, deepcopy's fallback) as the plain tensor it wraps: a
        # gathered weight on one process (``full_tensor()`` of a one-rank shard is this
        # wrapper) is its values; the FSDP2 hooks it carries do not outlive the run.
        return self._hp.__reduce_ex__(protocol)  # type: ignore[no-untyped-call]

    def numpy(self, *, force: bool = False) -> Any:
        """The wrapped tensor's ``numpy()``."""
        return self._hp.numpy(force=force)

    def __tensor_flatten__(self) -> tuple[list[str], tuple[_Slot, _Group]]:
        return ["_hp"], (self._slot, self._group)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], meta: tuple[_Slot, _Group], size: Any, stride: Any
    ) -> Float8AllGatherWeight:
        return Float8AllGatherWeight(inner["_hp"], *meta)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # the first wrapper, also inside the tensor lists of foreach and fused optimizer ops
        # (torch.optim's fused AdamW, which the HF Trainer chooses on the CPU too)
        first = next(
            (a for a in tree_leaves((args, kwargs or {})) if isinstance(a, Float8AllGatherWeight)),
            None,
        )
        assert first is not None
        slot, group = first._slot, first._group
        unwrap = tree_map_only(Float8AllGatherWeight, lambda t: t._hp, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        if func in _PRESERVE:
            return tree_map_only(Tensor, lambda t: Float8AllGatherWeight(t, slot, group), out)
        if func._schema.name.endswith("_") and isinstance(args[0], Float8AllGatherWeight):
            return args[0]  # in place: the wrapper stays the handle
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # ---- FSDP2 extension points ----------------------------------------------------------
    def fsdp_pre_all_gather(
        self,
        mesh: DeviceMesh,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[Tensor, ...], Any]:
        layer = self._slot.layer()
        if layer is None:
            raise RuntimeError("Float8AllGatherWeight: its float8 module no longer exists")
        if self._slot.mode == "blocks":
            return fsdp_blocks.pre_gather(self._hp, layer, mesh, outer_size, mp_policy)
        w = getattr(layer, self._slot.param)  # sharded: FSDP installs the gathered one later
        if isinstance(w, DTensor) and w._local_tensor is self:
            self._slot.sharded = weakref.ref(w)
        # FSDP2's MixedPrecisionPolicy: quantize the weight as it would have been gathered
        # (rounded to param_dtype first), so the FP8 payload equals that of an HP gather.
        pd = getattr(mp_policy, "param_dtype", None)
        self._group.param_dtype = pd
        scale = _scale_for(self._slot, self._group, mesh)
        hp = self._hp if pd is None else self._hp.to(pd)
        if self._slot.mode == "experts":
            fmt = layer.grouped_recipe.cast("weight").fmt
            return fsdp_experts.pre_gather(hp, scale, fmt, mesh, outer_size)
        cast = layer.recipe.weight
        rows = -(-int(outer_size[0]) // mesh.size())  # FSDP pads every shard to this
        if hp.shape[0] != rows:
            padded = hp.new_zeros((rows, *hp.shape[1:]))
            padded[: hp.shape[0]] = hp
            hp = padded
        data = to_format(hp / scale.reshape(1, 1), cast.fmt, saturate=True)
        return (data.view(torch.uint8),), ("tensor", scale, cast.fmt)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        if metadata[0] == "experts":
            return fsdp_experts.post_gather(all_gather_outputs, metadata, param_dtype, out)
        if metadata[0] != "tensor":
            return fsdp_blocks.post_gather(all_gather_outputs, metadata, param_dtype, out)
        (raw,) = all_gather_outputs
        _, scale, fmt = metadata
        data = raw.view(storage_dtype(fmt))
        if out is not None:  # a re-gather into the same storage: only the scale may move
            assert isinstance(out, ScaledTensor)
            out.scale.copy_(scale)
            return None
        st = ScaledTensor._wrap(data, scale, param_dtype, get_format(fmt).name, _DOMAIN, _TENSOR)
        return st, (data,)


@register_rule(aten.as_strided.default, domain=_DOMAIN)
def _as_strided(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    """FSDP2 views the gathered weight at its unpadded size: the data is viewed, the
    tensor-wise scale is kept."""
    x: ScaledTensor = args[0]
    return ScaledTensor._wrap(func(x.qdata, *args[1:], **kwargs), x.scale, *x._meta())


def _sharded_of(slot: _Slot) -> DTensor:
    """FSDP's sharded parameter of a wrapped weight: the one last gathered, else the
    layer's parameter (not gathered yet, so still sharded)."""
    d = slot.sharded() if slot.sharded is not None else None
    if d is None:
        layer = slot.layer()
        w = None if layer is None else getattr(layer, slot.param)
        if isinstance(w, DTensor) and isinstance(w._local_tensor, Float8AllGatherWeight):
            d = w
    if d is None:
        raise RuntimeError(
            "Float8AllGatherWeight: a wrapped weight is not sharded; call fully_shard after "
            "enable_fp8_all_gather on every rank"
        )
    return d


def _key(d: DTensor, layer: nn.Module) -> tuple[int, int, bool]:
    # The optimizer's in-place updates bump the sharded parameter's version counter.
    return (id(d), d._version, layer.training)


def _scale_for(slot: _Slot, group: _Group, mesh: DeviceMesh) -> Tensor:
    """The scale of ``slot``'s whole weight, refreshing every scale of its group with one
    ``all_reduce(MAX)`` of the stacked local ``amax`` values when any weight changed."""
    layer = slot.layer()
    assert layer is not None
    if slot.scale is not None and slot.key == _key(_sharded_of(slot), layer):
        return slot.scale
    _refresh(group, mesh)
    assert slot.scale is not None
    return slot.scale


def _refresh(group: _Group, mesh: DeviceMesh) -> None:
    """Recompute the scale of every live weight of ``group``: one ``all_reduce(MAX)`` of
    the linears' ``amax`` and the experts' per-expert ``amax`` vectors
    (:func:`~lowprec.distributed.fsdp_experts.local_amax`) concatenated."""
    live = [s for s in group.slots if s.layer() is not None and s.mode in ("tensor", "experts")]
    shards = [_sharded_of(s) for s in live]
    parts = []
    for s, d in zip(live, shards, strict=True):
        h = d._local_tensor._hp  # type: ignore[attr-defined]
        if s.mode == "experts":
            dim0 = any(getattr(p, "dim", None) == 0 for p in d.placements)
            parts.append(fsdp_experts.local_amax(h, d.shape[0], dim0, mesh))
        else:
            z = h.new_zeros(1, dtype=torch.float32)
            parts.append(h.detach().abs().amax().float().reshape(1) if h.numel() else z)
    amaxes = torch.cat(parts)
    if group.param_dtype is not None:  # amax(round(W)) = round(amax(W)): rounding is monotonic
        amaxes = amaxes.to(group.param_dtype).float()
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=mesh.get_group())
    group.reductions += 1
    split = torch.split(amaxes, [p.numel() for p in parts])
    for s, d, a in zip(live, shards, split, strict=True):
        m = s.layer()
        assert m is not None
        if s.mode == "experts":  # (E,) scales: dynamic or delayed per expert
            scale = m.weight_scales(s.param, a)
        else:
            scale = m.role_scale("weight", amax=a[0])  # dynamic or delayed (eligible layers)
        assert scale is not None
        s.scale = scale
        s.key = _key(d, m)


def _plain_state_dict(module: nn.Module, sd: dict[str, Any], prefix: str, meta: Any) -> None:
    """``state_dict()`` holds the master weights themselves (plain tensors, or DTensors of
    plain local shards, sharing storage): checkpoints (``torch.save``, DCP) never see the
    wrapper, and a checkpoint loads into a model with or without FP8 all-gather."""
    for name in module._parameters:
        key = prefix + name
        v = sd.get(key)
        if isinstance(v, DTensor) and isinstance(v._local_tensor, Float8AllGatherWeight):
            sd[key] = DTensor.from_local(
                v._local_tensor._hp,
                v.device_mesh,
                v.placements,
                run_check=False,
                shape=v.shape,
                stride=v.stride(),
            )
        elif isinstance(v, Float8AllGatherWeight):
            sd[key] = v._hp


def fp8_all_gather_eligible(layer: Float8Linear) -> bool:
    """True when ``layer``'s weight can be all-gathered in its narrow format: tensor
    granularity with dynamic or delayed scaling (see the module docstring); not a
    :class:`~lowprec.float8.conv1d.Float8Conv1D` weight, which the GEMMs read transposed
    (a gathered FP8 weight has no transpose: GPT-2 under FSDP2 failed at its first forward)."""
    if isinstance(layer, Float8Conv1D):
        return False
    c = layer.recipe.weight
    return c.bound_granularity(0).kind == "tensor" and c.scaling in ("dynamic", "delayed")


def fp8_all_gather_layout(layer: Float8Linear, blocks: bool = True) -> str | None:
    """How FSDP2 gathers ``layer``'s weight after :func:`enable_fp8_all_gather`:
    ``"tensor"`` (FP8 and one global scale), ``"blocks"`` (the narrow payload and row-local
    block scales, when the shards allow it at gather time) or ``None`` (its own dtype).
    ``blocks``: the argument given to :func:`enable_fp8_all_gather`."""
    if fp8_all_gather_eligible(layer):
        return "tensor"
    tensor = layer.recipe.weight.bound_granularity(1).kind == "tensor"
    return "blocks" if blocks and not tensor and fsdp_blocks.block_reason(layer) is None else None


def enable_fp8_all_gather(model: nn.Module, *, blocks: bool = False) -> int:
    """Make FSDP2 all-gather ``model``'s ``Float8Linear`` weights (and ``Float8Experts``'
    expert weights: :mod:`~lowprec.distributed.fsdp_experts`) in FP8.

    Call it on every rank after converting to float8 and before ``fully_shard``. Eligible
    weights (:func:`fp8_all_gather_eligible`; experts:
    :func:`~lowprec.distributed.fsdp_experts.experts_reason` is ``None``, whatever
    ``blocks``) are wrapped in :class:`Float8AllGatherWeight`;
    with ``blocks=True`` so are the row-local block layouts (row-wise, ``1xB``, MX, ``RxB``
    tiles; :func:`fp8_all_gather_layout`), whose input-gradient GEMM then sees a second
    rounding of the weight (module docstring). The others are left alone (gathered in their
    own dtype) and named in one WARNING. Idempotent. Returns the number of weights wrapped
    by this call.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(blocks, bool):
        raise TypeError(f"blocks must be a bool, got {type(blocks).__name__}")
    group = _Group()
    skipped: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, Float8Experts):
            _wrap_experts(m, name, group, skipped)
            continue
        if not isinstance(m, Float8Linear):
            continue
        w = m.weight
        if isinstance(w, DTensor):
            raise ValueError(
                f"model: {name or 'model'}.weight is already a DTensor; call "
                "enable_fp8_all_gather before fully_shard"
            )
        if isinstance(w, Float8AllGatherWeight):
            continue
        mode = fp8_all_gather_layout(m, blocks)
        if mode is None:
            why = fsdp_blocks.block_reason(m) if blocks else None
            desc = m.recipe.weight.describe() + (f": {why}" if why else "")
            skipped.append(f"{name or 'model'} ({desc})")
            continue
        slot = _Slot(weakref.ref(m), mode)
        group.slots.append(slot)
        m.weight = nn.Parameter(
            Float8AllGatherWeight(w.detach(), slot, group), requires_grad=w.requires_grad
        )
        m.register_state_dict_post_hook(_plain_state_dict)  # type: ignore[no-untyped-call]
    if skipped:
        kinds = sorted({s.split(" ", 1)[1] for s in skipped})
        warn_once(
            log,
            f"float8-fsdp-skip:{blocks}:{','.join(kinds)}",
            "enable_fp8_all_gather: weights gathered in their own dtype (%s): %s",
            "see fp8_all_gather_layout"
            if blocks
            else "only tensor-wise dynamic or delayed weights are gathered in FP8 unless "
            "blocks=True",
            ", ".join(skipped),
        )
    return len(group.slots)


def _wrap_experts(m: Float8Experts, name: str, group: _Group, skipped: list[str]) -> None:
    """Wrap the expert weights of ``m`` (or name it in ``skipped`` with the reason)."""
    names = fsdp_experts.expert_weight_names(m)
    wrapped = [n for n in names if isinstance(m._parameters[n], Float8AllGatherWeight)]
    for n in names:
        w = m._parameters[n]
        if isinstance(w, DTensor):
            raise ValueError(
                f"model: {name or 'model'}.{n} is already a DTensor; call "
                "enable_fp8_all_gather before fully_shard"
            )
    why = fsdp_experts.experts_reason(m)
    if why is not None:
        skipped.append(f"{name or 'model'} (experts {why})")
        return
    for n in names:
        w = m._parameters[n]
        if n in wrapped or w is None:
            continue
        slot = _Slot(weakref.ref(m), "experts", n)
        group.slots.append(slot)
        m._parameters[n] = nn.Parameter(
            Float8AllGatherWeight(w.detach(), slot, group), requires_grad=w.requires_grad
        )
    if not wrapped:
        m.register_state_dict_post_hook(_plain_state_dict)  # type: ignore[no-untyped-call]


def _wrapped(model: nn.Module) -> list[Float8AllGatherWeight]:
    """The local wrappers of ``model``'s FP8-gathered weights (linears and experts)."""
    out: list[Float8AllGatherWeight] = []
    for m in model.modules():
        if not isinstance(m, Float8Linear | Float8Experts):
            continue
        for w in m._parameters.values():
            local = w._local_tensor if isinstance(w, DTensor) else w
            if isinstance(local, Float8AllGatherWeight):
                out.append(local)
    return out


def fp8_weights_updated(model: nn.Module) -> int:
    """Mark every FP8-gathered weight of ``model`` as changed (after an optimizer step):
    the next all-gather recomputes the scales (one ``all_reduce(MAX)``), even when the
    update did not bump the shards' version counters (module docstring). Returns the
    number of weights marked."""
    n = 0
    for local in _wrapped(model):
        local._slot.key = None
        n += 1
    return n


def fp8_all_gather_reductions(model: nn.Module) -> int:
    """How many scale all-reduces the FP8 all-gather of ``model`` has issued so far
    (one per weight update once every weight has been gathered)."""
    groups = {id(w._group): w._group for w in _wrapped(model)}
    return sum(g.reductions for g in groups.values())
