"""The lean optimizers' update rules: AdamW, Adam and SGD on :class:`~lowprec.amp.lean.
LeanOptimizer` (lean parameters and states; the machinery and its contract are in
:mod:`lowprec.amp.lean`), and :func:`lean_optimizer`, a torch optimizer's lean twin."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Real
from typing import Any

import torch
from torch import Tensor

from lowprec.amp.lean import LeanOptimizer

__all__ = ["LeanAdam", "LeanAdamW", "LeanSGD", "lean_optimizer"]


_UNSUPPORTED = ("amsgrad", "maximize", "differentiable")


def _check_unsupported(cls: str, options: Mapping[str, Any]) -> None:
    """``ValueError`` for a torch option in :data:`_UNSUPPORTED` that ``options`` sets to
    anything but ``False`` (the lean optimizers take ``False``, as torch's do, so that
    torch's keyword arguments carry over; they have no such variant)."""
    for key in _UNSUPPORTED:
        if options.get(key, False) is not False:
            if options[key] is True:
                raise ValueError(f"optimizer: {key}=True is not supported by {cls}")
            raise ValueError(f"{key}: {cls} takes only False, got {options[key]!r}")


def _check_betas(betas: Any) -> tuple[float, float]:
    """``betas`` as two floats in ``[0, 1)`` (Python numbers or one-element float tensors,
    as torch takes them); ``ValueError`` naming ``betas`` otherwise."""

    def real(b: Any) -> bool:
        if isinstance(b, Tensor):
            return b.numel() == 1 and b.dtype.is_floating_point
        return isinstance(b, Real) and not isinstance(b, bool)

    ok = isinstance(betas, (tuple, list)) and len(betas) == 2
    if ok and all(real(b) for b in betas):
        b1, b2 = float(betas[0]), float(betas[1])
        if 0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0:
            return b1, b2
    raise ValueError(f"betas must be two floats in [0, 1), got {betas!r}")


class LeanAdamW(LeanOptimizer):
    """AdamW (decoupled weight decay) with lean parameters and states (module docstring):
    ``w ← w·(1 - lr·λ)``, ``m ← β₁m + (1-β₁)g``, ``v ← β₂v + (1-β₂)g²``,
    ``w ← w - lr/(1-β₁ᵗ) · m / (√v/√(1-β₂ᵗ) + ε)``; ``m`` is ``exp_avg``, ``v``
    ``exp_avg_sq``. ``decoupled_weight_decay`` is a per-group option, as in torch's
    Adam/AdamW: ``False`` makes a group's decay Adam's L2 term ``g ← g + λw`` instead.
    ``amsgrad``, ``maximize`` and ``differentiable`` are accepted as ``False`` only
    (torch compatibility). The keyword arguments after them are
    :class:`LeanOptimizer`'s: ``state`` (``"fp32"``, ``"bf16"``, ``"8bit"``), ``master``,
    ``stochastic_rounding``, ``generator``, ``block_size``, ``state_rounding``, ``codecs``.

    Non-finite elements are kept per element, as in FP32 (state_codec's module
    docstring): once an element's ``v`` is ``+inf`` (``(1-β₂)g²`` overflows FP32: ``|g| ≳
    5.8·10^20`` for ``β₂ = 0.999``) its
    update is ``m / ∞ = 0`` for good, whatever its (finite) ``m``, as torch's; with an
    8-bit first moment that ``m`` (up to ``0.1·|g|``) is stored as 0, so that it does not
    set its block's scale and round its neighbours' ``m`` to 0."""

    moments = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        decoupled_weight_decay: bool = True,
        amsgrad: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
        **lean: Any,
    ) -> None:
        name = type(self).__name__
        _check_unsupported(
            name, {"amsgrad": amsgrad, "maximize": maximize, "differentiable": differentiable}
        )
        if not 0.0 <= float(lr):
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        betas = _check_betas(betas)
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if not isinstance(decoupled_weight_decay, bool):
            raise TypeError(
                f"decoupled_weight_decay must be a bool, got {decoupled_weight_decay!r}"
            )
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": decoupled_weight_decay,
        }
        super().__init__(params, defaults, **lean)

    def _update(self, w: Tensor, g: Tensor, st: dict[str, Any], group: dict[str, Any]) -> None:
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        m = self._get(st, "exp_avg", w.shape)
        v = self._get(st, "exp_avg_sq", w.shape)
        st["step"] += 1
        if wd != 0:
            if group["decoupled_weight_decay"]:
                w.mul_(1 - lr * wd)
            else:
                g = g.add(w, alpha=wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step = st["step"].item()
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-step_size)
        if self.codec("exp_avg", w.dim()).blocked:  # m / ∞ = 0 for good (class docstring)
            m.masked_fill_(v == math.inf, 0.0)  # m is a decoded copy here
        self._put(st, "exp_avg", m)
        self._put(st, "exp_avg_sq", v)


