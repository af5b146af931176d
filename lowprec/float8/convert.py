"""Converting a model: every linear-like layer (``nn.Linear``, HF ``Conv1D``) to float8 and back.

``apply(model, config)`` is the float8 technique's entry point.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lowprec.float8.attention_apply import apply_attention, remove_attention
from lowprec.float8.carry import _carry_extras, _carry_hooks
from lowprec.float8.config import GEMMS, Float8Config
from lowprec.float8.conv1d import Float8Conv1D, is_conv1d
from lowprec.float8.experts import Float8Experts, holds_expert_weights, is_experts, router_ids
from lowprec.float8.linear import Float8Linear
from lowprec.float8.router import Float8Router

__all__ = [
    "ModuleFilter",
    "apply",
    "computes_linear",
    "convert_back",
    "convert_to_float8",
    "replace_layer",
]

log = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], "bool | Float8Config | None"]


def apply(
    model: nn.Module,
    config: str | Float8Config = "tensorwise",
    module_filter: ModuleFilter | None = None,
) -> nn.Module:
    """The float8 technique's entry point: swap every linear-like layer ``y = x W + b`` of
    ``model`` (in place) for a float8 one, with ``config`` (a
    :class:`~lowprec.float8.Float8Config` or a preset name, see :func:`recipe_names`).

    ``nn.Linear`` becomes :class:`Float8Linear`; HF transformers' ``Conv1D`` (GPT-2's
    layers, weight stored ``(in, out)``) becomes :class:`~lowprec.float8.conv1d.Float8Conv1D`,
    which keeps that parameter's name and shape (HF checkpoints still load) and computes
    exactly what the equivalent ``nn.Linear`` would. Parameters are shared, not copied.
    The experts of an HF transformers MoE layer (a module holding 3-D expert weights,
    :func:`~lowprec.float8.experts.is_experts`) become a
    :class:`~lowprec.float8.experts.Float8Experts` (float8 grouped GEMMs, the same
    ``state_dict`` keys); the MoE routers stay in high precision unless
    ``fp8_router`` (:class:`~lowprec.float8.Float8Config`). ``module_filter`` sees the
    experts module and the router (by their fqns) as it sees a linear.

    ``module_filter(module, fqn)`` returns True for the layers to convert (default: all), or
    a :class:`~lowprec.float8.Float8Config`: the layer is converted with that config instead
    of ``config`` (per-layer configs, as a recipe's ``layers`` give them; ``None`` or False
    leaves the layer); it sees the original module (an ``nn.Linear`` or a ``Conv1D``, whose
    sizes are ``nx`` and ``nf``). ``config.attention`` (not a filter's config) also runs
    the model's attention in FP8 (:func:`~lowprec.float8.attention.apply_attention`;
    :func:`convert_back` undoes it). A layer used at several places becomes one float8 layer
    used at all of them; its hooks carry over. What is not converted is named in one
    WARNING: layers the filter refused, subclasses of ``nn.Linear`` and parametrized linears
    (e.g. ``weight_norm``), whose own forward would be lost. A subclass whose forward
    computes exactly ``F.linear`` with no state of its own (Falcon's ``FalconLinear``, see
    :func:`computes_linear`) is converted; :func:`convert_back` gives it back. Returns
    ``model`` (or the new module if ``model`` itself is a linear-like layer).

    Example:
        >>> import torch
        >>> nn = torch.nn
        >>> m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> m = apply(m, "delayed", module_filter=lambda mod, fqn: fqn != "2")
        >>> [type(c).__name__ for c in m]
        ['Float8Linear', 'ReLU', 'Linear']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    recipe = Float8Config.from_name(config) if isinstance(config, str) else config
    if not isinstance(recipe, Float8Config):
        raise TypeError(
            f"config must be a Float8Config or a preset name, got {type(recipe).__name__}"
        )
    if module_filter is not None and not callable(module_filter):
        raise TypeError("module_filter must be a callable (module, fqn) -> bool")
    apply_attention(model, recipe)  # config.attention: FP8 attention (float8/attention.py)

    skipped: dict[str, str] = {}  # fqn -> why

    def wanted(mod: nn.Module, fqn: str) -> bool:
        conv1d = is_conv1d(mod)
        name = fqn or "the model"
        if isinstance(mod, (Float8Linear, Float8Experts)):
            return False
        experts, router = is_experts(mod), id(mod) in routers
        if not (conv1d or isinstance(mod, nn.Linear) or experts or router):
            if _looks_linear(mod):
                skipped[name] = f"{type(mod).__name__}: not an nn.Linear or an HF Conv1D"
            elif holds_expert_weights(mod):
                skipped[name] = f"{type(mod).__name__}: 3-D weights, not an experts module"
            return False
        chosen = recipe if module_filter is None else module_filter(mod, fqn)
        if chosen is None or chosen is False:
            skipped[name] = f"{type(mod).__name__}: module_filter"
            return False
        if chosen is not True and not isinstance(chosen, Float8Config):
            raise TypeError(
                f"module_filter must return a bool, a Float8Config or None, got "
                f"{type(chosen).__name__} for {name}"
            )
        cfg = recipe if chosen is True else chosen
        if router and not cfg.fp8_router:  # MoE routers: high precision unless asked
            skipped[name] = f"{type(mod).__name__}: router (fp8_router=False)"
            return False
        if experts or (router and not isinstance(mod, nn.Linear)):
            configs[id(mod)], fqns[id(mod)] = cfg, fqn
            return True
        if not conv1d and type(mod) is not nn.Linear and not computes_linear(mod):
            skipped[name] = f"{type(mod).__name__}: nn.Linear subclass, own forward"
            return False
        if parametrize.is_parametrized(mod):
            skipped[name] = f"{type(mod).__name__}: parametrized, the parametrization would be lost"
            return False
        w = mod.weight
        if not isinstance(w, Tensor) or not w.dtype.is_floating_point:
            raise TypeError(
                f"model: {name}.weight has dtype {getattr(w, 'dtype', None)}; float8 "
                "conversion needs floating-point weights"
            )
        configs[id(mod)] = recipe if chosen is True else chosen
        fqns[id(mod)] = fqn
        return True

    configs: dict[int, Float8Config] = {}
    fqns: dict[int, str] = {}  # keys of the stochastic-rounding streams

    def make(mod: nn.Module) -> nn.Module:
        cfg = configs[id(mod)]
        new: Float8Linear
        if is_experts(mod):
            return Float8Experts(mod, cfg)
        if isinstance(mod, nn.Linear):
            new = Float8Linear.from_linear(mod, cfg)
            if type(mod) is not nn.Linear:  # convert_back gives the subclass back
                object.__setattr__(new, "_lowprec_original", mod)
        elif is_conv1d(mod):
            new = Float8Conv1D.from_conv1d(mod, cfg)
        else:  # a router that is not an nn.Linear
            new = Float8Router.from_router(mod, cfg)
        new.set_rng_key(fqns[id(mod)])
        return new

    routers = router_ids(model)
    if wanted(model, ""):
        return make(model)
    done: dict[int, nn.Module] = {}
    _convert_children(model, wanted, make, done)
    # What the caller's module_filter excluded was asked for: INFO. Anything else is a
    # linear-like layer that stays in high precision against the caller's wish: WARNING.
    for level, chosen in ((logging.INFO, True), (logging.WARNING, False)):
        part = {
            k: v
            for k, v in skipped.items()
            if v.endswith((": module_filter", "(fp8_router=False)")) == chosen
        }
        if part:
            log.log(
                level,
                "float8.apply: %d linear-like layer(s) left unconverted: %s",
                len(part),
                "; ".join(f"{k} ({v})" for k, v in part.items()),
            )
    if (
        not done
        and not skipped
        and not any(isinstance(m, (Float8Linear, Float8Experts)) for m in model.modules())
    ):  # nothing converted, nothing named above: the float8 config would act on nothing
        log.warning(
            "float8.apply: %s has no layer that float8 converts (nn.Linear, HF Conv1D, MoE "
            "experts): nothing runs in FP8 (a matmul of a raw parameter, an RNN, a "
            "convolution stays in the model's precision)",
            type(model).__name__,
        )
    return model


