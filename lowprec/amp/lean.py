"""Optimizers with a lean training state: low-precision parameters without FP32 masters,
optimizer states in BF16 or 8 bits.

:class:`~lowprec.amp.lean_optimizers.LeanAdamW`, ``LeanAdam`` and ``LeanSGD`` (in
:mod:`lowprec.amp.lean_optimizers`, built on :class:`LeanOptimizer` here) are
``torch.optim.Optimizer``\\ s
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
:mod:`lowprec.amp.state_codec`). ``state_rounding``: ``"auto"`` (the default) is
``"stochastic"`` for 8-bit states and ``"nearest"`` for BF16 ones. An 8-bit moment rounded
to nearest stalls: ``v ← β₂v + (1-β₂)g²`` moves ``v`` by about ``1-β₂ = 0.1%`` of itself
a step, far below half an E4M3 step (``2^-4`` relative), so the stored value stops
following its EMA, and updates came out 0.7× to 2× FP32-state AdamW's on steady noisy
gradients (5× to 14× for a small steady gradient beside a large one in its block).
Rounded stochastically the stored moment is the EMA in expectation (BF16's ``2^-9`` keeps
nearest rounding within about 1% there). Stochastic rounding (of the parameters, and of the
states) draws from ``generator`` (default: a generator on the first parameter's device,
seeded from torch's global one at construction when the optimizer can draw at all:
stochastic rounding of the parameters or of non-FP32 states; otherwise left at torch's
default seed, the global generator untouched, so that a recipe without randomness sees the
same data and dropout as plain training); its state is part of :meth:`state_dict`, so a
resumed run draws the same numbers. ``state_dict`` / ``load_state_dict`` keep every
state tensor in its stored dtype (torch's would cast float8 codes and FP32 scales to the
parameter's dtype). Param groups keep extra keys (u-μP's ``lr_mult``) and read ``lr``
each step, so LR schedulers and ``clip_grad_norm_`` work as with torch's optimizers.

Blocks. The 8-bit states are block-scaled along the rows of a tensor of two or more
dimensions (:mod:`lowprec.amp.state_codec`); the states of a tensor of fewer dimensions
(biases, norm weights: a small share of a model) stay in FP32, as in bitsandbytes and
torchao, since their blocks would cross the boundaries of dim-0 shards.

Sharded parameters (FSDP2). A parameter that is a ``DTensor`` sharded on dim 0
(``Shard(0)``, ``Replicate`` on other mesh dimensions) is updated on its local shard
(``to_local()``, with its gradient's local shard), and its states are ``DTensor``\\ s of
the same mesh and placements (codes and remainders of the parameter's global shape, the
scales of ``scale_shape``), so DCP saves and reshards them as it does parameters. Whole
rows per rank and row-local blocks make every state element, code and scale the one a
single process computes from the same gradient, whatever the world size. The random
draws too: each rank draws the bits of the whole (global) tensor from the generator and
uses its rows' (``U_local = U_global[rows]``), so every rank's generator advances alike
(the ranks' generators stay equal) and a shard is rounded as in one process. This costs
each rank the draws of the global tensor (BF16 parameters: one ``randint`` of it; FP16
parameters and ``state_rounding="stochastic"``: the rounding of a zero-padded global
tensor).

Example:
    >>> import torch
    >>> from lowprec.amp import LeanAdamW
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
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lowprec.amp.remainder import join_fp32, split_fp32
from lowprec.amp.state_codec import StateCodec, scale_shape, state_codecs
from lowprec.core.bits import round_bits
from lowprec.core.formats import BF16
from lowprec.core.rounding import quantize

__all__ = ["LeanOptimizer", "sr_bf16"]

Master = Literal["none", "remainder"]
_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_FP32 = StateCodec("fp32")


def _local(t: Tensor) -> Tensor:
    """The local shard of a ``DTensor``, else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _check_sharding(p: Tensor) -> None:
    """``ValueError`` unless ``p`` is a plain tensor or a ``DTensor`` whose placements are
    ``Shard(0)`` or ``Replicate`` (whole rows per rank: the blocks never straddle)."""
    if isinstance(p, DTensor) and not all(
        isinstance(q, Replicate) or (isinstance(q, Shard) and q.dim == 0) for q in p.placements
    ):
        raise ValueError(
            f"params: a DTensor parameter must be sharded on dim 0 (Shard(0) or Replicate), "
            f"got placements {p.placements}"
        )


