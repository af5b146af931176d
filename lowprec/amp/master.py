"""FP32 master weights around an optimizer for FP16/BF16 parameters.

:class:`MasterWeights` keeps FP32 copies of FP16/BF16 parameters: gradients are copied to
FP32, the inner optimizer updates the FP32 copies, and the result is written back (rounded
to nearest, or stochastically for BF16/FP16: unbiased, ``E[round(m)] = m``).

It is a :class:`torch.optim.Optimizer`: its ``param_groups`` *are* the inner optimizer's
groups (over the FP32 masters), so an LR scheduler or a loop that sets ``group["lr"]``
changes the real update; ``add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` behave as torch's.

Gradient edits between ``scaler.unscale_(opt)`` and ``opt.step()`` (``clip_grad_norm_``,
``clip_grad_value_`` or any in-place change of the model's gradients) reach the update:
:meth:`MasterWeights.push_grads` writes the unscaled FP32 gradients into the model's
gradients (rounded to their dtype), and ``step`` carries any change made to them onward to
the FP32 gradients as a per-element factor ``g_after / g_before``. For a clip by ``c`` the
FP32 gradient becomes ``c · g32`` up to one rounding of ``g_before · c`` in the model's
dtype (relative ``2^-11`` for FP16, ``2^-8`` for BF16). An element whose low-precision
gradient was zero (underflow) takes the tensor's least-squares factor
``Σ g_after g_before / Σ g_before²`` (``c`` for a uniform clip), unless it was set to a
non-zero value, which is then taken as it is. A clip that zeroes every gradient because
their norm overflowed the model's dtype (``clip_grad_norm_`` of FP16 gradients whose norm
passes 65504 divides by ``inf``) is logged: the update is then zero, as torch's is for
FP16 parameters; :meth:`MasterWeights.clip_grad_norm_` clips by the FP32 norm.

A step's gradients are copied once, and taken afresh when the model's gradients are new
tensors since (``model.zero_grad()`` or ``p.grad = None`` and another backward) or when the
loss scaler skipped the step or ended it (:meth:`MasterWeights.discard_grads`). Model
parameters changed in place since the last write-back (``model.load_state_dict``, an
initialisation under ``torch.no_grad()``) are taken into the masters before the next step
(elements that moved by more than their dtype's rounding of the master), not overwritten
by it. A ``closure`` (LBFGS) evaluates the model at the optimizer's trial points: the
masters are written back before each of its calls after the first.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lowprec import _faults
from lowprec.core.rounding import quantize
from lowprec.core.warn import warn_once, warned

__all__ = ["MasterWeights"]

_log = logging.getLogger(__name__)
_ROUNDED_NORM = "master:rounded_norm"


def _groups(given: list[Any]) -> list[dict[str, Any]]:
    """``given`` (parameters or parameter groups) as a list of groups with list params."""
    if given and all(isinstance(g, dict) for g in given):
        groups = [dict(g) for g in given]
        for i, g in enumerate(groups):
            if "params" not in g:
                raise ValueError(f"params: group {i} has no 'params' key")
            ps = g["params"]
            g["params"] = [ps] if isinstance(ps, Tensor) else list(ps)
        return groups
    if any(isinstance(g, dict) for g in given):
        raise TypeError("params: mix of parameter groups (dicts) and parameters")
    return [{"params": given}]


def _master(p: Tensor) -> nn.Parameter:
    if not isinstance(p, Tensor):
        raise TypeError(f"params: expected tensors, got {type(p).__name__}")
    if not p.dtype.is_floating_point:
        raise TypeError(f"params: expected floating-point parameters, got {p.dtype}")
    return nn.Parameter(p.detach().to(torch.float32).clone())


class MasterWeights(torch.optim.Optimizer):
    """FP32 master copies of low-precision parameters around an inner optimizer.

    ``optimizer_factory(master_params)`` builds the inner optimizer on the FP32 copies.
    ``params`` may also be parameter groups (dicts with ``"params"`` and per-group options
    such as ``"lr"``): the factory then gets the same groups over the FP32 copies.
    ``step()`` copies the model's gradients to FP32 (if not yet done), runs the inner step,
    and writes the FP32 result back into the model's parameters: rounded to nearest, or
    with ``stochastic_rounding=True`` stochastically (unbiased; for BF16/FP16 parameters),
    drawing from ``generator`` (default: its own, seeded from torch's global generator at
    construction; its state is in :meth:`state_dict`, and data parallelism broadcasts it
    so that every replica rounds alike).

    ``param_groups`` and ``state`` are the inner optimizer's (over the masters), ``defaults``
    its defaults. ``add_param_group`` takes model parameters and gives them FP32 masters.

    Example:
        >>> model = nn.Linear(4, 2).bfloat16()
        >>> opt = MasterWeights(model.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1))
        >>> opt.master_params[0].dtype, isinstance(opt, torch.optim.Optimizer)
        (torch.float32, True)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
        >>> opt.optimizer.param_groups[0]["lr"]  # the scheduler set the inner optimizer's lr
        0.05
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_factory: Callable[[list[Any]], torch.optim.Optimizer],
        stochastic_rounding: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        if isinstance(params, Tensor):
            raise TypeError("params: expected an iterable of parameters or groups, got a Tensor")
        groups = _groups(list(params))
        self.model_params: list[Tensor] = [p for g in groups for p in g["params"]]
        if not self.model_params:
            raise ValueError("params: no parameters given")
        if len({id(p) for p in self.model_params}) != len(self.model_params):
            raise ValueError("params: a parameter appears more than once")
        self.master_params: list[nn.Parameter] = [_master(p) for p in self.model_params]
        it = iter(self.master_params)
        master_groups = [{**g, "params": [next(it) for _ in g["params"]]} for g in groups]
        if len(groups) == 1 and set(groups[0]) == {"params"}:
            self.optimizer = optimizer_factory(master_groups[0]["params"])
        else:
            self.optimizer = optimizer_factory(master_groups)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer_factory must return a torch.optim.Optimizer, got "
                f"{type(self.optimizer).__name__}"
            )
        if not isinstance(stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be a bool, got {stochastic_rounding!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"generator must be a torch.Generator or None, got {type(generator).__name__}"
            )
        if stochastic_rounding and generator is None:  # its own: in state_dict, syncable
            generator = torch.Generator(self.master_params[0].device)
            generator.manual_seed(int(torch.randint(0, 2**62, (), dtype=torch.int64)))
        self.stochastic_rounding = stochastic_rounding
        self.generator = generator
        # the model's gradients copy_grads copied this step; None: not copied this step
        self._copied: list[Tensor | None] | None = None
        self._pushed: list[tuple[Tensor | None, int]] | None = None
        self._written = [_version(p) for p in self.model_params]  # at the last write-back
        # torch.optim.Optimizer's bookkeeping, without its own param_groups/state (the
        # inner optimizer's are used): hooks, the profiled step.
        self.defaults = self.optimizer.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()
        self._warned_capturable_if_run_uncaptured = True

    # -- the inner optimizer's groups and state, as this optimizer's ----------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> defaultdict[Tensor, Any]:
        return self.optimizer.state

    @state.setter
    def state(self, state: defaultdict[Tensor, Any]) -> None:
        self.optimizer.state = state

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of *model* parameters: each gets an FP32 master, and the inner
        optimizer gets the group over the masters (with the group's other options)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        (group,) = _groups([param_group])
        known = {id(p) for p in self.model_params}
        if any(id(p) in known for p in group["params"]):
            raise ValueError("param_group: some parameters appear in more than one group")
        masters = [_master(p) for p in group["params"]]
        self.optimizer.add_param_group({**group, "params": masters})
        self.model_params.extend(group["params"])
        self.master_params.extend(masters)
        self._written.extend(_version(p) for p in group["params"])
        if self._copied is not None:  # mid-step: the new masters get this step's gradients
            for p, m in zip(group["params"], masters, strict=True):
                m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
                self._copied.append(p.grad)
            if self._pushed is not None:
                self._pushed.extend((p.grad, _version(p.grad)) for p in group["params"])

    # -- gradients -------------------------------------------------------------------------
    def copy_grads(self) -> None:
        """Copy the model's gradients into the FP32 masters (once per step: again only
        where the model's gradients are other tensors than the ones copied, i.e. new)."""
        if self._copied is not None and all(
            p.grad is g for p, g in zip(self.model_params, self._copied, strict=True)
        ):
            return
        for p, m in zip(self.model_params, self.master_params, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().to(torch.float32)
        self._copied = [p.grad for p in self.model_params]
        self._pushed = None

    def discard_grads(self) -> None:
        """End a step without an update (a loss scaler's skipped or ended step): the next
        :meth:`copy_grads` copies the model's gradients afresh, even where they are the
        same tensors (``zero_grad(set_to_none=False)`` and another backward)."""
        self._copied = None
        self._pushed = None

    @torch.no_grad()
    def push_grads(self) -> None:
        """Write the masters' FP32 gradients into the model's gradients (rounded to their
        dtype), so that the model shows this step's (unscaled) gradients and edits of them
        before :meth:`step` reach the update (the module docstring says how)."""
        self.copy_grads()
        pairs = self._write_model_grads()
        # Only FP16 underflows at the gradients' scale (BF16 has FP32's range), and the
        # check (two norms and a host sync) stops once it has warned.
        fp16 = [(g, m) for g, m in pairs if g.dtype == torch.float16]
        if fp16 and not warned(_ROUNDED_NORM):
            self._check_rounded_norm(fp16)

    def _write_model_grads(self) -> list[tuple[Tensor, Tensor]]:
        """The FP32 gradients written into the model's (rounded to their dtype), recorded
        for :meth:`_pull_edits`; the ``(model, master)`` gradient pairs of another dtype."""
        pairs = []
        for p, m in zip(self.model_params, self.master_params, strict=True):
            if p.grad is not None and m.grad is not None:
                p.grad.copy_(m.grad)
                if p.grad.dtype != m.grad.dtype:
                    pairs.append((p.grad, m.grad))
        self._pushed = [(p.grad, _version(p.grad)) for p in self.model_params]
        return pairs

    def _check_rounded_norm(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Warn once when the model's low-precision gradients hold a norm more than 0.1%
        off the FP32 gradients' (FP16 underflow: a loss far below 1): a
        ``clip_grad_norm_`` of the model's parameters would clip by the wrong factor."""
        low = torch.stack(torch._foreach_norm([g.float() for g, _ in pairs])).norm()
        high = torch.stack(torch._foreach_norm([m for _, m in pairs])).norm()
        lo, hi = float(low), float(high)
        if math.isfinite(hi) and hi > 0 and abs(lo - hi) > 1e-3 * hi:
            warn_once(
                _log,
                _ROUNDED_NORM,
                "the unscaled gradients rounded to the model's dtype have norm %.3g, the FP32 "
                "gradients %.3g (underflow): torch.nn.utils.clip_grad_norm_ of the model's "
                "parameters would clip by the wrong factor; clip the FP32 gradients with "
                "optimizer.clip_grad_norm_(max_norm) (MasterWeights) instead",
                lo,
                hi,
            )

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the FP32 gradients (the masters'), with
        any edit of the model's gradients since :meth:`push_grads` taken first; the model's
        gradients then show the clipped values. Returns the FP32 gradients' total norm.

        Unlike a clip of the model's FP16/BF16 gradients, the norm is exact where those
        underflow (unscaled gradients below FP16's normal range, ``6.1e-5``)."""
        self.copy_grads()
        self._pull_edits()
        grads = [m for m in self.master_params if m.grad is not None]
        total = torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type)
        self._write_model_grads()
        return total

    @torch.no_grad()
    def _pull_edits(self) -> None:
        """Carry edits of the model's gradients made since :meth:`push_grads` to the FP32
        gradients (per-element factor; see the module docstring)."""
        if self._pushed is None:
            return
        zeroed: list[Tensor] = []  # per FP16 gradient: its norm² if an edit zeroed it all
        for p, m, (g0, v0) in zip(self.model_params, self.master_params, self._pushed, strict=True):
            g = p.grad
            if g is g0 and (g is None or _version(g) == v0):
                continue
            if g is None:
                m.grad = None
                continue
            now = g.detach().to(torch.float32)
            if m.grad is None:
                m.grad = now.clone()
                continue
            before = m.grad.to(p.dtype).to(torch.float32)  # what push_grads wrote
            nz = before != 0
            den = (before * before).sum()
            if g.dtype == torch.float16:
                zeroed.append(torch.where((now == 0).all(), den, 0.0))
            lsq = torch.where(den > 0, (now * before).sum() / den.clamp_min(1e-38), 1.0)
            factor = torch.where(nz, now / torch.where(nz, before, 1.0), lsq)
            m.grad = torch.where(nz | (now == 0), m.grad * factor, now)
        self._pushed = None
        if zeroed:
            norm = float(torch.stack(zeroed).sum().sqrt())  # of the FP16 gradients zeroed
            if norm > torch.finfo(torch.float16).max:
                _log.warning(
                    "the model's FP16 gradients were all set to zero after unscale_: their "
                    "norm, %.4g, overflows FP16, so torch.nn.utils.clip_grad_norm_ of the "
                    "model's parameters computed inf and clipped by 0; this step's update "
                    "is zero. Clip the FP32 gradients with optimizer.clip_grad_norm_"
                    "(max_norm) (MasterWeights) instead",
                    norm,
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Copy the gradients to FP32 (with any edits of the model's gradients since
        :meth:`push_grads`), step the inner optimizer, write the masters back. A
        ``closure`` (re-evaluating the model's loss) has its gradients copied each call."""
        self.take_model_edits()
        if closure is None:
            self.copy_grads()
            self._pull_edits()
            _faults.point("optimizer")
            loss = self.optimizer.step()
        else:
            calls = 0

            def inner() -> Any:
                nonlocal calls
                if calls:  # the optimizer moved the masters: evaluate the model there
                    self._write_back()
                calls += 1
                with torch.enable_grad():
                    out = closure()
                self.discard_grads()
                self.copy_grads()
                return out

            loss = self.optimizer.step(inner)
        _faults.point("writeback")
        self._write_back()
        self.discard_grads()
        return loss

    @torch.no_grad()
    def _write_back(self) -> None:
        """The masters into the model's parameters (rounded to nearest, or
        stochastically), and the parameters' versions after it."""
        for p, m in zip(self.model_params, self.master_params, strict=True):
            if self.stochastic_rounding and p.dtype in (torch.bfloat16, torch.float16):
                fmt = "bf16" if p.dtype == torch.bfloat16 else "fp16"
                p.copy_(quantize(m, fmt, rounding="stochastic", generator=self.generator))
            else:
                p.copy_(m)
        self._written = [_version(p) for p in self.model_params]

    @torch.no_grad()
    def take_model_edits(self) -> None:
        """Take the model parameters changed in place since the last write-back into their
        masters (``step`` and ``state_dict`` call it). In a changed parameter an element
        is taken where it differs from its master by more than the write-back's rounding
        could (``|p - m| > eps·|m| + δ`` for the dtype's ``eps`` and subnormal spacing
        ``δ``, and ``p`` is not ``m`` rounded to nearest); others keep the master's FP32
        value. A change through ``p.data`` (no version bump) is not seen."""
        for i, (p, m) in enumerate(zip(self.model_params, self.master_params, strict=True)):
            v = _version(p)
            if v == self._written[i]:
                continue
            new = p.detach()
            if new.dtype == m.dtype:
                m.copy_(new)
            else:
                fi = torch.finfo(new.dtype)
                up = new.to(torch.float32)
                tol = fi.eps * m.abs() + fi.smallest_normal * fi.eps
                moved = (new != m.to(new.dtype)) & ~((up - m).abs() <= tol)
                m.copy_(torch.where(moved, up, m))
            self._written[i] = v

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.discard_grads()

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict (``"optimizer"``), the FP32 masters
        (``"master"``), the model's low-precision parameters (``"params"``: with stochastic
        rounding they are not the masters rounded to nearest) and the generator's state.
        Model parameters changed since the last step are taken into the masters first
        (:meth:`take_model_edits`)."""
        self.take_model_edits()
        out: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "master": [m.detach().clone() for m in self.master_params],
            "params": [p.detach().clone() for p in self.model_params],
        }
        if self.generator is not None:
            out["generator"] = self.generator.get_state()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`: the FP32 masters, the inner optimizer's state, and
        the model's parameters (the saved ones, or, in a state without them, the masters
        rounded to nearest into their dtype), so that training resumes bit-exactly. All or
        nothing: every tensor is checked (count, shape, floating dtype) before anything is
        assigned, and the inner optimizer's state is loaded first (a ``ValueError`` there
        leaves masters and model unchanged)."""
        state = state_dict
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {type(state).__name__}")
        for key in ("master", "optimizer"):
            if key not in state:
                raise ValueError(f"state: no {key!r} entry")
        masters = _check_tensors("master", state["master"], self.master_params)
        params = (
            _check_tensors("params", state["params"], self.model_params)
            if "params" in state
            else None
        )
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.model_params, self.master_params, strict=True)):
                m.copy_(masters[i])
                p.copy_(m if params is None else params[i])
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
        self._written = [_version(p) for p in self.model_params]
        self.discard_grads()


def _version(t: Tensor | None) -> int:
    return -1 if t is None else int(t._version)


def _check_tensors(key: str, saved: Any, like: Sequence[Tensor]) -> list[Tensor]:
    if not isinstance(saved, (list, tuple)):
        raise TypeError(f"state[{key!r}] must be a list of tensors, got {type(saved).__name__}")
    if len(saved) != len(like):
        raise ValueError(f"state: {len(saved)} {key} tensors for {len(like)} params")
    for i, (m, s) in enumerate(zip(like, saved, strict=True)):
        if not isinstance(s, Tensor) or not s.dtype.is_floating_point:
            raise TypeError(f"state[{key!r}][{i}] must be a floating-point tensor")
        if s.shape != m.shape:
            raise ValueError(
                f"state[{key!r}][{i}]: shape {tuple(s.shape)}, the parameter's is {tuple(m.shape)}"
            )
    return list(saved)
