"""Unit-scaled mixture-of-experts layers of HF transformers 5 models.

An MoE layer of transformers 5 has an *experts* module holding 3-D expert weights (a class
decorated with ``use_experts_implementation``: flags ``has_gate``, ``has_bias``,
``is_transposed``; ``gate_up_proj`` or ``up_proj`` and ``down_proj``, ``(E, out, in)``, or
``(E, in, out)`` when ``is_transposed``; biases ``<name>_bias (E, out)``) and a *router*
(``gate``/``router``, a ``…TopKRouter`` returning ``(logits, top-k weights, indices)``).
For the ``S = T·k`` (token, expert) pairs of ``T`` tokens routed to ``k`` experts each:

    y_t = α · Σ_{j<k} p_tj · f_{e_tj}(x_t),   f_e(x) = act(x W_up,eᵀ/√H) W_down,eᵀ/√I

**Experts.** Each expert's two projections are unit linears
(:func:`lowprec.unit.functional.linear`) on the tokens it receives: forward ``1/√fan_in``
(``H`` for the up projection, ``I`` for the down one), input gradient tied to it, weight
gradient ``1/√n_e`` with ``n_e`` the number of tokens expert ``e`` actually receives (an
expert that receives none gets a zero gradient). The gate is the module's own
``_apply_gate`` (SwiGLU: ``act_fn`` becomes the unit SiLU, as a dense MLP's); a gate the
class defines itself (GPT-OSS's clamped SwiGLU ``(u + 1)·g·σ(αg)``, clamped at the
model's ``limit``) runs as written, its output multiplied by ``1/RMS`` of that gate on
unit-normal inputs, computed once at conversion (Monte Carlo, 8192 rows).

**The routing weights' effect on scale.** With ``f_e`` unit and independent across the
``k`` experts of a token (different weights), ``Var y_t = α²·Σ_j p_tj²``, so
``α = 1/√ρ`` with ``ρ = E[Σ_j p_j²]``: for softmax-renormalised top-k ``Σ_j p_j = 1`` and
``ρ ∈ [1/k, 1]`` (``1/k`` for flat weights); without renormalisation (Qwen2-MoE, OLMoE)
``ρ`` is smaller still; DeepSeek-V3's ``routed_scaling_factor`` ``r`` multiplies it by
``r²``. ``ρ`` is computed at conversion by running the layer's own router, with a
unit-variance weight drawn for the purpose (so it does not depend on the weights the
model holds), on 8192 unit-normal rows: the expectation over tokens at unit-scaled init,
the static estimate the scale needs. ``α`` multiplies both passes, so the routing adds
no factor to the gradient reaching ``x_t`` through the experts, ``Σ_j α p_tj J_jᵀ g_t``
(``E[Σ_j α²p_tj²] = 1``; the linears' own tied scales remain, as in a dense MLP). The
gradient reaching an expert's output is ``α p g``, of mean square ``α²·ρ/k = 1/k`` over
the pairs, so the expert weights' gradients are multiplied by ``√k`` (cut edges:
``∂W_e`` is ``√(k/n_e)·gᵀx``). The gradient of the routing weights,
``∂p_tj = α g_t·f(x_t)``, sums ``H`` unit products: it is multiplied by ``1/(α√H)``
(unit); that factor also scales the router path's share of ``∂x``, as the readout's
backward differs from its forward.

**The router** is an output-like weight in μP's sense (fan-in ``H`` grows with width,
fan-out ``E`` does not): its logits are ``x Wᵀ/H``
(:func:`~lowprec.unit.functional.linear_readout` with ``constraint="to_output_scale"``:
the unit linear with a further forward ``1/√H``, its input gradient tied to the forward's
``1/√H``, not the model readout's ``1/√E``, as its path joins the others to ``x``;
weight ``N(0, 1)``), so
routing is near-uniform at init at any width, and u-μP gives it the readout's learning
rate ``η`` (:mod:`lowprec.unit.umup`). Everything else in the router (softmax, top-k,
renormalisation, DeepSeek's sigmoid and group-limited choice) and the load-balancing loss
run as the plain model's ops (:func:`lowprec.unit.mode.plain_ops`), so the routing and the
auxiliary loss are exactly what the plain router with weight ``W/H`` computes from the
same hidden states. The router stays in the model's dtype under ``float8``.

**Shared experts.** A block that adds a dense *shared expert* to the routed output
(DeepSeek-V3's ``shared_experts``; Qwen2-MoE's ``shared_expert`` gated by
``σ(shared_expert_gate(x))``) sums two independent branches of variance 1 and ``v_s``
(``1``, or ``E[σ(Z)²] ≈ 0.293`` for a gate of unit-normal ``Z``): its output gets the
forward-only factor ``1/√(1 + v_s)``, as the unit ``add`` of two branches
(:func:`lowprec.unit.functional.add`: each branch's gradient stays unit).

**Data parallelism.** On ``N`` ranks each rank routes its own tokens, so expert ``e``
receives ``n_e,r`` of them on rank ``r`` and ``n_e = Σ_r n_e,r`` in all. The one-process
weight gradient is ``n_e^-1/2 Σ_r G_e,r``; the data-parallel reduction sums the ranks'
gradients and divides by ``√N`` (:mod:`lowprec.distributed.unit_reduce`), which gives it
only if every rank's gradient is scaled by ``(n_e/N)^-1/2``, not by its own count's
``n_e,r^-1/2`` (the counts differ between ranks whenever the routing does). After
:func:`share_token_counts`, each forward all-reduces the ``E`` counts over the group
(one collective of ``E`` integers per experts call) and scales expert ``e``'s weight and
bias gradients by ``√(N·n_e,r/n_e)`` on top of the linears' own ``n_e,r^-1/2``.

Not handled (``NotImplementedError`` naming the module): expert parallelism, experts
modules without a router next to them.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lowprec.analysis.structure import holds_experts, stated_flags, weight_names
from lowprec.core.modes import eager_frames
from lowprec.unit import functional as U
from lowprec.unit.config import UnitConfig
from lowprec.unit.core import scale_bwd, scale_fwd
from lowprec.unit.mode import UNIT_OPS, plain_ops
from lowprec.unit.moments import gauss_moment
from lowprec.unit.products import Matmul

__all__ = [
    "convert_moe",
    "inject_matmul",
    "is_experts",
    "route_aux_losses",
    "routing_moment",
    "share_token_counts",
]

_SAMPLES = 8192  # rows of the Monte Carlo estimates (ρ, a custom gate's RMS)


def is_experts(mod: nn.Module) -> bool:
    """Whether ``mod`` is an experts module of transformers 5 (module doc): the boolean
    flags, a callable ``_apply_gate`` (``has_gate``) or ``act_fn``, 3-D floating-point
    ``gate_up_proj``/``up_proj`` and ``down_proj``, 2-D ``<name>_bias`` with ``has_bias``
    (:func:`lowprec.analysis.structure.holds_experts`)."""
    flags = stated_flags(mod)
    return flags is not None and holds_experts(mod, flags)


@eager_frames
class _RouterMode(TorchFunctionMode):
    """Inside a unit router's forward: ``F.linear`` by the router's weight is the unit
    readout (``x Wᵀ/fan_in``), every other op the plain one (the unit mode is suspended
    by :func:`plain_ops` around it)."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.router = router

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kw = kwargs or {}
        w = args[1] if len(args) > 1 else kw.get("weight")
        if func is F.linear and isinstance(w, Tensor) and w.shape == self.router.weight.shape:
            b = args[2] if len(args) > 2 else kw.get("bias")
            with torch._C.DisableTorchFunction():
                return UNIT_OPS[U.linear_readout](args[0], w, b, constraint="to_output_scale")
        return func(*args, **kw)


