"""Module conversion and unit-variance re-initialisation for :func:`lowprec.unit.unit_scale`.

torch's own layers (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``,
``nn.Conv1d``) call ``torch.nn.functional`` ops that the unit mode converts. Other leaf
modules with parameters are recognised by what they compute, never by their class: a
*probe* runs the module once on a random input, with a random ``weight`` (restored after),
and compares the output with a candidate formula:

* norm-like (1-D ``weight``, optional 1-D ``bias``): ``F.rms_norm`` (gain ``w``, or
  ``1 + w`` as Gemma's) or ``F.layer_norm`` with the module's ``eps``/``variance_epsilon``/
  ``epsilon`` (HF's ``LlamaRMSNorm``, T5's norm, ...);
* linear-like (2-D ``weight``, optional 1-D ``bias``): ``x @ W + b`` (HF's ``Conv1D``,
  weight ``(in, out)``) or ``x Wᵀ + b`` (a custom linear);
* activation-like (no parameters, not a ``torch.nn`` class): ``gelu`` (exact or tanh:
  GPT-2's ``NewGELUActivation``), ``silu``, ``relu``.

A subclass of ``nn.Linear`` or ``nn.Embedding`` with its own ``forward`` is probed too:
a linear that computes ``x Wᵀ + b`` its own way (Falcon's ``FalconLinear``) is converted as
above; an embedding whose lookup is multiplied by a constant ``c`` (Gemma's
``GemmaScaledWordEmbedding``, ``c = √d``) becomes the plain lookup, ``c`` dropped. The
constant belongs to the standard parametrization, where it lifts an ``N(0, σ²)`` table
(σ ≈ 0.02) to ``O(1)`` activations; a unit-scaled embedding is ``N(0, 1)`` already, and
``c`` would put the residual stream at std ``c`` (5.7 for width 32).

A match swaps the module's class for a subclass whose ``forward`` calls that formula as
the ``F`` op (``F.rms_norm``, ``F.linear(x, Wᵀ, b)``, ...), so the unit mode turns it into
the unit op; parameters, names and ``state_dict`` keys are unchanged. A module that
matches no formula (e.g. a norm by the L2 norm, ``x/‖x‖·w``) is left as it is and
reported.

Example:
    >>> from torch import nn
    >>> class MyRMSNorm(nn.Module):
    ...     def __init__(self, d):
    ...         super().__init__(); self.weight = nn.Parameter(torch.ones(d)); self.eps = 1e-6
    ...     def forward(self, x):
    ...         return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    >>> m = nn.Sequential(nn.Linear(4, 8), MyRMSNorm(8))
    >>> convert_modules(m)
    (['1 (MyRMSNorm: rms_norm)'], [])
    >>> type(m[1]).__name__
    'UnitMyRMSNorm'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["convert_modules", "reinit"]

_TORCH_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Conv1d)
_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _eps(m: nn.Module) -> float | None:
    for a in _EPS_NAMES:
        v = getattr(m, a, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _rms_forward(self: Any, x: Tensor) -> Tensor:
    w = self.weight
    return F.rms_norm(x, (w.shape[0],), w.to(x.dtype), self._unit_eps)


def _rms1p_forward(self: Any, x: Tensor) -> Tensor:
    w = self.weight
    return F.rms_norm(x, (w.shape[0],), 1.0 + w.to(x.dtype), self._unit_eps)


def _ln_forward(self: Any, x: Tensor) -> Tensor:
    w, b = self.weight, self.bias
    return F.layer_norm(x, (w.shape[0],), w.to(x.dtype), b.to(x.dtype), self._unit_eps or 1e-5)


def _linear_t_forward(self: Any, x: Tensor) -> Tensor:
    return F.linear(x, self.weight.t(), self.bias)


def _linear_forward(self: Any, x: Tensor) -> Tensor:
    return F.linear(x, self.weight, self.bias)


_ACTS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu (tanh)": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def _act_forward(self: Any, x: Tensor) -> Tensor:
    return _ACTS[self._unit_form](x)


def _probe_act(m: nn.Module) -> str | None:
    """The activation a parameter-free module computes (``_ACTS``), or ``None``."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 2.0
    try:
        with torch.no_grad():
            out = m(x)
    except Exception:
        return None
    return next((name for name, f in _ACTS.items() if _close(out, f(x))), None)


def _embedding_forward(self: Any, ids: Tensor) -> Tensor:
    return nn.Embedding.forward(self, ids)