def convert_to_float8(
    model: nn.Module,
    recipe: str | Float8Config = "tensorwise",
    module_filter: ModuleFilter | None = None,
) -> nn.Module:
    """Alias of :func:`apply` (``recipe`` is its ``config``), kept for torchao-style code.

    Example:
        >>> import torch
        >>> m = convert_to_float8(torch.nn.Sequential(torch.nn.Linear(32, 32)), "rowwise")
        >>> type(m[0]).__name__, m[0].recipe.name
        ('Float8Linear', 'rowwise')
    """
    if not isinstance(recipe, (str, Float8Config)):
        raise TypeError(
            f"recipe must be a Float8Config or a preset name, got {type(recipe).__name__}"
        )
    return apply(model, recipe, module_filter)


def computes_linear(mod: nn.Module) -> bool:
    """Whether ``mod``, a subclass of ``nn.Linear`` with its own ``forward``, computes
    exactly ``F.linear(x, W, b)`` with nothing else of its own (Falcon's ``FalconLinear``:
    ``x @ W.T + b``): no child modules, buffers or parameters besides ``weight`` and
    ``bias``, and on a random input (``x ~ N(0, 1)``, the layer's device and dtype) its
    output equals ``F.linear``'s up to summation order and rounding (``rtol = 8ε``,
    ``atol = 8ε·max|y|``, ε the weight dtype's machine epsilon, at least 1e-5). A layer
    with extra state (LoRA's adapters, a quantized weight) is never converted: its forward
    would be lost."""
    if not isinstance(mod, nn.Linear) or type(mod).forward is nn.Linear.forward:
        return type(mod) is nn.Linear
    if next(mod.children(), None) is not None or next(mod.buffers(recurse=False), None) is not None:
        return False
    if set(dict(mod.named_parameters(recurse=False))) - {"weight", "bias"}:
        return False
    w, b = mod.weight, mod.bias
    if not isinstance(w, Tensor) or not w.dtype.is_floating_point or w.device.type == "meta":
        return False
    x = torch.randn(3, mod.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(device=w.device, dtype=w.dtype)
    try:
        with torch.no_grad():
            got, ref = mod(x), F.linear(x, w, b)
    except Exception:
        return False
    if not isinstance(got, Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    rtol = max(8 * torch.finfo(w.dtype).eps, 1e-5)
    atol = rtol * float(ref.abs().max().float())
    return bool(torch.allclose(got.float(), ref.float(), rtol=rtol, atol=atol))


def _looks_linear(mod: nn.Module) -> bool:
    """A module named like a linear layer with a 2-D weight (e.g. a quantized or
    tensor-parallel linear of another library) that this conversion does not handle."""
    name = type(mod).__name__
    w = getattr(mod, "weight", None)
    return ("Linear" in name or "Conv1D" in name) and isinstance(w, Tensor) and w.dim() == 2


def _convert_children(
    model: nn.Module,
    wanted: Callable[[nn.Module, str], bool],
    make: Callable[[nn.Module], nn.Module],
    done: dict[int, nn.Module],
) -> None:  # a module used at several places stays one module
    for fqn, mod in list(model.named_modules(remove_duplicate=False)):
        for name, child in list(mod._modules.items()):
            full = f"{fqn}.{name}" if fqn else name
            if child is None:
                continue
            if id(child) in done:
                setattr(mod, name, done[id(child)])
            elif wanted(child, full):
                done[id(child)] = make(child)
                setattr(mod, name, done[id(child)])


def convert_back(model: nn.Module) -> nn.Module:
    """Replace every :class:`Float8Linear` by a plain ``nn.Linear`` and every
    :class:`~lowprec.float8.conv1d.Float8Conv1D` by the ``Conv1D`` it came from, sharing
    their parameters (the scaling state is dropped), and gives back the attention that FP8
    attention replaced (:func:`~lowprec.float8.attention.remove_attention`). Returns
    ``model`` (or the new module)."""

    def plain(m: Float8Linear | Float8Experts) -> nn.Module:
        if isinstance(m, Float8Experts):
            return m.to_experts()
        if isinstance(m, Float8Router):
            return m.to_router()
        if isinstance(m, Float8Conv1D):
            return m.to_conv1d()
        orig = m.__dict__.get("_lowprec_original")
        if isinstance(orig, nn.Linear):  # the nn.Linear subclass it came from
            orig.weight, orig.bias = m.weight, m.bias
            orig.train(m.training)
            return orig
        new = nn.Linear(m.in_features, m.out_features, m.bias is not None, device="meta")
        new.weight, new.bias = m.weight, m.bias
        new.train(m.training)
        _carry_hooks(m, new)
        _carry_extras(m, new, {"weight", "bias", *m.scaling_buffers()})
        return new

    if isinstance(model, (Float8Linear, Float8Experts)):
        return plain(model)
    remove_attention(model)
    done: dict[int, nn.Module] = {}
    for mod in list(model.modules(remove_duplicate=False)):
        for name, child in list(mod._modules.items()):
            if isinstance(child, (Float8Linear, Float8Experts)):
                if id(child) not in done:
                    done[id(child)] = plain(child)
                setattr(mod, name, done[id(child)])
    return model


def replace_layer(model: nn.Module, fqn: str, config: Float8Config | None) -> nn.Module:
    """Give the linear-like layer at ``fqn`` of ``model`` the float8 ``config``, or make
    it a plain layer again (``config=None``: its own dtype, high precision), in place; the
    new layer shares the old one's parameters (an optimizer keeps working) and hooks, and
    keeps a unit-scaled layer's ``linear_fn`` (such a layer goes back to high precision as a
    float8 layer whose three GEMMs are all high precision, so its unit-scaled maths stays).
    Its float8 scaling state starts fresh. Returns
    the new layer. ``ValueError`` if ``fqn`` names no ``nn.Linear``/``Conv1D``/float8 layer.

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8))
        >>> type(replace_layer(m, "0", Float8Config.from_name("rowwise"))).__name__
        'Float8Linear'
        >>> type(replace_layer(m, "0", None)).__name__, m[0].weight is m[0].weight
        ('Linear', True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, Float8Config):
        raise TypeError(f"config must be a Float8Config or None, got {type(config).__name__}")
    parent_name, _, leaf = fqn.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, leaf) if leaf else None
    except AttributeError:
        old = None
    if not isinstance(old, nn.Module) or not (isinstance(old, nn.Linear) or is_conv1d(old)):
        raise ValueError(f"fqn: {fqn!r} is not a linear layer of the model")
    linear_fn = old.linear_fn if isinstance(old, Float8Linear) else None
    plain: nn.Module = convert_back(old) if isinstance(old, Float8Linear) else old
    if config is None and linear_fn is not None:  # keep the unit maths around the GEMM
        assert isinstance(old, Float8Linear)
        config = old.recipe.replace(high_precision_gemms=GEMMS, gemms=(), hadamard=())
    if config is None:
        new = plain
    elif isinstance(plain, nn.Linear):
        new = Float8Linear.from_linear(plain, config)
        new.linear_fn = linear_fn
    else:
        new = Float8Conv1D.from_conv1d(plain, config)
    if isinstance(new, Float8Linear):
        new.set_rng_key(fqn)
    setattr(parent, leaf, new)
    return new