def _router_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    cls = type(self)
    base = cast(Any, cls.__mro__[1] if "_unit_form" in cls.__dict__ else cls)  # its own class
    with plain_ops(), _RouterMode(self):
        return base.forward(self, *args, **kwargs)


def routing_moment(router: nn.Module, *, samples: int = _SAMPLES, seed: int = 0) -> float:
    """``ρ = E[Σ_j p_j²]`` of a (unit) ``router``'s top-k weights ``p`` (module doc): its
    forward on ``samples`` unit-normal rows, with a unit-normal weight (bias 0) in place
    of its own for the call (restored after).

    Example:
        >>> class Router(nn.Module):  # softmax top-2 of 8, renormalised
        ...     def __init__(self):
        ...         super().__init__(); self.weight = nn.Parameter(torch.zeros(8, 64))
        ...     def forward(self, x):
        ...         p, i = F.softmax(F.linear(x, self.weight), -1).topk(2, -1)
        ...         return None, p / p.sum(-1, keepdim=True), i
        >>> 0.5 <= routing_moment(Router()) < 0.55  # near 1/k: logits x Wᵀ/H are small
        True
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an int >= 1, got {samples!r}")
    w = cast(Tensor, router.weight)
    b = router._parameters.get("bias")
    saved = [p.detach().clone() for p in (w, b) if isinstance(p, Tensor)]
    gen = torch.Generator(device=w.device).manual_seed(seed)
    with torch.no_grad():
        try:
            w.copy_(torch.randn(w.shape, generator=gen, device=w.device))
            if isinstance(b, Tensor):
                b.zero_()
            x = torch.randn(samples, w.shape[1], generator=gen, device=w.device).to(w.dtype)
            out = _router_forward(router, x)
        finally:
            for p, s in zip([p for p in (w, b) if isinstance(p, Tensor)], saved, strict=True):
                p.copy_(s)
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[1], Tensor)):
        raise TypeError(
            f"router: {type(router).__name__} must return (logits, top-k weights, indices), "
            f"got {type(out).__name__}"
        )
    return float(out[1].double().square().sum(-1).mean())


def _gate_gain(experts: Any) -> float:
    """``1/RMS`` of a gate the experts class defines itself, on unit-normal inputs."""
    w = experts._parameters[weight_names(experts)[0]]
    assert w is not None
    out_dim = w.shape[2] if experts.is_transposed else w.shape[1]
    gen = torch.Generator(device=w.device).manual_seed(1)
    z = torch.randn(_SAMPLES, out_dim, generator=gen, device=w.device).to(w.dtype)
    with torch.no_grad(), plain_ops():
        y = experts._apply_gate(z)
    rms = float(y.double().square().mean().sqrt())
    if not (math.isfinite(rms) and rms > 0):
        name = type(experts).__name__
        raise ValueError(f"experts: {name}._apply_gate has RMS {rms} on unit-normal inputs")
    return 1.0 / rms


def _custom_gate(experts: nn.Module) -> bool:
    fn = getattr(type(experts), "_apply_gate", None)
    return bool(experts.has_gate) and getattr(fn, "__name__", "") != "_default_apply_gate"


def _experts_forward(
    self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """``hidden_states (T, H)``, ``top_k_index (T, k)``, ``top_k_weights (T, k)`` →
    ``(T, H)``: the unit MoE combination of the module doc."""
    for name, a in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                    ("top_k_weights", top_k_weights)):  # fmt: skip
        if not isinstance(a, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(a).__name__}")
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError("unit_scale: expert parallelism has no unit rule")
    cfg = cast(UnitConfig, self.__dict__["_unit_cfg"])
    up, down = weight_names(self)
    w_up: Tensor = self._parameters[up]
    w_down: Tensor = self._parameters[down]
    n_exp = w_down.shape[0]
    k, t, h = top_k_index.shape[-1], hidden_states.shape[0], hidden_states.shape[-1]
    ids = top_k_index.reshape(-1)
    if ids.numel() and not torch.compiler.is_compiling():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n_exp:
            raise ValueError(f"top_k_index: expert ids must be in [0, {n_exp}), got {lo}..{hi}")
    ids_g, perm = torch.sort(ids, stable=True)
    x_g = hidden_states[perm // k]
    counts_t = torch.bincount(ids_g, minlength=n_exp)
    counts = counts_t.tolist()
    shared = _global_counts(self, counts_t)  # data parallel: (N, every rank's counts summed)
    alpha = float(self.__dict__["_unit_rho"]) ** -0.5
    sk = math.sqrt(k)  # the expert weights' gradient: mean square α²ρ/k = 1/k (module doc)
    w_up, w_down = scale_bwd(w_up, sk), scale_bwd(w_down, sk)
    b_up = b_down = None
    if self.has_bias:
        b_up = scale_bwd(cast(Tensor, self._parameters[up + "_bias"]), sk)
        b_down = scale_bwd(cast(Tensor, self._parameters[down + "_bias"]), sk)
    custom, gain = _custom_gate(self), float(self.__dict__.get("_unit_gate_gain", 1.0))
    mm = self.__dict__.get("_unit_matmul")  # inject_matmul: e.g. a float8 recipe's GEMM
    gemm: dict[str, Any] = {"float8": cfg.float8} if mm is None else {"matmul": mm}
    outs: list[Tensor] = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue  # no token: no GEMM, a zero gradient for this expert's weights
        xs = x_g[start : start + n]
        start += n
        wu, wd = (w_up[e].t(), w_down[e].t()) if self.is_transposed else (w_up[e], w_down[e])
        bu, bd = (None, None) if b_up is None or b_down is None else (b_up[e], b_down[e])
        if shared is not None:  # the gradient of n_e tokens over all ranks (module doc)
            c = math.sqrt(shared[0] * n / shared[1][e])
            wu, wd = scale_bwd(wu, c), scale_bwd(wd, c)
            if bu is not None and bd is not None:
                bu, bd = scale_bwd(bu, c), scale_bwd(bd, c)
        y = U.linear(xs, wu, bu, **gemm)
        if custom:
            with plain_ops():
                y = self._apply_gate(y) * gain
        else:
            y = self._apply_gate(y) if self.has_gate else self.act_fn(y)
        outs.append(U.linear(y, wd, bd, **gemm))
    y = torch.cat(outs) if outs else hidden_states.new_zeros(0, h)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    p_g = scale_bwd(top_k_weights.reshape(-1)[perm].to(y.dtype), 1.0 / (alpha * math.sqrt(h)))
    # The combination's ops have no unit rule; run plainly, the mode keeps no record of
    # them (a tracked ``· alpha``, made in this eagerly run function, would reach the
    # compiled frame that resumes after it in the mode's state: Dynamo fails on it)
    with plain_ops():
        y = y * p_g.unsqueeze(-1)
        inv = torch.argsort(perm)  # perm's inverse permutation
        out: Tensor = y[inv].view(t, k, h).sum(dim=1) * alpha
        return out.to(hidden_states.dtype)


def _global_counts(experts: Any, counts: Tensor) -> tuple[int, list[int]] | None:
    """``(N, [n_e])``: the group's size and each expert's token count summed over its ranks
    (one all-reduce), for experts that :func:`share_token_counts` registered with a group
    of more than one rank; else ``None``."""
    group = experts.__dict__.get("_unit_dp_group")
    if group is None:
        return None
    import torch.distributed as dist

    pg = group[0]
    world = dist.get_world_size(pg)
    if world == 1:
        return None
    total = counts.clone()
    dist.all_reduce(total, group=pg)
    return world, total.tolist()


def share_token_counts(model: nn.Module, group: Any = None) -> int:
    """Make every experts module of ``model`` that :func:`convert_moe` converted scale its
    weight gradients by the token counts of all ranks of the process group ``group``
    (``None``: the default group) instead of its own rank's (module doc, *Data
    parallelism*): needed for the one-process gradient whenever ``model``'s ranks train
    on different tokens (DDP, FSDP2). Every rank must call every forward of the experts
    (each forward is one collective over ``group``). Returns the number of experts
    modules registered (``0``: a model without unit experts, left as it is). ``RuntimeError``
    when ``torch.distributed`` has no process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "share_token_counts: no process group (torch.distributed is not initialized)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
    n = 0
    for m in model.modules():
        if getattr(type(m), "_unit_form", None) == "experts":
            object.__setattr__(m, "_unit_dp_group", (group,))
            n += 1
    return n


