"""Tensor and sequence parallelism for ``Float8Linear``, with the FP8 all-gather of a
sequence-sharded input.

``Float8Linear`` composes with torch's own ``ColwiseParallel``, ``RowwiseParallel`` and
``SequenceParallel`` as they are: it computes its FP8 GEMMs on the local shards with the
scales of the whole tensors (see :mod:`lowprec.distributed.float8_dtensor`).

With sequence parallelism the input of a column-parallel linear is sharded along the
sequence and must be all-gathered first. ``ColwiseParallel`` gathers it in its own dtype
(4 bytes per element in FP32). :class:`Float8ColwiseParallel` gathers it in FP8 when the
layer's input cast is tensor-wise: every rank quantizes its shard ``x_r`` with the scale
``s`` of the whole input (from ``max_r amax(x_r)``, one ``all_reduce(MAX)``; a delayed
role's history and a frozen static scale give the same ``s`` on every rank), all-gathers
the 1-byte payloads, and hands the layer the :class:`~lowprec.core.tensor.ScaledTensor`
``(Q(x / s), s)``: the operand one process would have quantized, bit for bit. In backward
the input gradient's partial sums are reduce-scattered back to the sequence shards, as
``ColwiseParallel`` does. Other inputs (non tensor-wise casts, a static role being
calibrated, an input that is not sequence-sharded) take ``ColwiseParallel``'s path.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel

from lowprec.core.autograd import apply_fn
from lowprec.core.granularity import Granularity
from lowprec.core.rounding import to_format
from lowprec.core.scalers import StaticScaler
from lowprec.core.tensor import ScaledTensor, register_rule
from lowprec.distributed.amax import mesh_amax
from lowprec.float8.linear import Float8Linear

__all__ = ["Float8ColwiseParallel", "fp8_gather_input"]

aten = torch.ops.aten
_DOMAIN = "float8_tp"
_TENSOR = Granularity.from_name("tensor")


@register_rule(aten.view.default, aten._unsafe_view.default, domain=_DOMAIN)
def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    """A gathered input is reshaped to 2-D for the GEMM: the data is viewed, the
    tensor-wise scale is kept."""
    x: ScaledTensor = args[0]
    return ScaledTensor._wrap(func(x.qdata, *args[1:], **kwargs), x.scale, *x._meta())


def _input_scale(layer: Float8Linear, x_local: Tensor, mesh: DeviceMesh) -> Tensor | None:
    """The scale of the whole input (identical on every rank), or ``None`` when the
    layer's input cast cannot be gathered in FP8 now."""
    if layer.recipe.input.bound_granularity(1).kind != "tensor":
        return None
    sc = layer.scaler("input")
    if isinstance(sc, StaticScaler) and not sc.frozen:
        return None  # calibrating: the layer records the gathered input itself
    # The scale (and the delayed record) one process makes of the whole input.
    return layer.role_scale("input", amax=mesh_amax(x_local, mesh))


class _GatherFP8(torch.autograd.Function):
    """Forward: quantize the local shard with ``scale``, all-gather the payload along
    ``dim``. Backward: reduce-scatter the input gradient's partial sums along ``dim``."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, scale: Tensor, fmt: str, mesh: DeviceMesh, dim: int
    ) -> ScaledTensor:
        ctx.mesh, ctx.dim = mesh, dim
        q = to_format(x / scale, fmt, saturate=True)
        shards = DTensor.from_local(q.view(torch.uint8), mesh, [Shard(dim)], run_check=False)
        data = shards.full_tensor().view(q.dtype)
        return ScaledTensor._wrap(data, scale, x.dtype, fmt, _DOMAIN, _TENSOR)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        partial_sums = DTensor.from_local(g, ctx.mesh, [Partial()], run_check=False)
        local = partial_sums.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local()
        return local, None, None, None, None


def fp8_gather_input(layer: Float8Linear, x: Tensor, mesh: DeviceMesh, dim: int) -> Tensor:
    """``x`` (this rank's shard along ``dim``) all-gathered in FP8 as a ScaledTensor when
    ``layer``'s input cast allows, else gathered in its own dtype (a plain tensor)."""
    scale = _input_scale(layer, x, mesh)
    if scale is None:
        full = DTensor.from_local(x, mesh, [Shard(dim)], run_check=False)
        out: Tensor = full.redistribute(mesh, [Replicate()]).to_local()
        return out
    gathered: ScaledTensor = apply_fn(_GatherFP8, x, scale, layer.recipe.input.fmt, mesh, dim)
    return gathered


class Float8ColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` whose sequence-sharded input (``input_layouts=Shard(d)``) is
    all-gathered in FP8 for a ``Float8Linear`` with a tensor-wise input cast (see the
    module docstring). Any other module or layout behaves as ``ColwiseParallel``.

    Example (inside ``parallelize_module``'s plan, after ``SequenceParallel`` norms):
    ``"mlp.up": Float8ColwiseParallel(input_layouts=Shard(1))``.
    """

    @staticmethod
    def _prepare_fp8_input(
        input_layouts: Any,
        desired_input_layouts: Any,
        mod: nn.Module,
        inputs: Any,
        device_mesh: DeviceMesh,
    ) -> Any:
        x = inputs[0]
        layout = input_layouts[0]
        if isinstance(x, DTensor):
            layout = x.placements[0]
            x = x.to_local()
        if (
            not isinstance(mod, Float8Linear)
            or not isinstance(layout, Shard)
            or device_mesh.ndim != 1
            or layout.dim % max(x.dim(), 1) == x.dim() - 1
        ):
            return ColwiseParallel._prepare_input_fn(  # type: ignore[no-untyped-call]
                input_layouts, desired_input_layouts, mod, inputs, device_mesh
            )
        return fp8_gather_input(mod, x, device_mesh, layout.dim % x.dim())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, Float8Linear):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            partial(self._prepare_fp8_input, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )
