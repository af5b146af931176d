"""``Float8Linear``: an ``nn.Linear`` whose three GEMMs run in a narrow format.

Forward ``y = Q(x) Q(W)ᵀ + b``; backward ``dx = Q(g) Q(W)``, ``dW = Q(g)ᵀ Q(x)``, where
``Q`` quantizes with the role's :class:`~lowprec.float8.CastConfig` (E4M3 for ``x`` and
``W``, E5M2 for ``g`` by default). The bias is added in the output dtype. Parameters stay in
their own dtype (the master copy); only the GEMM operands are narrow.

Delayed and static roles are scaled by the core scalers
(:class:`~lowprec.core.scalers.DelayedScaler`, :class:`~lowprec.core.scalers.StaticScaler`),
whose state (``amax`` histories, static calibration maxima) is held in the module's buffers
``<role>_amax_history`` / ``<role>_static_amax`` (tensors, reducible across ranks), so
``state_dict()`` carries it next to the original ``weight``/``bias`` keys and a resumed run
continues exactly. A checkpoint of the
plain model (without those keys) still loads with ``strict=True``; the state then starts
fresh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lowprec.core.autograd import apply_fn, apply_outside_graph
from lowprec.core.hadamard import fqn_key
from lowprec.core.scalers import AmaxReducer, DelayedScaler, StaticScaler
from lowprec.core.scales import amax as tensor_wide_amax
from lowprec.core.tensor import ScaledTensor
from lowprec.float8.carry import _carry_extras, _carry_hooks
from lowprec.float8.config import ROLES, CastConfig, Float8Config
from lowprec.float8.gemms import (
    Float8MatmulFn,
    GemmSpec,
    HistoryScaler,
    block_scaled,
    role_scale,
)
from lowprec.float8.mm import autocast_off
from lowprec.float8.replay import ForwardReplay, recomputing

__all__ = ["Float8Linear", "LinearFn", "WeightForward", "register_weight_forward"]

_SUFFIXES = ("_amax_history", "_static_amax")  # a role's scaling-state buffer


def _make_scaler(cast: CastConfig, state: Tensor | None) -> HistoryScaler | None:
    """The core scaler of a delayed/static role over its buffer ``state`` (None: dynamic)."""
    kw: dict[str, Any] = {"margin": cast.margin, "power_of_two": cast.power_of_two}
    if cast.scaling == "delayed":
        return DelayedScaler(cast.fmt, cast.history_len, cast.algo, amax_history=state, **kw)
    if cast.scaling == "static":
        if cast.static_scale is not None:
            return StaticScaler(cast.fmt, cast.static_scale, **kw)
        return StaticScaler(cast.fmt, calibration_steps=None, calib_amax=state, **kw)
    return None


class LinearFn(Protocol):
    """``linear_fn(x, w, b, *, matmul)``: a linear's maths around its product, which it
    computes with ``matmul(x', w') = x' w'ᵀ`` (e.g. :func:`lowprec.unit.functional.linear`)."""

    def __call__(
        self,
        x: Tensor,
        w: Tensor,
        b: Tensor | None,
        /,
        *,
        matmul: Callable[[Tensor, Tensor], Tensor],
    ) -> Tensor: ...


class Float8Linear(nn.Linear):
    """``nn.Linear`` with float8 GEMMs (see the module docstring).

    :attr:`linear_fn` (default ``None``: ``y = gemm(x, W) + b``) injects the layer's GEMM
    into other linear maths: with ``layer.linear_fn = lowprec.unit.functional.linear`` the
    layer computes the unit-scaled linear whose product ``x' W'ᵀ`` is this layer's float8
    GEMM (:meth:`gemm`, with the layer's scaling state); that is how a recipe composes unit
    scaling with float8.

    Build it with :meth:`from_linear` or :func:`~lowprec.float8.convert_to_float8`; it shares the
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
        recipe: str | Float8Config = "tensorwise",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._setup(recipe)

    def _setup(self, recipe: str | Float8Config) -> None:
        if isinstance(recipe, str):
            recipe = Float8Config.from_name(recipe)
        if not isinstance(recipe, Float8Config):
            raise TypeError(
                f"recipe must be a Float8Config or a preset name, got {type(recipe).__name__}"
            )
        if not self.weight.dtype.is_floating_point:
            raise TypeError(f"weight must be floating point, got dtype {self.weight.dtype}")
        self.recipe = recipe
        self.linear_fn: LinearFn | None = None
        self._calibrating = False
        self._calibrate_eval = True  # calibrate(training_only=True) sets it False
        dev = self.weight.device
        self._scalers: dict[str, HistoryScaler] = {}
        for role in ROLES:
            c = recipe.cast(role)
            if c.scaling == "delayed":
                self.register_buffer(f"{role}_amax_history", torch.zeros(c.history_len, device=dev))
            elif c.scaling == "static" and c.static_scale is None:
                self.register_buffer(f"{role}_static_amax", torch.zeros((), device=dev))
            sc = _make_scaler(c, self._state(role))
            if sc is not None:
                self._scalers[role] = sc
        if recipe.stochastic:  # (layer key, step counter) of the stochastic-rounding streams
            self.register_buffer("rng_state", torch.zeros(2, dtype=torch.int64, device=dev))
        # what each training forward used, for its recomputation (activation checkpointing):
        # only where a forward reads and advances state (delayed x/W scales, the streams)
        self._replay = ForwardReplay()
        self._replays = recipe.stochastic or any(
            isinstance(self._scalers.get(role), DelayedScaler) for role in ("input", "weight")
        )
        self.register_load_state_dict_post_hook(_after_load)  # type: ignore[no-untyped-call]

    def _bind_state(self) -> None:
        """Point each scaler at its buffer again (``.to()``/``.cuda()`` and ``assign=True``
        loads replace buffer tensors)."""
        for role, sc in self._scalers.items():
            t = self._state(role)
            if isinstance(sc, DelayedScaler):
                sc.amax_history = t
            elif not sc.given:
                sc.calib_amax = t

    def scaling_state(self) -> dict[str, Tensor]:
        """This layer's scaling state by buffer name (``<role>_amax_history``,
        ``<role>_static_amax``): the buffer tensors themselves, not copies."""
        return {n: self._buffers[n] for n in self.scaling_buffers()}  # type: ignore[misc]

    def bind_scaling_state(self, tensors: dict[str, Tensor]) -> None:
        """Replace scaling buffers (names of :meth:`scaling_state`) by the given tensors and
        point the scalers at them: distributed code that keeps a rank-local copy of a buffer
        (e.g. the local tensor of a DTensor buffer). Shapes must match. The scales of
        calibrated static roles are recomputed from the bound maxima where they were frozen.
        """
        own = set(self.scaling_buffers())
        for name, t in tensors.items():
            if name not in own:
                raise ValueError(
                    f"tensors: {name!r} is not a scaling buffer; expected {sorted(own)}"
                )
            old = self._buffers[name]
            if not isinstance(t, Tensor) or old is None or t.shape != old.shape:
                shape = None if old is None else tuple(old.shape)
                raise ValueError(f"tensors[{name!r}]: expected a tensor of shape {shape}")
            self._buffers[name] = t
        self._bind_state()
        self.refresh_static_scales()

    def refresh_static_scales(self) -> None:
        """Recompute every frozen calibrated static scale from its calibration maximum
        (after that maximum was changed in place, e.g. reduced across ranks)."""
        for sc in self._scalers.values():
            if isinstance(sc, StaticScaler) and sc.frozen and not sc.given:
                sc.freeze()

    def calibrated_scalers(self) -> list[StaticScaler]:
        """The static scalers that calibrate (no given scale), in role order."""
        return [s for s in self._scalers.values() if isinstance(s, StaticScaler) and not s.given]

    def _apply(self, fn: Any, recurse: bool = True) -> Float8Linear:
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``, ...), except that the
        scaling state keeps its float32 dtype: it moves device with the module but is
        never cast (an amax history in BF16 would round every recorded maximum)."""
        order = list(self._buffers)
        state = {n: self._buffers.pop(n) for n in self.scaling_buffers()}
        try:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        finally:
            for n, b in state.items():
                if b is not None:
                    moved = fn(b)
                    if moved.dtype != b.dtype:  # a dtype cast: move the float32 values only
                        moved = b.to(device=moved.device)
                    state[n] = moved
            self._buffers = {n: state[n] if n in state else self._buffers[n] for n in order}
        self._bind_state()
        return self

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: str | Float8Config = "tensorwise") -> Float8Linear:
        """A ``Float8Linear`` sharing ``mod``'s parameters (no copy). Whatever else ``mod``
        holds (child modules such as a LoRA-style adapter, other parameters and buffers)
        is kept under the same names, and its hooks carry over."""
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
        _carry_extras(mod, new, {"weight", "bias"})
        return new

    def set_rng_key(self, fqn: str) -> None:
        """Key this layer's stochastic-rounding streams by its fully-qualified name
        (:func:`lowprec.core.hadamard.fqn_key`; :func:`~lowprec.float8.apply` calls it), so
        that layers draw independent streams; no-op for a recipe without stochastic casts.
        The key and the step counter are the ``rng_state`` buffer (``state_dict``: a
        resumed run draws on as the uninterrupted one)."""
        rng = self._buffers.get("rng_state")
        if rng is not None:
            with torch.no_grad():
                rng[0] = fqn_key(fqn)

    def scaling_buffers(self) -> list[str]:
        """The names of the buffers that hold this layer's scaling state (delayed amax
        histories, static calibration maxima)."""
        return [n for n in (f"{r}{sfx}" for r in ROLES for sfx in _SUFFIXES) if n in self._buffers]

    def _gemm_weight(self) -> Tensor:
        """The weight as the GEMMs read it, ``(out_features, in_features)``; a layer that
        stores it transposed (:class:`~lowprec.float8.conv1d.Float8Conv1D`) returns a view."""
        return self.weight

    def _state(self, role: str) -> Tensor | None:
        for suffix in _SUFFIXES:
            t = getattr(self, role + suffix, None)
            if isinstance(t, Tensor):
                return t
        return None

    def scaler(self, role: str) -> HistoryScaler | None:
        """The core scaler of a delayed or static ``role`` (``None`` for a dynamic one)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self._scalers.get(role)

    @property
    def needs_calibration(self) -> bool:
        """True while a static role without ``static_scale`` has not been calibrated."""
        return any(isinstance(s, StaticScaler) and not s.frozen for s in self._scalers.values())

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() == 0:
            raise ValueError(f"x: expected shape (..., in_features={self.in_features}), got 0-dim")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dim {x.shape[-1]} != in_features {self.in_features}")
        if self.needs_calibration and not self._calibrating:
            raise ValueError(
                "Float8Linear: the static recipe is used before calibration; run a few "
                "batches (forward and backward) inside `with lowprec.float8.calibrate(model):` "
                "or give CastConfig(static_scale=...)"
            )
        w = self._gemm_weight()
        for cls, weight_forward in _WEIGHT_FORWARDS:  # e.g. DTensor: lowprec.distributed
            if isinstance(w, cls):
                if self.linear_fn is not None:
                    raise TypeError(
                        f"Float8Linear: a {cls.__name__} weight runs its own forward, which "
                        f"does not take linear_fn={self.linear_fn!r} (e.g. unit scaling + "
                        "float8 under tensor parallelism is not supported)"
                    )
                return weight_forward(self, x, w)
        if self.linear_fn is not None:  # the GEMM injected into the given linear maths
            return self.linear_fn(x, w, self.bias, matmul=self.gemm)
        y = self.gemm(x, w)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def role_scale(
        self, role: str, t: Tensor | None = None, *, amax: Tensor | None = None
    ) -> Tensor | None:
        """The scale the GEMM would give ``role``'s tensor ``t`` — or a tensor whose
        (whole, already reduced) ``amax`` is given — updating the role's scaling state as
        the GEMM does (delayed: recorded in training and calibration; static: recorded
        while calibrating). ``None`` for a dynamic role without ``amax`` (the GEMM computes
        it from the tensor). For distributed code that quantizes an operand before the GEMM
        (an FP8 all-gather) and hands it over as a :class:`~lowprec.core.tensor.ScaledTensor`.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if t is None and amax is None:
            raise TypeError("role_scale: give the tensor t or its amax=")
        return role_scale(
            self._scalers.get(role),
            self.recipe.cast(role),
            t,
            update=self.training or self._recording(),
            calibrating=self._recording(),
            amax=amax,
        )

    def _recording(self) -> bool:
        """Whether this forward records static maxima: inside :func:`calibrate`, in any
        mode, or only in training mode where the calibration is a training one (a
        recipe's calibration on its first batches: an evaluation then records nothing)."""
        return self._calibrating and (self.training or self._calibrate_eval)

    def gemm(
        self, x: Tensor, w: Tensor, reduce: AmaxReducer | None = None, sharded: str = ""
    ) -> Tensor:
        """``Q(x) Q(w)ᵀ`` (no bias) of local tensors, shape ``(..., w.shape[0])``; ``w`` is
        ``(out_features, in_features)``. Either operand may arrive quantized as a
        :class:`~lowprec.core.tensor.ScaledTensor` (its scaler is then not run).

        ``sharded``: the roles among ``"xwg"`` (input, weight, grad_output) whose local
        tensors are shards of a larger tensor, and ``reduce`` the
        :data:`~lowprec.core.scalers.AmaxReducer` over their ranks: their tensor-wise scales
        (dynamic, delayed and static alike) use the ``amax`` of the whole tensor, so each
        shard is quantized as one process quantizes the whole tensor.
        """
        if sharded and reduce is None:
            raise ValueError("sharded: roles are sharded but no reduce is given")
        if set(sharded) - set("xwg"):
            raise ValueError(f"sharded must hold letters of 'xwg', got {sharded!r}")
        dev = x.device.type
        amp = dev != "meta" and torch.is_autocast_enabled(dev)  # meta: no autocast, shapes only
        out_dtype = torch.get_autocast_dtype(dev) if amp else x.dtype
        x2d = x.reshape(-1, x.shape[-1])
        cal = self._recording()
        upd = self.training or cal
        # a recomputation (activation checkpointing) uses its forward's scales and streams
        # and records nothing (lowprec.float8.replay); backward records grad_output once
        again = self._replays and recomputing(self.training)
        keep = self._replays and self.training and not torch.compiler.is_compiling()
        key = _input_key(x2d) if keep else None
        used = self._replay.take(key) if again and key is not None else None
        r = self.recipe
        go_sc = self._scalers.get("grad_output")
        xr = reduce if "x" in sharded else None
        wr = reduce if "w" in sharded else None
        gr = reduce if "g" in sharded else None
        own = bool(r.gemms or r.hadamard)  # GEMMs that take their own tensor-wise scales
        spec = GemmSpec(r, upd, cal, go_sc, gr, xr if own else None, wr if own else None)
        kw: dict[str, Any] = {"update": upd and not again, "calibrating": cal}
        # An FP8-gathered operand (lowprec.distributed) arrives quantized, its scaler run.
        xs = ws = None
        if used is not None:
            xs, ws, step = used
        else:
            if not isinstance(x2d, ScaledTensor):
                sc = self._scalers.get("input")
                # the key is the amax a delayed scaler of its own would compute: one pass
                mine = isinstance(sc, DelayedScaler) and sc.reducer is None and xr is None
                xa = key if mine else None
                xs = role_scale(sc, r.input, x2d, reduce=xr, amax=xa, **kw)
            if not isinstance(w, ScaledTensor):
                ws = role_scale(self._scalers.get("weight"), r.weight, w, reduce=wr, **kw)
        rng = self._buffers.get("rng_state")
        if key is not None and not again:
            self._replay.save(key, (xs, ws, None if rng is None else rng.clone()))
        elif used is not None and step is not None:
            rng = step  # the streams of the forward recomputed
        # A frozen static grad_output scale is known now; otherwise backward computes it
        # from the state threaded through the function (an input, for torch.compile).
        gs = go_sc.scale if isinstance(go_sc, StaticScaler) and go_sc.frozen else None
        go = self._state("grad_output")
        args = (x2d, w, xs, ws, gs, go, spec, out_dtype, rng)
        with autocast_off(dev):
            # MX and NVFP4 linears, stochastic rounding (seeded generators) and Hadamard
            # transforms run outside torch.compile's graph: inductor's CPU code generation
            # fails on the block quantize graphs (AssertionError in its loop tiling, torch
            # 2.13, e.g. an HF Llama in bf16), and a break inside the function made the
            # resumed frames trace the recipe's block sizes as symbols once two block
            # formats had been compiled. (go is state: only x and W are inputs.)
            if block_scaled(r) or r.stochastic or r.hadamard:
                y: Tensor = apply_outside_graph(Float8MatmulFn, *args)
            else:
                y = apply_fn(Float8MatmulFn, *args, inputs=(0, 1))
        if rng is not None and self.training and not again:  # the next call: the next streams
            with torch.no_grad():
                rng[1] += 1
        return y.reshape(*x.shape[:-1], w.shape[0])

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, _ in self.named_buffers(recurse=False):  # amax state: finite and >= 0
            t = state_dict.get(prefix + name)
            if isinstance(t, Tensor) and t.device.type != "meta" and t.is_floating_point():
                if not bool((torch.isfinite(t) & (t >= 0)).all()):
                    raise ValueError(
                        f"state_dict[{prefix + name!r}] must be finite and >= 0 (an amax), "
                        f"got {t.flatten()[:4].tolist()}"
                    )
        super()._load_from_state_dict(state_dict, prefix, *args)
        self._bind_state()
        missing: list[str] = args[2]
        own = {prefix + n for n, _ in self.named_buffers(recurse=False)}
        missing[:] = [k for k in missing if k not in own]  # plain checkpoints load: fresh state

    def extra_repr(self) -> str:
        # The casts per role, then formats per GEMM and high-precision GEMMs if any:
        # e.g. ``..., weight_grad=[grad_output=dyn:nv:16:e2m1, input=dyn:nv:16:e2m1]``.
        return f"{super().extra_repr()}, recipe={self.recipe.name}, {self.recipe.describe()}"


def _input_key(x: Tensor) -> Tensor:
    """The key a forward is kept by for its recomputation: its input's ``amax``."""
    # an operand that arrives quantized (an FP8 gather): its payload, read as float32
    t = x.qdata.float() if isinstance(x, ScaledTensor) else x
    return tensor_wide_amax(t.detach(), "tensor").float()


def _after_load(module: nn.Module, incompatible: Any) -> None:
    """A loaded calibration (every static maximum > 0) freezes the static scalers at it."""
    assert isinstance(module, Float8Linear)
    static = module.calibrated_scalers()
    if static and all(s.calib_amax is not None and bool(s.calib_amax > 0) for s in static):
        for s in static:
            s.freeze()


WeightForward = Callable[[Float8Linear, Tensor, Tensor], Tensor]
"""``forward(layer, x, w)``: a ``Float8Linear``'s whole forward (bias included) for a weight
of a tensor subclass that the local GEMM cannot take as is (a DTensor under tensor
parallelism); it computes through the layer's public :meth:`Float8Linear.gemm`."""

_WEIGHT_FORWARDS: list[tuple[type, WeightForward]] = []


def register_weight_forward(cls: type, forward: WeightForward) -> None:
    """Make every :class:`Float8Linear` whose GEMM weight is an instance of ``cls`` run
    ``forward(layer, x, w)`` instead of its own forward (registering ``cls`` again
    replaces its forward). This is how :mod:`lowprec.distributed` runs the layer on
    DTensor weights; ``lowprec.float8`` itself knows no tensor subclass but
    :class:`~lowprec.core.tensor.ScaledTensor`."""
    if not isinstance(cls, type) or not issubclass(cls, Tensor):
        raise TypeError(f"cls must be a subclass of torch.Tensor, got {cls!r}")
    if not callable(forward):
        raise TypeError(f"forward must be callable, got {type(forward).__name__}")
    _WEIGHT_FORWARDS[:] = [(c, f) for c, f in _WEIGHT_FORWARDS if c is not cls]
    _WEIGHT_FORWARDS.append((cls, forward))