def inject_matmul(experts: nn.Module, matmul: Matmul | None) -> None:
    """Make each expert's two unit linears compute their product ``x' W'ᵀ`` with
    ``matmul`` (``None``: ``F.linear``, or unit's own FP8 casts with ``float8``), as a
    :class:`~lowprec.float8.Float8Linear`'s ``linear_fn`` injects its GEMM into a unit
    linear (:func:`lowprec.unit.functional.linear`'s ``matmul``): the unit scales stay
    around it. ``experts``: an experts module :func:`convert_moe` converted (else
    ``TypeError``); ``matmul`` is called with one expert's 2-D operands."""
    if getattr(type(experts), "_unit_form", None) != "experts":
        raise TypeError(
            f"experts must be an experts module converted by unit scaling, got "
            f"{type(experts).__name__}"
        )
    if matmul is not None and not callable(matmul):
        raise TypeError(f"matmul must be callable or None, got {type(matmul).__name__}")
    if matmul is not None and cast(UnitConfig, experts.__dict__["_unit_cfg"]).float8:
        raise ValueError(
            "matmul: this model's unit config casts to FP8 itself (float8=True); give a "
            "matmul or float8=True, not both"
        )
    object.__setattr__(experts, "_unit_matmul", matmul)


def _router_of(parent: nn.Module) -> tuple[str, nn.Module] | None:
    for name, c in parent.named_children():
        w = getattr(c, "weight", None)
        if name in ("gate", "router") and not isinstance(c, nn.Linear):
            if isinstance(w, Tensor) and w.dim() == 2:
                return name, c
    return None