def _probe_embedding_scale(m: nn.Embedding) -> float | None:
    """``c`` if ``m(ids) == c · lookup(ids)`` for a constant ``c`` (on random ids), else None."""
    ids = torch.randint(0, m.num_embeddings, (3, 5), generator=torch.Generator().manual_seed(0))
    ids = ids.to(m.weight.device)
    try:
        with torch.no_grad():
            out, ref = m(ids), nn.Embedding.forward(m, ids)
    except Exception:
        return None
    if not isinstance(out, Tensor) or out.shape != ref.shape:
        return None
    big = ref.abs() > 1e-6 * float(ref.abs().max())
    if not bool(big.any()):
        return None
    c = float((out[big].double() / ref[big].double()).median())
    return c if c != 0.0 and _close(out, c * ref) else None


_FORMS: dict[str, tuple[Callable[..., Tensor], dict[str, Any]]] = {
    "rms_norm": (_rms_forward, {"_unit_role": "norm"}),
    "rms_norm (1 + w)": (_rms1p_forward, {"_unit_role": "norm"}),
    "layer_norm": (_ln_forward, {"_unit_role": "norm"}),
    "linear (x @ W + b, W (in, out))": (_linear_t_forward, {"_unit_weight_in_dim": 0}),
    "linear (x Wᵀ + b)": (_linear_forward, {}),
    "embedding": (_embedding_forward, {}),
}


def _close(a: object, b: Tensor) -> bool:
    if not isinstance(a, Tensor) or a.shape != b.shape:
        return False
    tol = 1e-4 if a.dtype in (torch.float32, torch.float64) else 3e-2
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def _probe(m: nn.Module) -> str | None:
    """The name of the formula ``m`` computes (see the module doc), or ``None``."""
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    if not isinstance(w, Tensor) or not w.is_floating_point() or w.device.type == "meta":
        return None
    if b is not None and not (isinstance(b, Tensor) and b.dim() == 1):
        return None
    saved = [p.detach().clone() for p in (w, b) if p is not None]
    gen = torch.Generator(device=w.device).manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=w.device).to(w.dtype)

    cands: list[tuple[str, Tensor, Callable[[Tensor], Tensor]]] = []
    with torch.no_grad():
        w.copy_(rand(*w.shape) + (1.0 if w.dim() == 1 else 0.0))
        if b is not None:
            b.copy_(rand(*b.shape))
        eps = _eps(m)
        if w.dim() == 1:
            x = rand(5, w.shape[0]) * 3.0
            if b is None:
                cands.append(("rms_norm", x, lambda x: F.rms_norm(x, w.shape, w, eps)))
                cands.append(("rms_norm (1 + w)", x, lambda x: F.rms_norm(x, w.shape, 1 + w, eps)))
            else:
                ln_eps = 1e-5 if eps is None else eps
                cands.append(("layer_norm", x, lambda x: F.layer_norm(x, w.shape, w, b, ln_eps)))
        elif w.dim() == 2:
            n_in, n_out = w.shape
            if b is None or b.shape[0] == n_out:
                cands.append(("linear (x @ W + b, W (in, out))", rand(5, n_in),
                              lambda x: x @ w if b is None else x @ w + b))  # fmt: skip
            if b is None or b.shape[0] == n_in:
                cands.append(("linear (x Wᵀ + b)", rand(5, n_out), lambda x: F.linear(x, w, b)))
        found = None
        for name, x, ref in cands:
            try:
                out = m(x)
            except Exception:
                continue
            if _close(out, ref(x)):
                found = name
                break
        for p, s in zip([p for p in (w, b) if p is not None], saved, strict=True):
            p.copy_(s)
    return found


