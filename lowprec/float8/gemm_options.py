"""What a float8 GEMM does besides its casts: its roles' scales (:func:`role_scale`), the
stochastic-rounding streams, the random
Hadamard transform of its operands, and the one quantized weight that a square 2-D block
cast lets the forward and input-gradient GEMMs share.

* **Streams.** A stochastic cast (``CastConfig(rounding="stochastic")``) of ``role`` in GEMM
  ``gemm`` draws from a ``torch.Generator`` seeded with
  :func:`lowprec.core.hadamard.stream_seed` ``(config.seed, layer key, step, gemm index,
  role index)``: counter-based, so a cast's draws depend on these keys only (not on the
  order of earlier draws, the device or the number of ranks), and a run resumed from the
  layer's counter draws what the uninterrupted run drew. :class:`Streams` holds the keys of
  one call of the layer.
* **Hadamard.** :func:`hadamard_pair` transforms a GEMM's two operands along the contracted
  dimension (:func:`lowprec.core.hadamard.block_hadamard`); ``A B = (A Hᵀ)(H B)`` in exact
  arithmetic.
* **Shared 2-D weight.** With an MX or NVFP4 weight cast on square ``R × R`` blocks
  (``nv:16x16``, ``mx:32x32``) used alike by the forward and input-gradient GEMMs,
  quantizing ``Wᵀ`` (forward) and ``W`` (input gradient) gives the same values, transposed:
  the blocks, their ``amax`` and so their scales are the same sets. :func:`shares_weight`
  says when; the forward's operand is then handed to the input gradient transposed
  (:func:`transposed_weight`), which also makes a stochastic weight cast one draw.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from lowprec.core.hadamard import block_hadamard, generator, stream_seed
from lowprec.core.scalers import AmaxReducer, DelayedScaler, StaticScaler
from lowprec.core.scales import amax as tensor_amax
from lowprec.float8.config import GEMMS, ROLES, CastConfig, Float8Config
from lowprec.float8.operands import Operand, cast_kind, from_parts, payload_roles
from lowprec.float8.quant import Parts

__all__ = [
    "HistoryScaler",
    "Streams",
    "hadamard_pair",
    "own_scale",
    "role_scale",
    "same_operands",
    "shares_weight",
    "transposed_weight",
]


HistoryScaler = DelayedScaler | StaticScaler


def role_scale(
    sc: HistoryScaler | None,
    cast: CastConfig,
    t: Tensor | None,
    *,
    update: bool,
    calibrating: bool,
    state: Tensor | None = None,
    amax: Tensor | None = None,
    reduce: AmaxReducer | None = None,
) -> Tensor | None:
    """The one place a role's tensor-wide scale is chosen: the scale of ``t`` from the
    role's core scaler (delayed: its history, recorded when ``update``; static: its
    calibration, recorded when ``calibrating``, or its frozen scale), or ``None`` for a
    dynamic role, whose scale the GEMM's operand computes from ``t`` itself.

    ``amax``: the ``amax`` of the whole tensor, given (already reduced across ranks);
    ``reduce``: ``t`` is a shard, and the ``amax`` of a tensor-wise role is ``reduce`` of its
    local ``amax``. With either, a dynamic role's scale is computed here, from that ``amax``.
    ``state``: the scaler's state tensor threaded through the autograd function.
    """
    if isinstance(sc, StaticScaler) and sc.frozen:
        return sc(t, amax=amax)
    if amax is None and reduce is not None and cast_kind(cast) == "tensor":
        assert t is not None
        amax = reduce(tensor_amax(t))
    if isinstance(sc, DelayedScaler):
        return sc(t, update=update, state=state, amax=amax)
    if isinstance(sc, StaticScaler):
        return sc(t, update=calibrating, state=state, amax=amax)
    return None if amax is None else cast.scale_for(amax)


def own_scale(cast: CastConfig, t: Tensor, reduce: AmaxReducer | None) -> Tensor | None:
    """The scale of a per-GEMM (dynamic) cast that differs from its role's base cast: the
    ``amax`` of the whole tensor where ``t`` is a shard (``reduce``), else ``None`` (the
    operand computes it from ``t``)."""
    return role_scale(None, cast, t, update=False, calibrating=False, reduce=reduce)


class Streams:
    """The stochastic-rounding streams of one call of a layer: ``(seed, layer key, step)``
    read from the layer's ``rng_state`` (``None``: the recipe rounds to nearest only)."""

    def __init__(self, r: Float8Config, rng: Tensor | None) -> None:
        self.keys: tuple[int, int, int] | None = None
        if r.stochastic:
            if rng is None:
                raise ValueError(
                    "rng: a recipe with stochastic casts needs the layer's rng_state "
                    "(layer key, step counter)"
                )
            key, step = (int(v) for v in rng.tolist())
            self.keys = (r.seed, key, step)

    def gen(self, gemm: str, role: str, device: torch.device) -> torch.Generator | None:
        """A fresh generator for ``role``'s cast in ``gemm`` (the same draws every time it
        is asked for: the GEMM and its observation draw alike); ``None`` without streams."""
        if self.keys is None:
            return None
        seed = stream_seed(*self.keys, GEMMS.index(gemm), ROLES.index(role))
        return generator(seed, device)