class _SharedSum:
    """Forward hook of a block with a shared expert: its output times ``factor``
    (forward only; module doc)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
            return (scale_fwd(out[0], self.factor), *out[1:])
        return scale_fwd(out, self.factor) if isinstance(out, Tensor) else out


def _shared_variance(block: nn.Module) -> float | None:
    """``v_s`` of the block's shared expert (module doc), or ``None`` without one."""
    names = dict(block.named_children())
    if "shared_experts" in names or "shared_expert" in names:
        if isinstance(names.get("shared_expert_gate"), nn.Linear):
            return gauss_moment(lambda z: 1.0 / (1.0 + np.exp(-z)))
        return 1.0
    return None


# Under torch.compile the experts run eagerly (one graph break per experts call): their
# token counts per expert are data (``bincount(...).tolist()`` and a loop over them), and
# a graph break inside a unit model's decoder-layer loop made Dynamo trace the rest of the
# combination with the unit ops converted twice (an extra 1/sqrt(fan_in) on the experts'
# activations; tests/unit/test_moe.py compares the compiled loss and gradients with eager's).
_experts_forward_eager = torch.compiler.disable(_experts_forward)  # type: ignore[no-untyped-call]


def _swap(m: nn.Module, forward: Any, form: str) -> None:
    cls = type(m)
    attrs = {"forward": forward, "__module__": cls.__module__, "_unit_form": form}
    m.__class__ = type(f"Unit{cls.__name__}", (cls,), attrs)


