"""Residual adds found by running the model once, for modules ``torch.fx`` cannot trace
(HF transformers' decoder and encoder layers, with their caches and Python control flow).

**Analysis** (:func:`analyse`, once, at transform time, on example inputs). A torch
function mode records every op's *provenance* — the set of tokens of the module inputs
and module outputs it depends on — while forward hooks keep a stack of module calls. An
add of two same-shape float tensors made *directly* in a module ``M``'s ``forward`` (not
inside a child) is

* a **residual add** when one operand, the *skip*, is one of ``M``'s input tensors (or the
  output of an earlier residual add of ``M``) and the other, the *branch*, depends on that
  skip through at least one of ``M``'s child modules: ``x + attn(norm(x))``, pre-norm
  (Llama, GPT-2, GPT-NeoX, Phi, OPT, ...);
* a **branch sum** when it made a residual add's branch from two child outputs (parallel
  attention and MLP: GPT-NeoX, Phi, GPT-J): a unit ``add`` (``1/√2`` each);
* an **embedding sum** when both operands are embedding lookups (or sums of them), in any
  module: token + position (+ type) embeddings, weighted so the sum of ``n`` lookups is
  unit.

* an **argument residual** when the skip is one of ``M``'s inputs, the branch depends on
  ``M``'s children but not on the skip *as ``M`` received it*: the model passed the stream
  into ``M`` twice, once normalised by a sibling and once as the skip, and adds it there
  (Bloom: ``self_attention(ln(x), residual=x)`` adds ``out + residual`` inside the
  attention module). The branch must depend on the skip tensor itself (a token it was
  given as an input or output of another module), and ``M`` must not normalise the sum
  (a norm module or function inside ``M`` taking the add's result): post-norm BERT's
  ``LayerNorm(dense(h) + x)``, the same shape but followed by its norm, stays a plain add
  (the norm makes it unit in both passes).

**Runtime** (:class:`Runtime`): the same hooks number the adds made directly in each
module call; the planned ones are replaced. A residual add with weight ``τ`` becomes
``residual_split`` + ``residual_add``: on entry to ``M`` (or when the earlier residual add
returns) the skip ``x`` gets a *branch copy* ``scale_bwd(x, √τ)``, which replaces ``x`` in
every op inside ``M`` but the add, and a *skip copy* ``scale_bwd(x, √(1-τ))``; the add
returns ``√τ·branch + √(1-τ)·x`` (:func:`lowprec.unit.functional.residual_add`). An
argument residual's skip gets its skip copy on entry to ``M`` as well; the split's branch
side cannot sit at the fan-out (it is in the parent, before ``M`` is called), so ``M``'s
inputs the branch depends on get ``scale_bwd(·, √τ)`` instead: the gradient that leaves
``M`` through them is the branch copy's, and only the sibling between the fan-out and
``M`` (the norm) sees it ``√τ`` times smaller than unit.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from lowprec.core.modes import eager_frames
from lowprec.core.warn import warn_once
from lowprec.unit import functional as U
from lowprec.unit.core import scale_bwd

__all__ = ["Runtime", "Step", "analyse"]

log = logging.getLogger("lowprec.unit")
_ADDS = frozenset({torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__})
_EMPTY: frozenset[int] = frozenset()
# shape-only ops: a skip may be a reshaped input (OPT flattens the stream before its MLP)
_VIEWS = frozenset({Tensor.reshape, Tensor.view, torch.reshape, Tensor.flatten, torch.flatten,
                    Tensor.contiguous})  # fmt: skip
_NORM_FNS = frozenset({F.layer_norm, F.rms_norm, F.group_norm, torch.layer_norm})


def _is_norm(m: nn.Module) -> bool:
    """Whether module ``m`` normalises its input (torch's norms, a module converted to a
    unit norm, or a class named ``...Norm`` such as HF's ``LlamaRMSNorm``)."""
    return (
        isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm))
        or getattr(m, "_unit_role", "") == "norm"
        or type(m).__name__.endswith("Norm")
    )


def add_operands(
    func: Any, args: tuple[Any, ...], kw: dict[str, Any]
) -> tuple[Tensor, Tensor] | None:
    """``(a, b)`` if ``func(*args, **kw)`` is a plain add of two float tensors, else None."""
    if func not in _ADDS or kw or len(args) != 2:
        return None
    a, b = args
    ok = all(isinstance(t, Tensor) and t.is_floating_point() for t in (a, b))
    return (a, b) if ok else None


def _tensors(v: Any, depth: int = 3) -> list[Tensor]:
    if isinstance(v, Tensor):
        return [v]
    if depth == 0:
        return []
    if isinstance(v, dict):
        v = list(v.values())
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x, depth - 1)]
    return []