def same_operands(a: Float8Config, b: Float8Config) -> bool:
    """Whether GEMMs run with configs ``a`` and ``b`` build and multiply operands alike
    (so that one GEMM's operand can be handed to the other)."""
    return a is b or (
        a.emulate == b.emulate
        and a.emulation_dtype == b.emulation_dtype
        and payload_roles(a) == payload_roles(b)
    )


def hadamard_pair(r: Float8Config, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(a Hᵀ, H b)``: ``a`` (``M × K``) transformed along its dim 1 and ``b`` (``K × N``)
    along its dim 0 by the block-diagonal random Hadamard ``H`` of ``r`` (blocks of
    ``r.hadamard_block``, signs of ``r.hadamard_seed``), ``K`` zero-padded to whole blocks
    in both; ``a · b`` is unchanged in exact arithmetic."""
    n, seed = r.hadamard_block, r.hadamard_seed
    return block_hadamard(a, 1, n, seed), block_hadamard(b, 0, n, seed)


def shares_weight(r: Float8Config) -> bool:
    """Whether the input-gradient GEMM of ``r`` multiplies the forward's quantized weight,
    transposed: both GEMMs quantize the weight with one cast (and build and multiply
    operands alike), an MX or NVFP4 cast on square 2-D blocks (``R × R``, ``R > 1``), and
    neither GEMM is high precision or Hadamard-transformed. (A ``block:RxR`` cast gives the
    same values too, quantized again in backward: its GEMMs compile.) Cached per recipe
    eagerly; traced uncached (dynamo warns about a cache it cannot honour)."""
    if torch.compiler.is_compiling():
        return _shares_weight(r)
    return _shares_weight_cached(r)


def _shares_weight(r: Float8Config) -> bool:
    pair = ("forward", "input_grad")
    if set(pair) & (set(r.high_precision_gemms) | set(r.hadamard)):
        return False
    cf, cdx = r.for_gemm("forward"), r.for_gemm("input_grad")
    c = cf.weight
    rows, cols = c.gemm_granularity.block
    return (
        same_operands(cf, cdx)
        and r.same_cast("weight", "forward", "input_grad")
        and cast_kind(c) in ("mx", "nv")
        and rows == cols > 1
    )


_shares_weight_cached = functools.lru_cache(maxsize=256)(_shares_weight)


def transposed_weight(
    wq: Operand, parts: Parts | None, r: Float8Config, dtype: torch.dtype
) -> Operand:
    """The forward's weight operand ``Q(Wᵀ)`` (``K × N``, contracted over dim 0) as the
    input gradient's ``Q(W)`` (``N × K``, contracted over dim 0): the same values and
    scales transposed (square blocks bind alike to either dim). ``parts``: the
    :func:`~lowprec.float8.quant.quantize_parts` it was built from, ``None`` where it is
    the dequantized values."""
    cdx = r.for_gemm("input_grad")
    if parts is None:
        assert isinstance(wq, Tensor)
        return wq.t()
    data, s, pad = parts
    return from_parts(
        (data.t(), s.t(), None if pad is None else (pad[1], pad[0])), cdx.weight, 0, dtype, cdx
    )