def convert_moe(model: nn.Module, cfg: UnitConfig) -> list[str]:
    """Convert each experts module of ``model`` and its router (in place, module doc):
    classes swapped for subclasses with the unit forwards, parameters and ``state_dict``
    keys unchanged. Returns ``"name (Class: experts, rho=…)"`` / ``"name (Class:
    router)"`` for each; ``NotImplementedError`` names an experts module with no router
    next to it, or one under expert parallelism."""
    done: list[str] = []
    for pname, parent in list(model.named_modules()):
        for cname, mod in list(parent.named_children()):
            if not is_experts(mod) or hasattr(type(mod), "_unit_form"):
                continue
            where = f"{pname}.{cname}" if pname else cname
            found = _router_of(parent)
            if found is None:
                raise NotImplementedError(
                    f"unit_scale: {where} ({type(mod).__name__}): an experts module with no "
                    "router next to it (a child 'gate' or 'router' with a 2-D weight): its "
                    "routing weights' scale is unknown"
                )
            if getattr(mod, "_is_expert_parallel", False):
                raise NotImplementedError(
                    f"unit_scale: {where} ({type(mod).__name__}): expert parallelism has no "
                    "unit rule"
                )
            rname, router = found
            rcls = type(router).__name__
            if not hasattr(type(router), "_unit_form"):
                _swap(router, _router_forward, "router")
                rwhere = f"{pname}.{rname}" if pname else rname
                done.append(f"{rwhere} ({rcls}: router)")
            rho = routing_moment(router)
            ecls = type(mod).__name__
            if _custom_gate(mod):
                object.__setattr__(mod, "_unit_gate_gain", _gate_gain(mod))
            _swap(mod, _experts_forward_eager, "experts")
            object.__setattr__(mod, "_unit_rho", rho)
            object.__setattr__(mod, "_unit_cfg", cfg)
            v = _shared_variance(parent)
            shared = ""
            if v is not None:
                parent.register_forward_hook(_SharedSum((1.0 + v) ** -0.5))
                shared = f", shared expert: output /{math.sqrt(1.0 + v):.4g}"
            done.append(f"{where} ({ecls}: experts, rho={rho:.4g}{shared})")
    return done


def _plain(fn: Any) -> Any:
    def plain(*args: Any, **kwargs: Any) -> Any:
        with plain_ops():
            return fn(*args, **kwargs)

    plain.__wrapped__ = fn  # type: ignore[attr-defined]
    plain._unit_plain = True  # type: ignore[attr-defined]
    return plain


def route_aux_losses(model: nn.Module) -> None:
    """Where a forward of ``model``'s modules names ``load_balancing_loss_func`` (HF's
    auxiliary MoE loss) through its module's globals, bind that name to a wrapper that
    runs it under :func:`plain_ops`: the loss is the plain model's function of the router
    logits (its softmax not the unit one). Outside a unit model's forward the wrapper
    computes exactly what the function does."""
    for m in model.modules():
        fn = inspect.unwrap(type(m).forward)
        scope = getattr(fn, "__globals__", None)
        code = getattr(fn, "__code__", None)
        if not isinstance(scope, dict) or code is None:
            continue
        for name in code.co_names:
            f = scope.get(name)
            if name == "load_balancing_loss_func" and callable(f) and not hasattr(f, "_unit_plain"):
                scope[name] = _plain(f)