def _rows(p: DTensor) -> slice:
    """The global rows (dim 0) that this rank holds of the ``DTensor`` ``p``."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return slice(offset[0], offset[0] + shape[0])


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


def sr_bf16(w: Tensor, bits: Tensor) -> Tensor:
    """``w`` (float32) rounded stochastically to BF16 with the random integers ``bits``
    (int32 in ``[0, 2^23)``, ``w``'s shape): ``quantize(w, "bf16", "stochastic",
    generator=g)`` bit for bit when ``bits = torch.randint(0, 2**23, w.shape,
    generator=g, dtype=torch.int32)``, which is what that draws: the same rounding
    (:func:`lowprec.core.bits.round_bits`) given the draws. Normal range: ``|w|`` rounds up
    with probability ``(|w| - lo) / (hi - lo)``. Taking ``bits`` as an argument lets a
    shard use its rows of the draws of the whole tensor."""
    return round_bits(w, BF16, "stochastic", rand=bits).to(torch.bfloat16)


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
        state_rounding: Literal["auto", "nearest", "stochastic"] = "auto",
        codecs: tuple[StateCodec, ...] | None = None,
    ) -> None:
        if master not in ("none", "remainder"):
            raise ValueError(f"master must be 'none' or 'remainder', got {master!r}")
        if not isinstance(stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be a bool, got {stochastic_rounding!r}")
        if master == "remainder" and stochastic_rounding:
            raise ValueError("stochastic_rounding: a remainder keeps the exact FP32 master")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if state_rounding not in ("auto", "nearest", "stochastic"):
            raise ValueError(
                f"state_rounding must be 'auto', 'nearest' or 'stochastic', got {state_rounding!r}"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if codecs is None:
            if state == "fp32" and state_rounding == "stochastic":
                raise ValueError(
                    "state_rounding='stochastic' does nothing with state='fp32' (FP32 states "
                    "are stored exactly): leave it 'auto' or 'nearest'"
                )
            if state != "8bit" and block_size != 256:
                raise ValueError(
                    f"block_size={block_size!r} only applies to state='8bit' (its blocks of "
                    f"scaled E4M3 codes), got state={state!r}: leave it at 256"
                )
            if state_rounding == "auto":  # 8-bit EMAs stall under nearest rounding (module doc)
                state_rounding = "stochastic" if state == "8bit" else "nearest"
            codecs = state_codecs(state, block_size, state_rounding)[: len(self.moments)]
        elif (state, block_size, state_rounding) != ("fp32", 256, "auto"):
            raise ValueError(
                f"codecs replaces state, block_size and state_rounding: give either codecs or "
                f"them, got codecs with state={state!r}, block_size={block_size!r}, "
                f"state_rounding={state_rounding!r}"
            )
        if len(codecs) != len(self.moments) or not all(isinstance(c, StateCodec) for c in codecs):
            raise TypeError(f"codecs must be {len(self.moments)} StateCodecs, got {codecs!r}")
        self.codecs = dict(zip(self.moments, codecs, strict=True))
        self.master = master
        self.stochastic_rounding = stochastic_rounding
        super().__init__(params, defaults)  # each group through add_param_group's checks
        if generator is None:
            first = next(p for g in self.param_groups for p in g["params"])
            generator = torch.Generator(first.device)  # torch's default seed
            if self._draws:  # seeded from the global generator only when it will be used
                generator.manual_seed(int(torch.randint(0, 2**62, (), dtype=torch.int64)))
        self.generator = generator
        self._param: Tensor | None = None  # the parameter being updated (its sharding)

    @property
    def _draws(self) -> bool:
        """Whether a step may draw random numbers: stochastic rounding of the parameters
        or of a non-FP32 state. Without a ``generator`` given, only such an optimizer
        seeds its generator from torch's global one (the others leave that untouched, so
        a recipe without randomness draws the same data and dropout as plain training)."""
        return self.stochastic_rounding or any(
            c.rounding == "stochastic" and c.format != "fp32" for c in self.codecs.values()
        )

    def _check_param(self, p: Tensor) -> None:
        """``TypeError``/``ValueError`` for a parameter this optimizer cannot update: not
        floating point, a ``DTensor`` not sharded on dim 0, or not BF16/FP32 with
        ``master="remainder"`` (its remainder would be missing: no exact master)."""
        if not isinstance(p, Tensor) or not p.dtype.is_floating_point:
            what = p.dtype if isinstance(p, Tensor) else type(p).__name__
            raise TypeError(f"params: expected floating-point parameters, got {what}")
        _check_sharding(p)
        if self.master == "remainder" and p.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"master='remainder' needs bfloat16 parameters (BF16 + 16 bits = FP32), "
                f"got {p.dtype}"
            )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` with the constructor's checks of every parameter
        (:meth:`_check_param`); the group is not added if one fails."""
        super().add_param_group(param_group)
        try:
            for p in self.param_groups[-1]["params"]:
                self._check_param(p)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # -- sharded parameters ---------------------------------------------------------------
    def _wrap(self, local: Tensor, shape: tuple[int, ...]) -> Tensor:
        """``local`` as a ``DTensor`` of global ``shape`` sharded as the parameter being
        updated (``local`` itself for a plain parameter)."""
        p = self._param
        if not isinstance(p, DTensor):
            return local
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False,
            shape=torch.Size(shape), stride=_strides(shape),
        )  # fmt: skip

    def _global(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """``fn(x)`` for a random rounding ``fn`` of this rank's rows ``x``, with the draws
        of the whole tensor: ``fn`` of the zero-padded global tensor, then these rows."""
        p = self._param
        if not isinstance(p, DTensor):
            return fn(x)
        rows = _rows(p)
        full = x.new_zeros((p.shape[0], *x.shape[1:]))
        full[rows] = x
        return fn(full)[rows]

    # -- the FP32 weight and its write-back -----------------------------------------------
    def _weight(self, p: Tensor, st: dict[str, Any]) -> Tensor:
        """The FP32 weight of the (local) parameter ``p``."""
        if "remainder" in st:
            return join_fp32(p.detach(), _local(st["remainder"]))
        return p if p.dtype == torch.float32 else p.detach().float()

    def _write(self, p: Tensor, w: Tensor, st: dict[str, Any]) -> None:
        """``w`` into the (local) parameter ``p``: exactly, split, or rounded."""
        if w is p:
            return
        if "remainder" in st:
            hi, lo = split_fp32(w)
            p.copy_(hi)
            _local(st["remainder"]).copy_(lo)
        elif self.stochastic_rounding and p.dtype in _LOW:
            g = self.generator
            par = self._param
            if p.dtype == torch.bfloat16 and isinstance(par, DTensor):
                bits = torch.randint(0, 2**23, par.shape, generator=g, dtype=torch.int32,
                                     device=g.device)  # fmt: skip
                p.copy_(sr_bf16(w, bits[_rows(par)].to(w.device)))
            else:
                fmt = _LOW[p.dtype]
                p.copy_(self._global(lambda x: quantize(x, fmt, "stochastic", generator=g), w))
        else:
            p.copy_(w)

    # -- the states -----------------------------------------------------------------------
    def codec(self, name: str, ndim: int) -> StateCodec:
        """The codec of state ``name`` of a parameter with ``ndim`` dimensions: the
        optimizer's, or FP32 for a blocked (8-bit) one below two dimensions (module
        docstring)."""
        c = self.codecs[name]
        return _FP32 if c.blocked and ndim < 2 else c

    def _get(self, st: dict[str, Any], name: str, shape: torch.Size) -> Tensor:
        """State ``name`` decoded to FP32, of the (local) ``shape``."""
        scales = st.get(name + "_scale")
        codes = _local(st[name])
        return self.codec(name, len(shape)).decode(
            codes, None if scales is None else _local(scales), shape
        )

    def _put(self, st: dict[str, Any], name: str, x: Tensor) -> None:
        """State ``name`` encoded from the FP32 (local) ``x``."""
        c = self.codec(name, x.dim())
        par = self._param
        if c.rounding == "stochastic" and c.format != "fp32" and isinstance(par, DTensor):
            rows = _rows(par)  # the draws of the whole tensor (module docstring)
            full = x.new_zeros((par.shape[0], *x.shape[1:]))
            full[rows] = x
            codes, scales = c.encode(full, self.generator)
            codes, scales = codes[rows], None if scales is None else scales[rows]
        else:
            codes, scales = c.encode(x, self.generator)
        p = self._param
        shape = tuple(p.shape) if p is not None else tuple(x.shape)
        st[name] = self._wrap(codes, shape)
        if scales is not None:
            st[name + "_scale"] = self._wrap(scales, scale_shape(shape, c.block_size))

    def _init(self, p: Tensor, st: dict[str, Any]) -> None:
        """The zero states of the (local) parameter ``p``."""
        st["step"] = torch.tensor(0.0)
        for name in self.moments:
            self._put(st, name, torch.zeros(p.shape, device=p.device))
        self._init_remainder(p, st)

    def _init_remainder(self, p: Tensor, st: dict[str, Any]) -> None:
        if self.master == "remainder" and p.dtype == torch.bfloat16:
            lo = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
            par = self._param
            st["remainder"] = self._wrap(lo, tuple(par.shape) if par is not None else p.shape)

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
                local, grad = _local(p), _local(p.grad)
                self._param = p
                try:
                    if not st:
                        self._init(local, st)
                    w = self._weight(local, st)
                    g = grad if grad.dtype == torch.float32 else grad.float()
                    self._update(w, g, st, group)
                    self._write(local, w, st)
                    if isinstance(p, DTensor):  # written through its shard: tell autograd
                        increment_version(p)  # and version-keyed caches (FP8 all-gather)
                finally:
                    self._param = None
        return loss

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (``state``, ``param_groups``; state tensors in their
        stored dtypes) plus ``generator``: the stochastic-rounding generator's state."""
        out = super().state_dict()
        out["generator"] = self.generator.get_state()
        return out

    def _check_saved(self, i: Any, p: Tensor, st: dict[str, Any]) -> None:
        """``ValueError`` unless each moment in the saved state ``st`` of parameter ``i``
        (``p``) is stored as this optimizer's codec stores it: its dtype, and a
        ``<name>_scale`` exactly for the 8-bit (blocked) codecs. Codes of another format
        would be read as numbers of this one (8-bit codes as BF16 moments: 10^5 times too
        large)."""
        for name in self.moments:
            if name not in st:
                continue
            c = self.codec(name, p.dim())
            v, scaled = st[name], name + "_scale" in st
            if isinstance(v, Tensor) and v.dtype == c.stored_dtype and scaled == c.blocked:
                continue
            saved = str(v.dtype).removeprefix("torch.") if isinstance(v, Tensor) else "no tensor"
            saved += " codes with block scales" if scaled else ""
            want = str(c.stored_dtype).removeprefix("torch.")
            want += " codes with block scales" if c.blocked else ""
            raise ValueError(
                f"state_dict: state {name!r} of parameter {i!r} was saved as {saved}, but this "
                f"{type(self).__name__} stores it as {c.format} ({want}); load it into an "
                f"optimizer with the same state format"
            )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`: the groups' options, every state tensor copied in its
        saved dtype onto its parameter's device, and the generator's state. ``ValueError``
        before anything changes unless the groups match in number and size and each saved
        moment has this optimizer's storage format (its dtype, and block scales exactly
        for 8-bit states: :meth:`_check_saved`). torch's AdamW / Adam / SGD state dicts
        of FP32 parameters load into ``state="fp32"`` (FP32 moments), and back."""
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
        for i, st in state_dict["state"].items():
            if i not in ids:
                raise ValueError(f"state_dict: state for unknown parameter id {i!r}")
            self._check_saved(i, ids[i], st)
        state: dict[Tensor, dict[str, Any]] = {}
        for i, st in state_dict["state"].items():
            p = ids[i]
            state[p] = {
                k: _place(v, p) if isinstance(v, Tensor) else copy.deepcopy(v)
                for k, v in st.items()
            }
            state[p]["step"] = state[p]["step"].cpu()
        self.state.clear()
        self.state.update(state)
        for s, g in zip(saved, self.param_groups, strict=True):
            g.update({k: copy.deepcopy(v) for k, v in s.items() if k != "params"})
        if "generator" in state_dict:
            self.generator.set_state(state_dict["generator"])


def _place(v: Tensor, p: Tensor) -> Tensor:
    """A saved state tensor as parameter ``p`` holds it: a copy on its device; for a
    sharded ``p``, a full tensor whose dim 0 is ``p``'s rows becomes a ``DTensor`` of this
    rank's rows; for a plain ``p``, a ``DTensor`` becomes its full tensor."""
    v = v.detach()
    if isinstance(p, DTensor) and not isinstance(v, DTensor):
        if v.dim() >= 1 and v.shape[0] == p.shape[0]:
            local = v[_rows(p)].to(p.device, copy=True).contiguous()
            return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                      shape=v.shape, stride=_strides(tuple(v.shape)))  # fmt: skip
        return v.clone().to(p.device)
    if isinstance(v, DTensor) and not isinstance(p, DTensor):
        return _full_tensor(v).to(p.device, copy=True)
    return v.clone().to(p.device)


def _full_tensor(v: DTensor) -> Tensor:
    """``v.full_tensor()``, gathered as 32-bit integers where ``v``'s dtype is narrower
    (gloo gathers no ``uint8`` or 16-bit types): the same bits."""
    if v.dtype.itemsize >= 4:
        return v.full_tensor()
    local = v.to_local()
    wide = (local.view(torch.int16) if local.is_floating_point() else local).to(torch.int32)
    full = DTensor.from_local(wide, v.device_mesh, v.placements, run_check=False,
                              shape=v.shape, stride=v.stride()).full_tensor()  # fmt: skip
    return full.to(torch.int16).view(v.dtype) if v.is_floating_point() else full.to(v.dtype)