class LeanAdam(LeanAdamW):
    """Adam: :class:`LeanAdamW` with ``weight_decay`` 0 and ``decoupled_weight_decay``
    ``False`` by default, as torch's (L2 weight decay added to the gradient,
    ``g ← g + λw``; a group with ``decoupled_weight_decay=True`` decays as AdamW)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decoupled_weight_decay, **kwargs)


class LeanSGD(LeanOptimizer):
    """SGD with momentum as torch's: ``g ← g + λw``; ``b ← g`` at the first step, then
    ``b ← μb + (1-τ)g``; ``d = g + μb`` (Nesterov) or ``b``; ``w ← w - lr·d``. The momentum
    buffer ``b`` (``momentum_buffer``) is stored with the first-moment codec of ``state``;
    with ``momentum=0`` there is no state."""

    moments = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
        **lean: Any,
    ) -> None:
        _check_unsupported(
            type(self).__name__, {"maximize": maximize, "differentiable": differentiable}
        )
        if not 0.0 <= float(lr):
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum must be >= 0, got {momentum!r}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if not 0.0 <= dampening <= 1.0:
            raise ValueError(f"dampening must be in [0, 1], got {dampening!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        super().__init__(params, defaults, **lean)

    def _init(self, p: Tensor, st: dict[str, Any]) -> None:
        st["step"] = torch.tensor(0.0)
        self._init_remainder(p, st)

    def _update(self, w: Tensor, g: Tensor, st: dict[str, Any], group: dict[str, Any]) -> None:
        lr, mu, wd = float(group["lr"]), group["momentum"], group["weight_decay"]
        st["step"] += 1
        if wd != 0:
            g = g.add(w, alpha=wd)
        if mu != 0:
            if "momentum_buffer" not in st:
                buf = g.detach().clone()
            else:
                buf = self._get(st, "momentum_buffer", w.shape)
                buf.mul_(mu).add_(g, alpha=1 - group["dampening"])
            g = g.add(buf, alpha=mu) if group["nesterov"] else buf
            self._put(st, "momentum_buffer", buf)
        w.add_(g, alpha=-lr)


def lean_optimizer(optimizer: torch.optim.Optimizer, **lean: Any) -> LeanOptimizer:
    """The lean optimizer equivalent to ``optimizer`` (a ``torch.optim.AdamW``, ``Adam``
    or ``SGD`` that has not stepped yet): the same parameter groups, with their options
    and extra keys (``lr_mult``, and each group's ``decoupled_weight_decay`` for Adam and
    AdamW), and ``lean`` keyword arguments (``state``, ``master``,
    ``stochastic_rounding``, ``generator``, ...). ``ValueError`` for other optimizers and
    for options the lean ones do not have (``amsgrad``, ``maximize``, ``differentiable``
    set to True)."""
    kinds: dict[type, type[LeanOptimizer]] = {
        torch.optim.AdamW: LeanAdamW,
        torch.optim.Adam: LeanAdam,
        torch.optim.SGD: LeanSGD,
    }
    cls = kinds.get(type(optimizer))
    if cls is None:
        raise ValueError(
            f"optimizer: lean optimizer states exist for torch.optim.AdamW, Adam and SGD, "
            f"got {type(optimizer).__name__}"
        )
    if cls is LeanAdam and optimizer.defaults.get("decoupled_weight_decay"):
        cls = LeanAdamW  # Adam(decoupled_weight_decay=True) is AdamW
    if optimizer.state:
        raise ValueError("optimizer: convert it before its first step (it has state)")
    for group in optimizer.param_groups:
        _check_unsupported(cls.__name__, {k: bool(group.get(k)) for k in _UNSUPPORTED})
    keep = {"params", "lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov"}
    if cls is not LeanSGD:  # per group, as torch's Adam/AdamW read it
        keep.add("decoupled_weight_decay")
    keep |= {k for g in optimizer.param_groups for k in g if k not in optimizer.defaults}
    groups = [{k: v for k, v in g.items() if k in keep} for g in optimizer.param_groups]
    defaults: dict[str, Any] = {k: v for k, v in optimizer.defaults.items() if k in keep}
    defaults["lr"] = float(defaults["lr"])
    make: Any = cls
    return make(groups, **defaults, **lean)  # type: ignore[no-any-return]
