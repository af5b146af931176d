"""Optimizers with a lean training state: low-precision parameters without FP32 masters,
optimizer states in BF16 or 8 bits.

:class:`LeanAdamW`, :class:`LeanAdam` and :class:`LeanSGD` are ``torch.optim.Optimizer``\\ s
with torch's update rules (``torch.optim.AdamW``/``Adam``/``SGD`` with ``foreach=False``:
the same operations in the same order). Each step, per parameter ``p``:

1. the weight in FP32: ``w = p`` for an FP32 parameter; ``w = join(p, r)`` for a BF16
   parameter with a 16-bit remainder ``r`` (``master="remainder"``,
   :mod:`lowprec.amp.remainder`: ``w`` is the exact FP32 master); else ``w = float(p)``;
2. the states decoded to FP32 (:class:`~lowprec.amp.state_codec.StateCodec`), the update
   computed in FP32 from ``w``, the FP32 gradient and the states, the states encoded back;
3. the new ``w`` written to ``p``: exactly for FP32; split into ``(p, r)`` with the
   remainder; rounded stochastically into BF16/FP16 with ``stochastic_rounding=True``
   (``E[p] = w``: updates far below one unit of ``p`` still move it on average); else
   rounded to nearest.

So ``state="fp32"`` on FP32 parameters is torch's optimizer bit for bit, and
``state="8bit"`` differs from it only by the states' rounding (bounds in
:mod:`lowprec.amp.state_codec`). Stochastic rounding (of the parameters, and of the states
with ``state_rounding="stochastic"``) draws from ``generator`` (default: a CPU generator
seeded from torch's global one at construction); its state is part of :meth:`state_dict`,
so a resumed run draws the same numbers. ``state_dict`` / ``load_state_dict`` keep every
state tensor in its stored dtype (torch's would cast float8 codes and FP32 scales to the
parameter's dtype). Param groups keep extra keys (u-μP's ``lr_mult``) and read ``lr``
each step, so LR schedulers and ``clip_grad_norm_`` work as with torch's optimizers.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(64, 4).bfloat16()
    >>> opt = LeanAdamW(model.parameters(), lr=1e-3, state="8bit", stochastic_rounding=True)
    >>> model(torch.randn(2, 64).bfloat16()).float().sum().backward()
    >>> opt.step()
    >>> opt.state[model.weight]["exp_avg"].dtype, model.weight.dtype
    (torch.uint8, torch.bfloat16)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from lowprec.amp.remainder import join_fp32, split_fp32
from lowprec.amp.state_codec import StateCodec, state_codecs
from lowprec.core.rounding import quantize

__all__ = ["LeanAdam", "LeanAdamW", "LeanOptimizer", "LeanSGD", "lean_optimizer"]

Master = Literal["none", "remainder"]
_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class LeanOptimizer(torch.optim.Optimizer):
    """The shared machinery of the lean optimizers (module docstring); subclasses give
    the state names (:attr:`moments`) and the FP32 update (:meth:`_update`)."""

    moments: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        state: str = "fp32",
        master: Master = "none",
        stochastic_rounding: bool = False,
        generator: torch.Generator | None = None,
        block_size: int = 256,
        state_rounding: Literal["nearest", "stochastic"] = "nearest",
        codecs: tuple[StateCodec, ...] | None = None,
    ) -> None:
        super().__init__(params, defaults)
        if master not in ("none", "remainder"):
            raise ValueError(f"master must be 'none' or 'remainder', got {master!r}")
        if not isinstance(stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be a bool, got {stochastic_rounding!r}")
        if master == "remainder" and stochastic_rounding:
            raise ValueError("stochastic_rounding: a remainder keeps the exact FP32 master")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if codecs is None:
            codecs = state_codecs(state, block_size, state_rounding)[: len(self.moments)]
        if len(codecs) != len(self.moments) or not all(isinstance(c, StateCodec) for c in codecs):
            raise TypeError(f"codecs must be {len(self.moments)} StateCodecs, got {codecs!r}")
        self.codecs = dict(zip(self.moments, codecs, strict=True))
        self.master = master
        self.stochastic_rounding = stochastic_rounding
        for group in self.param_groups:
            for p in group["params"]:
                if not p.dtype.is_floating_point:
                    raise TypeError(f"params: expected floating-point parameters, got {p.dtype}")
                if master == "remainder" and p.dtype not in (torch.bfloat16, torch.float32):
                    raise ValueError(
                        f"master='remainder' needs bfloat16 parameters (BF16 + 16 bits = "
                        f"FP32), got {p.dtype}"
                    )
        if generator is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
            first = next(p for g in self.param_groups for p in g["params"])
            generator = torch.Generator(first.device).manual_seed(seed)
        self.generator = generator

    # -- the FP32 weight and its write-back -----------------------------------------------
    def _weight(self, p: Tensor, st: dict[str, Any]) -> Tensor:
        if "remainder" in st:
            return join_fp32(p.detach(), st["remainder"])
        return p if p.dtype == torch.float32 else p.detach().float()

    def _write(self, p: Tensor, w: Tensor, st: dict[str, Any]) -> None:
        if w is p:
            return
        if "remainder" in st:
            hi, lo = split_fp32(w)
            p.copy_(hi)
            st["remainder"].copy_(lo)
        elif self.stochastic_rounding and p.dtype in _LOW:
            p.copy_(quantize(w, _LOW[p.dtype], "stochastic", generator=self.generator))
        else:
            p.copy_(w)

    # -- the states -----------------------------------------------------------------------
    def _get(self, st: dict[str, Any], name: str, shape: torch.Size) -> Tensor:
        return self.codecs[name].decode(st[name], st.get(name + "_scale"), shape)

    def _put(self, st: dict[str, Any], name: str, x: Tensor) -> None:
        codes, scales = self.codecs[name].encode(x, self.generator)
        st[name] = codes
        if scales is not None:
            st[name + "_scale"] = scales

    def _init(self, p: Tensor, st: dict[str, Any]) -> None:
        st["step"] = torch.tensor(0.0)
        for name in self.moments:
            self._put(st, name, torch.zeros(p.shape, device=p.device))
        if self.master == "remainder" and p.dtype == torch.bfloat16:
            st["remainder"] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)

    def _update(self, w: Tensor, g: Tensor, st: dict[str, Any], group: dict[str, Any]) -> None:
        raise NotImplementedError  # each optimizer's own rule

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every parameter with a gradient (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                st = self.state[p]
                if not st:
                    self._init(p, st)
                w = self._weight(p, st)
                g = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
                self._update(w, g, st, group)
                self._write(p, w, st)
        return loss

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (``state``, ``param_groups``; state tensors in their
        stored dtypes) plus ``generator``: the stochastic-rounding generator's state."""
        out = super().state_dict()
        out["generator"] = self.generator.get_state()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`: the groups' options, every state tensor copied in its
        saved dtype onto its parameter's device, and the generator's state. The groups
        must match in number and size (``ValueError`` before anything changes)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"state_dict: no {key!r} entry")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"])
            for s, g in zip(saved, self.param_groups, strict=True)
        ):
            raise ValueError("state_dict: its parameter groups do not match the optimizer's")
        ids = {i: p for s, g in zip(saved, self.param_groups, strict=True)
               for i, p in zip(s["params"], g["params"], strict=True)}  # fmt: skip
        state: dict[Tensor, dict[str, Any]] = {}
        for i, st in state_dict["state"].items():
            if i not in ids:
                raise ValueError(f"state_dict: state for unknown parameter id {i!r}")
            p = ids[i]
            state[p] = {
                k: v.detach().clone().to(p.device) if isinstance(v, Tensor) else copy.deepcopy(v)
                for k, v in st.items()
            }
            state[p]["step"] = state[p]["step"].cpu()
        self.state.clear()
        self.state.update(state)
        for s, g in zip(saved, self.param_groups, strict=True):
            g.update({k: copy.deepcopy(v) for k, v in s.items() if k != "params"})
        if "generator" in state_dict:
            self.generator.set_state(state_dict["generator"])


class LeanAdamW(LeanOptimizer):
    """AdamW (decoupled weight decay) with lean parameters and states (module docstring):
    ``w ← w·(1 - lr·λ)``, ``m ← β₁m + (1-β₁)g``, ``v ← β₂v + (1-β₂)g²``,
    ``w ← w - lr/(1-β₁ᵗ) · m / (√v/√(1-β₂ᵗ) + ε)``; ``m`` is ``exp_avg``, ``v``
    ``exp_avg_sq``. The keyword arguments after ``weight_decay`` are
    :class:`LeanOptimizer`'s: ``state`` (``"fp32"``, ``"bf16"``, ``"8bit"``), ``master``,
    ``stochastic_rounding``, ``generator``, ``block_size``, ``state_rounding``, ``codecs``."""

    moments = ("exp_avg", "exp_avg_sq")
    decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **lean: Any,
    ) -> None:
        if not 0.0 <= float(lr):
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas!r}")
        if not 0.0 <= eps:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, **lean)

    def _update(self, w: Tensor, g: Tensor, st: dict[str, Any], group: dict[str, Any]) -> None:
        lr, (beta1, beta2) = float(group["lr"]), group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        m = self._get(st, "exp_avg", w.shape)
        v = self._get(st, "exp_avg_sq", w.shape)
        st["step"] += 1
        if wd != 0:
            if self.decoupled:
                w.mul_(1 - lr * wd)
            else:
                g = g.add(w, alpha=wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step = st["step"].item()
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-step_size)
        self._put(st, "exp_avg", m)
        self._put(st, "exp_avg_sq", v)


class LeanAdam(LeanAdamW):
    """Adam (L2 weight decay added to the gradient, ``g ← g + λw``), otherwise
    :class:`LeanAdamW`; ``weight_decay`` defaults to 0 as torch's."""

    decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, **kwargs: Any) -> None:
        kwargs.setdefault("weight_decay", 0.0)
        super().__init__(params, lr, **kwargs)


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
        **lean: Any,
    ) -> None:
        if not 0.0 <= float(lr):
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum must be >= 0, got {momentum!r}")
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
        if self.master == "remainder" and p.dtype == torch.bfloat16:
            st["remainder"] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)

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


_UNSUPPORTED = ("amsgrad", "maximize", "differentiable")


def lean_optimizer(optimizer: torch.optim.Optimizer, **lean: Any) -> LeanOptimizer:
    """The lean optimizer equivalent to ``optimizer`` (a ``torch.optim.AdamW``, ``Adam``
    or ``SGD`` that has not stepped yet): the same parameter groups, with their options
    and extra keys (``lr_mult``), and ``lean`` keyword arguments (``state``, ``master``,
    ``stochastic_rounding``, ``generator``, ...). ``ValueError`` for other optimizers and
    for options the lean ones do not have (``amsgrad``, ``maximize``)."""
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
        for key in _UNSUPPORTED:
            if group.get(key):
                raise ValueError(f"optimizer: {key}=True is not supported by {cls.__name__}")
    keep = {"params", "lr", "betas", "eps", "weight_decay", "momentum", "dampening", "nesterov"}
    keep |= {k for g in optimizer.param_groups for k in g if k not in optimizer.defaults}
    groups = [{k: v for k, v in g.items() if k in keep} for g in optimizer.param_groups]
    defaults: dict[str, Any] = {k: v for k, v in optimizer.defaults.items() if k in keep}
    defaults["lr"] = float(defaults["lr"])
    make: Any = cls
    return make(groups, **defaults, **lean)  # type: ignore[no-any-return]