def convert_modules(model: nn.Module) -> tuple[list[str], list[str]]:
    """Swap the class of each norm-like and linear-like leaf module of ``model`` (in place)
    for one that calls the matching ``F`` op (see the module doc).

    Returns ``(converted, left)``: ``"name (Class: formula)"`` for each converted module
    and ``"name (Class): cause"`` for each leaf module with parameters that has no rule.
    """
    converted: list[str] = []
    left: list[str] = []
    for name, m in model.named_modules():
        own = dict(m.named_parameters(recurse=False))
        cls = type(m)
        if list(m.children()) or getattr(cls, "_unit_form", None) in ("experts", "router"):
            continue  # (MoE experts and routers: lowprec.unit.moe)
        if isinstance(m, _TORCH_TYPES):
            _convert_subclass(name, m, converted)
            continue
        if not own:  # an activation written out (GPT-2's tanh GELU), not torch's module
            act = None if cls.__module__.startswith("torch.") else _probe_act(m)
            if act is not None:
                attrs = {"forward": _act_forward, "__module__": cls.__module__, "_unit_form": act}
                m.__class__ = type(f"Unit{cls.__name__}", (cls,), attrs)
                converted.append(f"{name or '<root>'} ({cls.__name__}: {act})")
            continue
        form = _probe(m) if set(own) <= {"weight", "bias"} else None
        if form is None:
            left.append(
                f"{name or '<root>'} ({cls.__name__}): parameters {sorted(own)} of a module "
                "whose forward matches no unit rule (rms_norm, layer_norm, linear); its "
                "weights keep their init and its ops run with their own rules"
            )
            continue
        fwd, attrs = _FORMS[form]
        new = type(f"Unit{cls.__name__}", (cls,), {"forward": fwd, "__module__": cls.__module__,
                                                   "_unit_form": form, **attrs})  # fmt: skip
        m.__class__ = new
        object.__setattr__(m, "_unit_eps", _eps(m))
        converted.append(f"{name or '<root>'} ({cls.__name__}: {form.split(' (')[0]})")
    return converted, left


def _convert_subclass(name: str, m: nn.Module, converted: list[str]) -> None:
    """A subclass of ``nn.Linear`` / ``nn.Embedding`` with its own ``forward`` (see the
    module doc): converted when the probe recognises it, else left to the op rules."""
    cls = type(m)
    base = nn.Linear if isinstance(m, nn.Linear) else nn.Embedding
    if not isinstance(m, (nn.Linear, nn.Embedding)) or cls.forward is base.forward:
        return
    if set(dict(m.named_parameters(recurse=False))) > {"weight", "bias"}:
        return
    if isinstance(m, nn.Embedding):
        c = _probe_embedding_scale(m)
        if c is None:
            return
        form, what = "embedding", f"embedding, scale {c:.4g} dropped"
    else:
        if _probe(m) != "linear (x Wᵀ + b)":
            return
        form = what = "linear (x Wᵀ + b)"
    fwd, attrs = _FORMS[form]
    m.__class__ = type(f"Unit{cls.__name__}", (cls,), {"forward": fwd, "__module__": cls.__module__,
                                                       "_unit_form": form, **attrs})  # fmt: skip
    converted.append(f"{name or '<root>'} ({cls.__name__}: {what.split(' (')[0]})")


def reinit(model: nn.Module) -> list[str]:
    """Unit-variance init in place: linear-like weights (torch's and converted), MoE
    expert and router weights (:mod:`lowprec.unit.moe`) and embeddings ``N(0, 1)`` (an
    embedding's ``padding_idx`` row zero, as torch's init),
    biases 0, norm gains 1; a weight tied to an earlier module's (an output layer sharing
    the input embedding) keeps that module's init. Returns ``"name (Class): parameters
    [...]"`` for each module whose own parameters (biases aside) it left at their init
    (e.g. ViT's class token and position embeddings, parameters of a non-leaf module)."""
    left: list[str] = []
    seen: set[int] = set()  # a tied weight is initialised once, by its first module
    with torch.no_grad():
        for name, m in model.named_modules():
            form = getattr(type(m), "_unit_form", "")
            w = getattr(m, "weight", None)
            if isinstance(w, Tensor) and id(w) in seen:
                continue
            seen.update(id(p) for p in m.parameters(recurse=False))
            if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d)) or form.startswith("linear"):
                nn.init.normal_(m.weight)
                pad = getattr(m, "padding_idx", None) if isinstance(m, nn.Embedding) else None
                if pad is not None:
                    m.weight[pad].zero_()
                if isinstance(getattr(m, "bias", None), Tensor):
                    nn.init.zeros_(m.bias)
            elif form in ("experts", "router"):  # lowprec.unit.moe: weights N(0, 1), biases 0
                for pname, p in m.named_parameters(recurse=False):
                    (nn.init.zeros_ if pname.endswith("bias") else nn.init.normal_)(p)
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or "norm" in form:
                if getattr(m, "weight", None) is not None:  # gain 1: w = 1, or 0 in (1 + w)
                    (nn.init.zeros_ if "1 + w" in form else nn.init.ones_)(m.weight)
                if isinstance(getattr(m, "bias", None), Tensor):
                    nn.init.zeros_(m.bias)
            else:
                own = sorted(k for k, _ in m.named_parameters(recurse=False) if k != "bias")
                if own:
                    left.append(f"{name or '<root>'} ({type(m).__name__}): parameters {own}")
    return left