@dataclass
class Step:
    """A planned add: ``kind`` ``"residual"``, ``"branch_sum"`` or ``"embed_sum"``; ``skip``
    where a residual's skip comes from: ``("arg", i)``, ``("kw", name)`` or ``("res", k)``
    (the output of the frame's add number ``k``); ``weights`` of an embedding sum;
    ``branch_inputs``: an argument residual's inputs of the module its branch depends on
    (empty for a residual whose skip feeds the branch inside the module)."""

    ordinal: int
    kind: str
    skip: tuple[str, Any] | None = None
    weights: tuple[float, float] = (1.0, 1.0)
    tau: float = 0.5
    branch_inputs: tuple[tuple[str, Any], ...] = ()


@dataclass
class _Frame:
    name: str
    first: bool
    sources: list[tuple[Tensor, tuple[str, Any], int]] = field(default_factory=list)
    child_tokens: set[int] = field(default_factory=set)
    adds: int = 0
    steps: dict[int, Step] = field(default_factory=dict)
    add_outs: list[tuple[Tensor, int, bool]] = field(default_factory=list)
    # argument residuals not yet confirmed: add number -> its result (a norm taking it
    # inside the module makes the add a post-norm one, left plain)
    pending: dict[int, Tensor] = field(default_factory=dict)


