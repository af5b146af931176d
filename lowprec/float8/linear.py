"""``Float8Linear``: an ``nn.Linear`` whose three GEMMs run in a narrow format.

Forward ``y = Q(x) Q(W)ᵀ + b``; backward ``dx = Q(g) Q(W)``, ``dW = Q(g)ᵀ Q(x)``, where
``Q`` quantizes with the role's :class:`~lowprec.float8.CastConfig` (E4M3 for ``x`` and
``W``, E5M2 for ``g`` by default). The bias is added in the output dtype. Parameters stay in
their own dtype (the master copy); only the GEMM operands are narrow.

Scaling state (delayed ``amax`` histories, static calibration maxima) lives in buffers named
``<role>_amax_history`` / ``<role>_static_amax``, so ``state_dict()`` carries it next to the
original ``weight``/``bias`` keys and a resumed run continues exactly. A checkpoint of the
plain model (without those keys) still loads with ``strict=True``; the state then starts
fresh.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lowprec.core.scalers import delayed_amax, push_amax
from lowprec.core.scales import amax
from lowprec.float8.quant import Operand, dequantize, matmul, quantize_operand
from lowprec.float8.recipe import ROLES, CastConfig, Float8Recipe

__all__ = ["Float8Linear", "apply", "calibrate", "convert_back", "convert_to_float8"]

_EDTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Spec:
    """Everything the autograd function needs besides tensors (hashable, for compile)."""

    recipe: Float8Recipe
    update: bool  # record the grad_output amax in a delayed history
    calibrating: bool  # record the grad_output amax for static calibration


def _stateful_scale(
    cast: CastConfig, state: Tensor | None, t: Tensor, update: bool, calibrating: bool
) -> Tensor | None:
    """The scale of a delayed/static role (``None`` for dynamic), updating ``state`` in place."""
    if cast.scaling == "dynamic":
        return None
    if cast.scaling == "static" and cast.static_scale is not None:
        return torch.tensor(cast.static_scale, dtype=torch.float32, device=t.device)
    assert state is not None
    cur = amax(t)
    if cast.scaling == "delayed":
        scale = cast.scale_for(delayed_amax(state, cur, cast.algo))
        if update:
            state.copy_(push_amax(state, cur))
        return scale
    if calibrating:  # static: running max of amax while calibrating
        state.copy_(torch.maximum(state, torch.where(torch.isfinite(cur), cur, 0.0)))
    return cast.scale_for(state)


@torch.library.custom_op("lowprec::keep_for_backward", mutates_args=())
def _keep_for_backward(t: Tensor) -> Tensor:
    """A copy of ``t`` that ``torch.compile``'s partitioner must save, not recompute.

    Left to itself, AOTAutograd's min-cut partitioner keeps a wider intermediate and
    recomputes the FP8 cast in backward, which forfeits the memory saving. It does not
    recompute ops outside its allow-list, so passing the 1-byte tensor through this opaque
    op pins it as the saved value. Eager mode does not need (or use) it.
    """
    return t.clone()


@_keep_for_backward.register_fake
def _(t: Tensor) -> Tensor:
    return torch.empty_like(t)


def _retag(op: Operand, cd: int) -> Operand:
    """A tensor-scaled operand used transposed in another GEMM (same values, same scale)."""
    return Operand(op.data, op.scale, op.kind, cd, op.shape)


class _Float8MatmulFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        w: Tensor,
        x_scale: Tensor | None,
        w_scale: Tensor | None,
        go_state: Tensor | None,
        spec: _Spec,
        out_dtype: torch.dtype,
    ) -> Tensor:
        r = spec.recipe
        ed = _EDTYPE[r.emulation_dtype]
        xq = quantize_operand(x, r.input, 1, x_scale)
        wq = quantize_operand(w.t(), r.weight, 0, w_scale)
        y = matmul(xq, wq, out_dtype, ed, r.emulate)
        w_used = wq.scale if wq.kind == "tensor" else None
        if r.fp8_saved_activations:
            kept = _keep_for_backward(xq.data) if torch.compiler.is_compiling() else xq.data
            ctx.save_for_backward(None, kept, xq.scale, w, w_used)
        else:  # the forward's scale too: delayed/static scales must not become dynamic
            ctx.save_for_backward(x, None, xq.scale, w, w_used)
        # The grad_output state is updated in place in backward, so it is held on ctx, not
        # saved: a saved tensor modified in place fails autograd's version check when a
        # layer's backward runs twice in one graph (weight sharing, retain_graph).
        ctx.go_state = go_state
        ctx.spec, ctx.x_meta = spec, (xq.kind, xq.shape, x.dtype)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, xq_data, xq_scale, w, w_scale = ctx.saved_tensors
        go_state = ctx.go_state
        spec: _Spec = ctx.spec
        r = spec.recipe
        ed = _EDTYPE[r.emulation_dtype]
        x_kind, x_shape, x_dtype = ctx.x_meta
        g_scale = _stateful_scale(r.grad_output, go_state, g, spec.update, spec.calibrating)
        gq = quantize_operand(g, r.grad_output, 1, g_scale)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wq = quantize_operand(w, r.weight, 0, w_scale)
            dx = matmul(gq, wq, x_dtype, ed, r.emulate)
        if ctx.needs_input_grad[1]:
            if gq.kind == "tensor":
                gq_t = Operand(gq.data.t(), gq.scale, "tensor", 1, (gq.shape[1], gq.shape[0]))
            else:
                gq_t = quantize_operand(g.t(), r.grad_output, 1)
            if x is None:
                saved = Operand(xq_data, xq_scale, x_kind, 1, x_shape)
                if x_kind == "tensor":
                    xq = _retag(saved, 0)
                else:  # re-quantize along the token dimension (documented double rounding)
                    xq = quantize_operand(dequantize(saved), r.input, 0)
            else:  # tensor scale: the forward's (delayed/static/dynamic alike)
                xq = quantize_operand(x, r.input, 0, xq_scale if x_kind == "tensor" else None)
            dw = matmul(gq_t, xq, w.dtype, ed, r.emulate)
        return dx, dw, None, None, None, None, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` with float8 GEMMs (see the module docstring).

    Build it with :meth:`from_linear` or :func:`convert_to_float8`; it shares the
    parameters of the module it replaces.

    Example:
        >>> import torch
        >>> m = Float8Linear.from_linear(torch.nn.Linear(64, 32), "delayed")
        >>> m(torch.randn(8, 64)).shape
        torch.Size([8, 32])
        >>> sorted(k for k in m.state_dict() if "amax" in k)
        ['grad_output_amax_history', 'input_amax_history', 'weight_amax_history']
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: str | Float8Recipe = "tensorwise",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe)

    def _setup(self, recipe: str | Float8Recipe) -> None:
        if isinstance(recipe, str):
            recipe = Float8Recipe.from_name(recipe)
        if not isinstance(recipe, Float8Recipe):
            raise TypeError(
                f"recipe must be a Float8Recipe or a preset name, got {type(recipe).__name__}"
            )
        if not self.weight.dtype.is_floating_point:
            raise TypeError(f"weight must be floating point, got dtype {self.weight.dtype}")
        self.recipe = recipe
        self._calibrating = False
        self._calibrated = False
        dev = self.weight.device
        for role in ROLES:
            c = recipe.cast(role)
            if c.scaling == "delayed":
                self.register_buffer(f"{role}_amax_history", torch.zeros(c.history_len, device=dev))
            elif c.scaling == "static" and c.static_scale is None:
                self.register_buffer(f"{role}_static_amax", torch.zeros((), device=dev))
        self.register_load_state_dict_post_hook(_after_load)  # type: ignore[no-untyped-call]

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: str | Float8Recipe = "tensorwise") -> Float8Linear:
        """A ``Float8Linear`` sharing ``mod``'s parameters (no copy)."""
        if not isinstance(mod, nn.Linear):
            raise TypeError(f"mod must be an nn.Linear, got {type(mod).__name__}")
        if not mod.weight.dtype.is_floating_point:
            raise TypeError(f"mod.weight must be floating point, got dtype {mod.weight.dtype}")
        new = cls(mod.in_features, mod.out_features, mod.bias is not None, recipe, device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        new._setup(recipe)  # buffers on the parameters' device
        new.train(mod.training)
        _carry_hooks(mod, new)
        return new

    def _state(self, role: str) -> Tensor | None:
        for suffix in ("_amax_history", "_static_amax"):
            t = getattr(self, role + suffix, None)
            if isinstance(t, Tensor):
                return t
        return None

    @property
    def needs_calibration(self) -> bool:
        """True while a static role without ``static_scale`` has not been calibrated."""
        return not self._calibrated and any(
            self.recipe.cast(r).scaling == "static" and self.recipe.cast(r).static_scale is None
            for r in ROLES
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dim {x.shape[-1]} != in_features {self.in_features}")
        if self.needs_calibration and not self._calibrating:
            raise ValueError(
                "Float8Linear: the static recipe is used before calibration; run a few "
                "batches (forward and backward) inside `with lowprec.float8.calibrate(model):` "
                "or give CastConfig(static_scale=...)"
            )
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        x2d = x.reshape(-1, self.in_features)
        upd = self.training or self._calibrating
        r = self.recipe
        xs = _stateful_scale(r.input, self._state("input"), x2d, upd, self._calibrating)
        ws = _stateful_scale(r.weight, self._state("weight"), self.weight, upd, self._calibrating)
        with torch.autocast(dev, enabled=False):
            spec = _Spec(r, upd, self._calibrating)
            go = self._state("grad_output")
            y: Tensor = _Float8MatmulFn.apply(  # type: ignore[no-untyped-call]
                x2d, self.weight, xs, ws, go, spec, out_dtype
            )
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(out_dtype)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        missing: list[str] = args[2]
        own = {prefix + n for n, _ in self.named_buffers(recurse=False)}
        missing[:] = [k for k in missing if k not in own]  # plain checkpoints load: fresh state

    def extra_repr(self) -> str:
        r = self.recipe
        casts = ", ".join(f"{role}={r.cast(role).describe()}" for role in ROLES)
        return f"{super().extra_repr()}, recipe={r.name}, {casts}"


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """The replacement runs the hooks registered on the replaced module (the same dicts,
    so their handles still remove them)."""
    for name in _HOOK_DICTS:
        if hasattr(old, name):
            setattr(new, name, getattr(old, name))


def _after_load(module: nn.Module, incompatible: Any) -> None:
    assert isinstance(module, Float8Linear)
    static = [module._state(r) for r in ROLES if module.recipe.cast(r).scaling == "static"]
    ready = [t for t in static if t is not None and t.dim() == 0]
    if ready and all(bool(t > 0) for t in ready):
        module._calibrated = True


ModuleFilter = Callable[[nn.Module, str], bool]


def convert_to_float8(
    model: nn.Module,
    recipe: str | Float8Recipe = "tensorwise",
    module_filter: ModuleFilter | None = None,
) -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (in place) for a :class:`Float8Linear`.

    ``module_filter(module, fqn)`` returns True for the layers to convert (default: all).
    A linear used at several places becomes one ``Float8Linear`` used at all of them; its
    hooks carry over. Subclasses of ``nn.Linear`` and parametrized linears (e.g.
    ``weight_norm``) are left unchanged, named in a warning: their own forward would be lost.
    Returns ``model`` (or the new module if ``model`` itself is an ``nn.Linear``).

    Example:
        >>> import torch
        >>> nn = torch.nn
        >>> m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> m = convert_to_float8(m, "delayed", module_filter=lambda mod, fqn: fqn != "2")
        >>> [type(c).__name__ for c in m]
        ['Float8Linear', 'ReLU', 'Linear']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(recipe, str):
        recipe = Float8Recipe.from_name(recipe)
    if not isinstance(recipe, Float8Recipe):
        raise TypeError(f"recipe must be a Float8Recipe or name, got {type(recipe).__name__}")
    if module_filter is not None and not callable(module_filter):
        raise TypeError("module_filter must be a callable (module, fqn) -> bool")

    left: list[str] = []

    def wanted(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear) or isinstance(mod, Float8Linear):
            return False
        if module_filter is not None and not module_filter(mod, fqn):
            return False
        if type(mod) is not nn.Linear or parametrize.is_parametrized(mod):
            left.append(f"{fqn or 'the model'} ({type(mod).__name__})")
            return False  # its own forward or parametrization would be lost
        if not mod.weight.dtype.is_floating_point:
            raise TypeError(
                f"model: {fqn or 'the model'}.weight has dtype {mod.weight.dtype}; float8 "
                "conversion needs floating-point weights"
            )
        return True

    if wanted(model, ""):
        assert isinstance(model, nn.Linear)
        return Float8Linear.from_linear(model, recipe)
    done: dict[int, Float8Linear] = {}
    _convert_children(model, wanted, done, recipe)
    if left:
        log.warning(
            "convert_to_float8: left unchanged (nn.Linear subclasses or parametrized "
            "linears, whose own forward would be lost): %s",
            ", ".join(dict.fromkeys(left)),
        )
    return model


def apply(
    model: nn.Module,
    config: str | Float8Recipe = "tensorwise",
    module_filter: ModuleFilter | None = None,
) -> nn.Module:
    """The float8 technique's entry point: :func:`convert_to_float8` with ``config`` (a
    :class:`~lowprec.float8.Float8Recipe` or a preset name, see :func:`recipe_names`).

    Example:
        >>> import torch
        >>> m = apply(torch.nn.Sequential(torch.nn.Linear(32, 32)), "rowwise")
        >>> type(m[0]).__name__, m[0].recipe.name
        ('Float8Linear', 'rowwise')
    """
    return convert_to_float8(model, config, module_filter)


def _convert_children(
    model: nn.Module,
    wanted: Callable[[nn.Module, str], bool],
    done: dict[int, Float8Linear],
    recipe: Float8Recipe,
) -> None:  # a module used at several places stays one module
    for fqn, mod in list(model.named_modules(remove_duplicate=False)):
        for name, child in list(mod._modules.items()):
            full = f"{fqn}.{name}" if fqn else name
            if child is None:
                continue
            if id(child) in done:
                setattr(mod, name, done[id(child)])
            elif wanted(child, full):
                assert isinstance(child, nn.Linear)
                done[id(child)] = Float8Linear.from_linear(child, recipe)
                setattr(mod, name, done[id(child)])


def convert_back(model: nn.Module) -> nn.Module:
    """Replace every :class:`Float8Linear` by a plain ``nn.Linear`` sharing its parameters
    (the scaling state is dropped). Returns ``model`` (or the new module)."""

    def plain(m: Float8Linear) -> nn.Linear:
        new = nn.Linear(m.in_features, m.out_features, m.bias is not None, device="meta")
        new.weight, new.bias = m.weight, m.bias
        new.train(m.training)
        return new

    if isinstance(model, Float8Linear):
        return plain(model)
    done: dict[int, nn.Linear] = {}
    for mod in list(model.modules(remove_duplicate=False)):
        for name, child in list(mod._modules.items()):
            if isinstance(child, Float8Linear):
                if id(child) not in done:
                    done[id(child)] = plain(child)
                setattr(mod, name, done[id(child)])
    return model


@contextlib.contextmanager
def calibrate(model: nn.Module) -> Iterator[None]:
    """Calibrate the static roles of every ``Float8Linear`` in ``model``.

    Inside the block, forward (and backward, for a static ``grad_output``) passes record
    the running maximum of each static role's ``amax``; on exit the scales freeze. Roles
    that saw no data raise ``ValueError`` naming them.

    Example:
        >>> import torch
        >>> m = convert_to_float8(torch.nn.Linear(16, 16), "static")
        >>> with calibrate(m):
        ...     m(torch.randn(4, 16)).sum().backward()
        >>> float(m.input_static_amax) > 0
        True
    """
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    static = [m for m in layers if any(m.recipe.cast(r).scaling == "static" for r in ROLES)]
    if not static:
        raise ValueError("model: no Float8Linear with a static role to calibrate")
    for m in static:  # a new calibration starts from scratch (it may lower a scale)
        m._calibrating = True
        for r in ROLES:
            t = m._state(r)
            if t is not None and t.dim() == 0:
                t.zero_()
    try:
        yield
    finally:
        for m in static:
            m._calibrating = False
    names = {id(m): n for n, m in model.named_modules()}
    empty = [
        f"{names[id(m)] or 'model'}.{r}"
        for m in static
        for r in ROLES
        if (t := m._state(r)) is not None and t.dim() == 0 and not bool(t > 0)
    ]
    if empty:
        raise ValueError(
            f"calibrate: no data reached {empty}; run forward and backward (for grad_output) "
            "inside the calibrate block"
        )
    for m in static:
        m._calibrated = True
