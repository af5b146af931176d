"""MoE experts and routers of HF transformers models in float8.

In transformers 5 the experts of an MoE layer are one module holding 3-D expert weights
(the ``…Experts`` classes decorated with ``use_experts_implementation``: attributes
``has_gate``, ``has_bias``, ``is_transposed``, parameters ``gate_up_proj`` or ``up_proj``
and ``down_proj``, ``(E, out, in)``, or ``(E, in, out)`` when ``is_transposed``; biases
``<name>_bias``, ``(E, out)``). :class:`Float8Experts` computes what such a module's
``grouped_mm`` implementation computes, for the ``S = T·k`` (token, expert) pairs of
``T`` tokens routed to ``k`` experts each:

    h = act(x_s W_up,eᵀ + b_up,e)          (``_apply_gate``: SwiGLU or GPT-OSS's clamped one)
    y_t = Σ_{s of t} p_s · (h_s W_down,eᵀ + b_down,e)

with both projections float8 grouped GEMMs (:func:`~lowprec.float8.grouped.grouped_linear`,
per-expert scales, forward and backward). The module's own parameters, children
(``act_fn``, a post-expert norm) and gate function are kept, so ``state_dict`` keys do not
change and :func:`~lowprec.float8.convert_back` gives back the original module. Detection
is by those attributes and 3-D parameters (:func:`is_experts`), not by class name; a
hand-written experts class without the attributes converts where a probe shows that it
computes the same (:func:`experts_flags`).

The router (``gate``/``router``, and gates such as Qwen2-MoE's ``shared_expert_gate``, next
to an experts module: :func:`router_ids`) stays in high precision unless
:attr:`Float8Config.fp8_router` (:mod:`lowprec.float8.router`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lowprec.analysis.structure import (
    ExpertFlags,
    holds_experts,
    stated_flags,
    weight_names,
)
from lowprec.core.scalers import DelayedScaler
from lowprec.core.tensor import ScaledTensor
from lowprec.core.warn import warn_once
from lowprec.float8.carry import _carry_extras, _carry_hooks
from lowprec.float8.config import ROLES, Float8Config
from lowprec.float8.gemm_options import role_scale
from lowprec.float8.grouped import GroupedScales, grouped_config, run_grouped
from lowprec.float8.grouped_quant import group_amax
from lowprec.float8.mm import autocast_off
from lowprec.float8.replay import ForwardReplay, recomputing

__all__ = [
    "Float8Experts",
    "experts_flags",
    "holds_expert_weights",
    "is_experts",
    "router_ids",
]

log = logging.getLogger(__name__)


Flags = ExpertFlags  # (has_gate, has_bias, is_transposed)
_FOUND: weakref.WeakKeyDictionary[nn.Module, Flags | None] = weakref.WeakKeyDictionary()


def experts_flags(mod: nn.Module) -> Flags | None:
    """``(has_gate, has_bias, is_transposed)`` of an experts module, else ``None``.

    A ``use_experts_implementation`` class states them (boolean attributes) and holds the
    parameters they name. Another module with 3-D ``gate_up_proj`` (and ``_apply_gate``)
    or ``up_proj`` (and ``act_fn``) and ``down_proj`` expert weights, optional
    ``<name>_bias``, no other parameters, and a ``forward(hidden_states, top_k_index,
    top_k_weights)`` (a hand-written experts class) is one where the flags its shapes
    allow make :class:`Float8Experts`, with high-precision GEMMs, compute what its own
    forward computes on a random probe (6 tokens, top-2; ``rtol = max(8ε, 1e-5)`` of the
    weight dtype, ``atol = rtol·max|y|``; NaN equal to NaN), as
    :func:`~lowprec.float8.convert.computes_linear` checks a linear subclass. Results are
    cached per module (not for one on the meta device)."""
    stated = stated_flags(mod)
    if stated is not None:
        return stated if holds_experts(mod, stated) else None
    if mod in _FOUND:
        return _FOUND[mod]
    found = _inferred(mod)
    if all(p.device.type != "meta" for p in mod.parameters(recurse=False)):
        _FOUND[mod] = found  # (a module on the meta device is probed once it has data)
    return found


def _inferred(mod: nn.Module) -> Flags | None:
    """The flags of an undecorated experts module (:func:`experts_flags`), or ``None``."""
    has_gate = "gate_up_proj" in mod._parameters
    up = mod._parameters.get("gate_up_proj" if has_gate else "up_proj")
    down = mod._parameters.get("down_proj")
    names = {"gate_up_proj" if has_gate else "up_proj", "down_proj"}
    has_bias = all(n + "_bias" in mod._parameters for n in names)
    if set(mod._parameters) != names | ({n + "_bias" for n in names} if has_bias else set()):
        return None
    if not isinstance(up, Tensor) or not isinstance(down, Tensor) or up.dim() != 3:
        return None
    if down.dim() != 3 or up.shape[0] != down.shape[0] or up.device.type == "meta":
        return None
    mult = 2 if has_gate else 1
    for tr in (False, True):
        h, i = (down.shape[2], down.shape[1]) if tr else (down.shape[1], down.shape[2])
        shape = (h, mult * i) if tr else (mult * i, h)
        f = (has_gate, has_bias, tr)
        if tuple(up.shape[1:]) == shape and holds_experts(mod, f) and _probe(mod, f, h):
            return f
    return None


def _probe(mod: nn.Module, f: Flags, hidden: int) -> bool:
    """``mod``'s own forward equals :class:`Float8Experts`' with flags ``f`` and
    high-precision GEMMs on a random probe (:func:`experts_flags`)."""
    w = mod._parameters["down_proj"]
    assert w is not None
    e, k = w.shape[0], min(2, w.shape[0])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, hidden, generator=gen).to(device=w.device, dtype=w.dtype)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(6)]).to(w.device)
    p = torch.rand(6, k, generator=gen).to(device=w.device, dtype=w.dtype)
    hp = Float8Config(high_precision_gemms=("forward", "input_grad", "weight_grad"))
    try:
        with torch.no_grad():
            ref = type(mod).forward(mod, x, idx, p)
            got = Float8Experts.forward(Float8Experts(mod, hp, flags=f), x, idx, p)
    except Exception:  # a forward of another contract: not an experts module
        return False
    if not isinstance(ref, Tensor) or ref.shape != got.shape or ref.dtype != got.dtype:
        return False
    rtol = max(8 * torch.finfo(w.dtype).eps, 1e-5)
    fin = ref.float()[torch.isfinite(ref)]  # (weights not initialised yet: NaN, Inf alike)
    atol = rtol * float(fin.abs().max()) if fin.numel() else 0.0
    return bool(torch.allclose(got.float(), ref.float(), rtol=rtol, atol=atol, equal_nan=True))


def is_experts(mod: nn.Module) -> bool:
    """Whether ``mod`` is an experts module (:func:`experts_flags`): a transformers 5
    ``use_experts_implementation`` class (module docstring), or a hand-written one that
    computes the same."""
    return experts_flags(mod) is not None


def holds_expert_weights(mod: nn.Module) -> bool:
    """``mod`` holds a 3-D floating-point parameter of its own with more than one slice
    (expert weights ``(E, …)`` that :func:`is_experts` may not recognise; not a ``(1, n, d)``
    token or position table such as ViT's ``cls_token``)."""
    return any(
        isinstance(p, Tensor) and p.dim() == 3 and p.shape[0] > 1 and p.dtype.is_floating_point
        for p in mod._parameters.values()
    )


def router_ids(model: nn.Module) -> set[int]:
    """The ``id`` of each router of ``model``: a child named ``gate``, ``router`` or
    ``…_gate`` with a 2-D ``weight``, next to an experts module (:func:`is_experts`, or
    one converted already)."""

    def experts(c: nn.Module) -> bool:
        return isinstance(c, Float8Experts) or is_experts(c)

    out: set[int] = set()
    for m in model.modules():
        if not any(experts(c) for c in m.children()):
            continue
        for name, c in m.named_children():
            w = getattr(c, "weight", None)
            named = name in ("gate", "router") or name.endswith("_gate")
            if named and isinstance(w, Tensor) and w.dim() == 2 and not experts(c):
                out.add(id(c))
    return out


class _Payload:
    """A saved weight kept as its gathered payload (:func:`_saved_as_payload`)."""

    def __init__(self, st: ScaledTensor) -> None:
        self.st = st


@contextlib.contextmanager
def _saved_as_payload(w3: Tensor, st: ScaledTensor | None, transposed: bool) -> Iterator[None]:
    """Autograd keeps the dequantized gathered weight ``w3`` as the gathered ``st`` (whose
    payload FSDP2 frees after forward and gathers again before backward) and dequantizes
    it again when backward reads it: no unsharded high-precision copy outlives forward."""
    if st is None:
        yield
        return

    def pack(t: Tensor) -> Any:
        return _Payload(st) if t is w3 else t

    def unpack(p: Any) -> Tensor:
        if not isinstance(p, _Payload):
            return p  # type: ignore[no-any-return]
        with torch.no_grad():
            v = p.st.dequantize()
        return v.transpose(1, 2) if transposed else v

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class Float8Experts(nn.Module):
    """An experts module (:func:`is_experts`) whose two projections are float8 grouped
    GEMMs (module docstring), sharing the original's parameters and children.

    ``flags``: ``(has_gate, has_bias, is_transposed)``, by default
    :func:`experts_flags` of ``experts``.

    ``recipe`` is the config asked for; :attr:`grouped_recipe` the one the grouped GEMMs
    run (:func:`~lowprec.float8.grouped.grouped_config`: calibrated static scaling made
    dynamic, stochastic rounding nearest, no Hadamard transform; a WARNING names the change
    once).

    Delayed scaling keeps one ``amax`` history per expert for each projection and role:
    buffers ``<weight name>_<role>_amax_history`` of shape ``(history_len, E)`` (float32
    whatever the module's dtype; recorded in training mode; a plain checkpoint without them
    still loads, the histories then start fresh). Expert ``e``'s scale is its own delayed
    ``amax`` (:class:`~lowprec.core.scalers.DelayedScaler`); an expert that receives no
    token records 0, which the ``max`` history ignores.
    """

    def __init__(
        self,
        experts: nn.Module,
        recipe: str | Float8Config = "tensorwise",
        flags: Flags | None = None,
    ) -> None:
        super().__init__()
        if isinstance(recipe, str):
            recipe = Float8Config.from_name(recipe)
        if not isinstance(recipe, Float8Config):
            raise TypeError(
                f"recipe must be a Float8Config or a preset name, got {type(recipe).__name__}"
            )
        if flags is None and isinstance(experts, nn.Module):
            flags = experts_flags(experts)
        if not isinstance(experts, nn.Module) or flags is None:
            raise TypeError(
                f"experts must be an experts module with 3-D expert weights (has_gate, "
                f"has_bias, is_transposed, gate_up_proj/up_proj, down_proj), got "
                f"{type(experts).__name__}"
            )
        self.recipe = recipe
        self.grouped_recipe, changes = grouped_config(recipe, delayed=True)
        if changes:
            warn_once(
                log,
                f"float8:experts:{recipe}",
                "float8: expert modules run %s with dynamic scaling and nearest rounding "
                "(the grouped GEMMs do not implement %s)",
                recipe.name,
                "; ".join(changes),
            )
        object.__setattr__(self, "_lowprec_original", experts)
        self.has_gate, self.has_bias, self.is_transposed = flags
        for name, p in experts._parameters.items():
            self._parameters[name] = p
        _carry_extras(experts, self, set(experts._parameters))
        _carry_hooks(experts, self)
        self.train(experts.training)
        self._scalers: dict[str, DelayedScaler] = {}  # buffer name -> its scaler
        # weight name -> its forwards' scales, for their recomputations
        self._replay = {name: ForwardReplay() for name in weight_names(self)}
        for name in weight_names(self):
            w = self._parameters[name]
            assert w is not None
            for role in ROLES:
                c = self.grouped_recipe.cast(role)
                if c.scaling == "delayed":
                    buf = f"{name}_{role}_amax_history"
                    h = torch.zeros(c.history_len, w.shape[0], device=w.device)
                    self.register_buffer(buf, h)
                    self._scalers[buf] = DelayedScaler(
                        c.fmt, c.history_len, c.algo, margin=c.margin, power_of_two=c.power_of_two
                    )

    def scaling_buffers(self) -> list[str]:
        """The names of the per-expert ``amax`` history buffers (delayed scaling)."""
        return list(self._scalers)

    def _role_scale(self, name: str, role: str, a: Tensor, update: bool) -> Tensor | None:
        """Role ``role``'s per-expert scales for weight ``name`` from its history (recording
        the per-expert ``amax`` ``a`` when ``update``)."""
        buf = f"{name}_{role}_amax_history"
        sc = self._scalers[buf]
        cast = self.grouped_recipe.cast(role)
        state = self._buffers[buf]
        return role_scale(sc, cast, None, update=update, calibrating=False, state=state, amax=a)

    def weight_scales(self, name: str, amax: Tensor) -> Tensor:
        """The per-expert scales ``(E,)`` the GEMMs give weight ``name`` when the ``amax``
        of each whole expert matrix is ``amax`` (``(E,)``, already reduced across ranks):
        ``s_e = amax_e · 2^margin / fmt.max`` (dynamic), or the delayed scale from its
        history, recording ``amax`` in training as the forward does. For distributed code
        that quantizes the weight before the GEMMs (an FP8 all-gather) and hands it over as
        a :class:`~lowprec.core.tensor.ScaledTensor` ``(Q(W_e / s_e), s_e)``."""
        if f"{name}_weight_amax_history" in self._scalers:
            s = self._role_scale(name, "weight", amax, self.training)
            assert s is not None
            return s
        return self.grouped_recipe.cast("weight").scale_for(amax)

    def _scales(
        self, name: str, x: Tensor, w3: Tensor, offs: Tensor, given: Tensor | None = None
    ) -> GroupedScales | None:
        """The per-expert scales of the delayed roles of weight ``name``'s GEMMs; ``given``:
        the weight's scales when it arrives quantized (:meth:`weight_scales`)."""
        if not self._scalers:
            return None if given is None else GroupedScales(weight=given)
        upd, has = self.training, {b.split("_amax_history")[0] for b in self._scalers}
        # a recomputation (activation checkpointing) uses its forward's scales and records
        # nothing (lowprec.float8.replay); backward records grad_output once
        again = recomputing(upd)
        replay = self._replay[name]
        keep = upd and not torch.compiler.is_compiling()
        key = group_amax(x.detach(), offs) if keep else None  # each expert's input amax
        used = replay.take(key) if again and key is not None else None
        xs = ws = None
        if used is not None:
            xs, ws = used
        else:
            if f"{name}_input" in has:
                a = key if key is not None else group_amax(x.detach(), offs)
                xs = self._role_scale(name, "input", a, upd and not again)
            if given is None and f"{name}_weight" in has:
                a = w3.detach().abs().amax(dim=(1, 2))
                ws = self._role_scale(name, "weight", a, upd and not again)
            if key is not None and not again:
                replay.save(key, (xs, ws))
        if given is not None:
            ws = given
        go = None
        if f"{name}_grad_output" in has:

            def go(a: Tensor) -> Tensor | None:
                return self._role_scale(name, "grad_output", a, upd)

        return GroupedScales(xs, ws, go)

    def _apply(self, fn: Any, recurse: bool = True) -> Float8Experts:
        """``nn.Module._apply``, except that the ``amax`` histories keep float32 (they move
        device with the module but are never cast)."""
        order = list(self._buffers)
        state = {n: self._buffers.pop(n) for n in self._scalers}
        try:
            super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        finally:
            for n, b in state.items():
                if b is not None:
                    moved = fn(b)
                    state[n] = moved if moved.dtype == b.dtype else b.to(device=moved.device)
            self._buffers = {n: state[n] if n in state else self._buffers[n] for n in order}
        return self

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name in self._scalers:  # amax histories: finite and >= 0
            t = state_dict.get(prefix + name)
            if isinstance(t, Tensor) and t.device.type != "meta":
                if not bool((torch.isfinite(t) & (t >= 0)).all()):
                    raise ValueError(f"state_dict[{prefix + name!r}] must be finite and >= 0")
        super()._load_from_state_dict(state_dict, prefix, *args)
        missing: list[str] = args[2]
        own = {prefix + n for n in self._scalers}
        missing[:] = [k for k in missing if k not in own]  # plain checkpoints load: fresh state

    @property
    def original(self) -> nn.Module:
        """The experts module this one replaced (its parameters are this module's)."""
        orig: nn.Module = self.__dict__["_lowprec_original"]
        return orig

    def to_experts(self) -> nn.Module:
        """The original experts module, holding this module's parameters and children."""
        orig = self.original
        orig._parameters.update(self._parameters)
        orig._modules.update(self._modules)
        orig.train(self.training)
        return orig

    def _linear(self, x: Tensor, name: str, offs: Tensor, ids: Tensor, dtype: Any) -> Tensor:
        w: Tensor | None = self._parameters[name]
        assert w is not None
        given = gathered = None
        if isinstance(w, ScaledTensor):  # FP8-gathered (lowprec.distributed): Q(W_e/s_e), s_e
            # the GEMMs quantize Q(W_e/s_e)·s_e with s_e again: the identity on its values
            gathered, given, w = w, w.scale.reshape(-1), w.dequantize()
        w3 = w.transpose(1, 2) if self.is_transposed else w  # (E, out, in)
        scales = self._scales(name, x, w3, offs, given)
        with autocast_off(x.device.type), _saved_as_payload(w3, gathered, self.is_transposed):
            y = run_grouped(x, w3, offs, self.grouped_recipe, dtype, scales)
        b = self._parameters.get(name + "_bias") if self.has_bias else None
        return y if b is None else y + b[ids].to(y.dtype)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``hidden_states (T, H)``, ``top_k_index (T, k)`` expert ids, ``top_k_weights
        (T, k)`` routing weights → ``(T, H)`` (module docstring)."""
        if getattr(self.original, "_is_expert_parallel", False):
            raise ValueError("experts: expert parallelism is not supported by Float8Experts")
        up, down = weight_names(self)
        e = self._parameters[down].shape[0]  # type: ignore[union-attr]
        self._check_inputs(hidden_states, top_k_index, top_k_weights, up)
        k, t, h = top_k_index.shape[-1], hidden_states.shape[0], hidden_states.shape[-1]
        ids = top_k_index.reshape(-1)
        if not torch.compiler.is_compiling() and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= e:
                raise ValueError(f"top_k_index: expert ids must be in [0, {e}), got {lo}..{hi}")
        ids_g, perm = torch.sort(ids, stable=True)
        x_g = hidden_states[perm // k]
        p_g = top_k_weights.reshape(-1)[perm]
        offs = torch.cumsum(torch.bincount(ids_g, minlength=e), 0)
        dev = x_g.device.type
        amp = dev != "meta" and torch.is_autocast_enabled(dev)
        dtype = torch.get_autocast_dtype(dev) if amp else x_g.dtype
        y = self._linear(x_g, up, offs, ids_g, dtype)
        orig = self.original
        act: Any = orig._apply_gate if self.has_gate else orig.act_fn
        y = act(y)
        y = self._linear(y, down, offs, ids_g, dtype)
        if getattr(orig, "has_post_expert_norm", False):
            y = self._modules["post_expert_norm"](y)  # type: ignore[misc]
        y = y * p_g.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        out = y[inv].view(t, k, h).sum(dim=1)
        return out.to(hidden_states.dtype)

    def _check_inputs(self, x: object, idx: object, p: object, up: str) -> None:
        """``TypeError``/``ValueError`` naming the argument unless ``x`` is ``(T, H)``
        floating point with ``H`` the experts' input size, ``idx`` ``(T, k)`` integer ids and
        ``p`` ``(T, k)`` floating-point weights (a wider ``p`` would pair tokens with other
        tokens' weights)."""
        for name, a in (("hidden_states", x), ("top_k_index", idx), ("top_k_weights", p)):
            if not isinstance(a, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(a).__name__}")
        assert isinstance(x, Tensor) and isinstance(idx, Tensor) and isinstance(p, Tensor)
        w = self._parameters[up]
        assert w is not None
        h = w.shape[1] if self.is_transposed else w.shape[2]  # (E, out, in) or (E, in, out)
        if x.dim() != 2 or x.shape[1] != h or not x.dtype.is_floating_point:
            raise ValueError(
                f"hidden_states: expected a floating-point (tokens, {h}) tensor, got "
                f"{tuple(x.shape)} {x.dtype}"
            )
        if idx.dim() != 2 or idx.shape[0] != x.shape[0] or idx.dtype.is_floating_point:
            raise ValueError(
                f"top_k_index: expected integer expert ids of shape ({x.shape[0]}, k), got "
                f"{tuple(idx.shape)} {idx.dtype}"
            )
        if p.shape != idx.shape or not p.dtype.is_floating_point:
            raise ValueError(
                f"top_k_weights: expected floating-point weights of top_k_index's shape "
                f"{tuple(idx.shape)}, got {tuple(p.shape)} {p.dtype}"
            )

    def extra_repr(self) -> str:
        w = self._parameters[weight_names(self)[1]]
        e = 0 if w is None else w.shape[0]
        return f"experts={e}, recipe={self.recipe.name}, {self.grouped_recipe.describe()}"