@eager_frames
class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.prov: Any = WeakTensorKeyDictionary()
        self.own: Any = WeakTensorKeyDictionary()  # tokens given to the tensor itself
        self.emb: Any = WeakTensorKeyDictionary()
        self.stack: list[_Frame] = []
        self.seen: set[str] = set()
        self.plans: dict[str, dict[int, Step]] = {}
        self.order: list[tuple[str, int]] = []
        # ("pre" | "post", module name, 0) of each module call and ("add", name, k) of each
        # residual add in ``order``, in call order: where fx's adds ran among them
        self.events: list[tuple[str, str, int]] = []
        self._next = 0

    def where(self) -> str | None:
        return self.stack[-1].name if self.stack else None

    def token(self, t: Tensor) -> int:
        self._next += 1
        self.prov[t] = self.prov.get(t, _EMPTY) | {self._next}
        self.own[t] = self.own.get(t, _EMPTY) | {self._next}
        return self._next

    def _normalised(self, fr: _Frame, ts: list[Tensor]) -> None:
        """A norm inside ``fr``'s module takes ``ts``: pending argument residuals among
        them are post-norm adds, left plain."""
        for k, out in list(fr.pending.items()):
            if any(t is out for t in ts):
                del fr.pending[k], fr.steps[k]
                self.order.remove((fr.name, k))
                self.events.remove(("add", fr.name, k))

    def _planned(self, name: str, k: int) -> None:
        self.order.append((name, k))
        self.events.append(("add", name, k))

    def pre(self, name: str, module: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        if self.stack and self.stack[-1].pending and _is_norm(module):
            self._normalised(self.stack[-1], _tensors((args, kw), 2))
        fr = _Frame(name, first=name not in self.seen)
        self.seen.add(name)
        self.events.append(("pre", name, 0))
        locs = [(("arg", i), a) for i, a in enumerate(args)] + [
            (("kw", k), v) for k, v in kw.items()
        ]
        for loc, v in locs:
            if isinstance(v, Tensor) and v.is_floating_point():
                fr.sources.append((v, loc, self.token(v)))
        self.stack.append(fr)

    def post(self, module: nn.Module, args: Any, out: Any) -> None:
        fr = self.stack.pop()
        self.events.append(("post", fr.name, 0))
        if fr.first and fr.steps:
            self.plans[fr.name] = fr.steps
        if self.stack:
            parent = self.stack[-1]
            for t in _tensors(out):
                parent.child_tokens.add(self.token(t))

    def _on_add(self, fr: _Frame, a: Tensor, b: Tensor, out: Tensor) -> None:
        k = fr.adds
        fr.adds += 1
        if not fr.first:
            return
        na, nb = self.emb.get(a), self.emb.get(b)
        if na and nb:
            fr.steps[k] = Step(k, "embed_sum", weights=(math.sqrt(na), math.sqrt(nb)))
            self.emb[out] = na + nb
            return
        child = fr.child_tokens
        if a.shape == b.shape:
            for skip, branch in ((a, b), (b, a)):
                src = next(((loc, tok) for t, loc, tok in fr.sources if t is skip), None)
                pb = self.prov.get(branch, _EMPTY)
                if src is None or src[1] not in pb or not pb & child:
                    continue
                fr.steps[k] = Step(k, "residual", skip=src[0])
                self._planned(fr.name, k)
                made = next((e for e in fr.add_outs if e[0] is branch), None)
                if made is not None and made[2]:
                    fr.steps[made[1]] = Step(made[1], "branch_sum")
                fr.sources.append((out, ("res", k), self.token(out)))
                return
            if self._argument_residual(fr, k, a, b, out):
                return
        pa, pb = self.prov.get(a, _EMPTY), self.prov.get(b, _EMPTY)
        fr.add_outs.append((out, k, bool(pa & child) and bool(pb & child)))

    def _argument_residual(self, fr: _Frame, k: int, a: Tensor, b: Tensor, out: Tensor) -> bool:
        """Plan add ``k`` of ``fr`` (``a + b``) as an argument residual if it is one (see
        the module doc): pending until the module ends or a norm takes its result."""
        child = fr.child_tokens
        for skip, branch in ((a, b), (b, a)):
            src = next(((loc, tok) for t, loc, tok in fr.sources if t is skip), None)
            pb = self.prov.get(branch, _EMPTY)
            if src is None or src[0][0] not in ("arg", "kw") or not pb & child:
                continue
            if not pb & (self.own.get(skip, _EMPTY) - {src[1]}):
                continue
            inputs = tuple(
                loc
                for t, loc, tok in fr.sources
                if loc[0] in ("arg", "kw") and t is not skip and tok in pb
            )
            if not inputs:
                continue
            fr.steps[k] = Step(k, "residual", skip=src[0], branch_inputs=inputs)
            fr.pending[k] = out
            self._planned(fr.name, k)
            return True
        return False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kw = kwargs or {}
        if func in _NORM_FNS and self.stack and self.stack[-1].pending:
            self._normalised(self.stack[-1], _tensors((args, kw), 2))
        out = func(*args, **kw)
        ins = _tensors((args, kw), 3)  # (3: tensors in a list argument, torch.cat's)
        p = _EMPTY.union(*(self.prov.get(t, _EMPTY) for t in ins))
        ops = add_operands(func, args, kw)
        if ops is not None and self.stack and isinstance(out, Tensor):
            self._on_add(self.stack[-1], ops[0], ops[1], out)
        if func in _VIEWS and self.stack and isinstance(out, Tensor) and args:
            fr = self.stack[-1]
            src = next((loc for t, loc, _ in fr.sources if t is args[0]), None)
            if src is not None and out is not args[0]:
                fr.sources.append((out, ("view", src), self.token(out)))
        if func is F.embedding and isinstance(out, Tensor):
            self.emb[out] = 1
        elif func is Tensor.to and isinstance(out, Tensor) and args[0] in self.emb:
            self.emb[out] = self.emb[args[0]]
        if p:
            for o in _tensors(out, 1):
                self.prov[o] = self.prov.get(o, _EMPTY) | p
        return out


def analyse(
    model: nn.Module, run: Callable[[], Any], outer: Callable[[Callable[[], str | None]], Any]
) -> tuple[dict[str, dict[int, Step]], list[tuple[str, int]], list[tuple[str, str, int]]]:
    """Run ``run()`` (a forward of ``model``) under the recorder, itself inside the mode
    ``outer(where)`` (``where()``: the module being run); return the plans (module name →
    planned adds by number), the residual adds in call order, and the call's events in
    order: ``("pre", name, 0)`` and ``("post", name, 0)`` around each module call (the
    root named ``"<root>"``), ``("add", name, k)`` at each residual add of ``order``."""
    rec = _Recorder()
    handles = []
    for name, m in model.named_modules():
        handles.append(m.register_forward_pre_hook(
            functools.partial(rec.pre, name or "<root>"), with_kwargs=True))  # fmt: skip
        handles.append(m.register_forward_hook(rec.post, always_call=True))
    try:
        with outer(rec.where), rec:
            run()
    finally:
        for h in handles:
            h.remove()
    return rec.plans, rec.order, rec.events


def _input(args: tuple[Any, ...], kw: dict[str, Any], loc: tuple[str, Any]) -> Any:
    """A module call's input at ``loc`` (``("arg", i)`` or ``("kw", name)``), or None."""
    where, key = loc
    if where == "arg":
        return args[key] if key < len(args) else None
    return kw.get(key)


@dataclass
class _RFrame:
    name: str
    steps: dict[int, Step] | None
    adds: int = 0
    subs: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    skips: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    locs: dict[int, tuple[Tensor, Any]] | None = None  # tensors a view skip derives from


class Runtime:
    """Applies the plans of :func:`analyse` while the model runs (see the module doc) and
    names the module being run for the unit mode's messages."""

    def __init__(self, plans: dict[str, dict[int, Step]]) -> None:
        self.plans = plans
        self.frames: list[_RFrame] = []
        self.n_subs = 0

    def install(self, model: nn.Module) -> None:
        for name, m in model.named_modules():
            m.register_forward_pre_hook(functools.partial(self._pre, name or "<root>"),
                                        with_kwargs=True)  # fmt: skip
            m.register_forward_hook(self._post, always_call=True)

    def where(self) -> str | None:
        return self.frames[-1].name if self.frames else None

    def _register(self, fr: _RFrame, st: Step, x: Tensor) -> None:
        skip = scale_bwd(x, math.sqrt(1.0 - st.tau))
        fr.skips[st.ordinal] = (x, skip)
        if not st.branch_inputs:
            self._substitute(fr, x, scale_bwd(x, math.sqrt(st.tau)))

    def _substitute(self, fr: _RFrame, x: Tensor, by: Tensor) -> None:
        """Ops inside ``fr``'s module call (and its children) take ``by`` for ``x``."""
        if not fr.subs:
            self.n_subs += 1
        fr.subs.setdefault(id(x), (x, by))

    def _pre(self, name: str, module: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        if name == "<root>":  # a new forward (an earlier one may have raised mid-way)
            self.reset()
        self.enter(name, module, args, kw)

    def enter(
        self, name: str, module: nn.Module, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> None:
        """Push module ``name``'s call frame (what its forward pre-hook does)."""
        fr = _RFrame(name, self.plans.get(name))
        if any(st.skip is not None and st.skip[0] == "view" for st in (fr.steps or {}).values()):
            fr.locs = {}
            for i, a in enumerate(args):
                if isinstance(a, Tensor):
                    fr.locs[id(a)] = (a, ("arg", i))
            for key, v in kw.items():
                if isinstance(v, Tensor):
                    fr.locs[id(v)] = (v, ("kw", key))
        for st in (fr.steps or {}).values():
            if st.kind == "residual" and st.skip is not None and st.skip[0] in ("arg", "kw"):
                x = _input(args, kw, st.skip)
                if isinstance(x, Tensor):
                    self._register(fr, st, x)
                for loc in st.branch_inputs:  # an argument residual's branch side
                    v = _input(args, kw, loc)
                    if isinstance(v, Tensor) and v is not x:
                        self._substitute(fr, v, scale_bwd(v, math.sqrt(st.tau)))
        self.frames.append(fr)

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.frames and self.frames.pop().subs:
            self.n_subs -= 1

    def reset(self) -> None:
        self.frames.clear()
        self.n_subs = 0

    def on_op(self, func: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        fr = self.frames[-1]
        if not fr.steps:
            return NotImplemented
        if fr.locs and func in _VIEWS and args and id(args[0]) in fr.locs:
            base, loc = fr.locs[id(args[0])]
            if base is args[0]:
                out = func(*args, **kw)
                self._located(fr, out, ("view", loc))
                return out
        ops = add_operands(func, args, kw)
        if ops is None:
            return NotImplemented
        k = fr.adds
        fr.adds += 1
        st = fr.steps.get(k)
        if st is None:
            return NotImplemented
        a, b = ops
        if st.kind != "residual":
            return U.add.__wrapped__(a, b, st.weights)  # type: ignore[attr-defined]
        x, skip = fr.skips.get(k, (None, None))
        if x is None or skip is None or (a is not x and b is not x):
            warn_once(log, f"unit:residual-miss:{fr.name}:{k}",
                      "unit_scale: %s: residual add #%d no longer has the skip operand found "
                      "at transform time (the forward took another path); it runs as a "
                      "plain add", fr.name, k)  # fmt: skip
            return NotImplemented
        branch = b if a is x else a
        out = U.residual_add.__wrapped__(branch, skip, st.tau)  # type: ignore[attr-defined]
        self._located(fr, out, ("res", k))
        return out

    def _located(self, fr: _RFrame, t: Tensor, loc: tuple[str, Any]) -> None:
        """``t`` is the frame's tensor at ``loc``: register the steps whose skip it is."""
        if fr.locs is not None:
            fr.locs[id(t)] = (t, loc)
        for st in (fr.steps or {}).values():
            if st.kind == "residual" and st.skip == loc:
                self._register(fr, st, t)

    def substitute(
        self, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not self.n_subs:
            return args, kw

        def sub(v: Any) -> Any:
            if isinstance(v, Tensor):
                for fr in reversed(self.frames):
                    e = fr.subs.get(id(v))
                    if e is not None and e[0] is v:
                        return e[1]
            return v

        return tuple(sub(a) for a in args), {k: sub(v) for k, v in kw.items()}
