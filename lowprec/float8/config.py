"""Float8 recipes: per-role cast configurations and the named presets.

A matmul ``y = x Wᵀ`` in training is three GEMMs, each with two operands:

=========  ===========================  ==========================
GEMM       operands                     contracted dimension
=========  ===========================  ==========================
forward    ``x (M×K) · Wᵀ (K×N)``       K (features in)
dgrad      ``g (M×N) · W (N×K)``        N (features out)
wgrad      ``gᵀ (N×M) · x (M×K)``       M (tokens)
=========  ===========================  ==========================

Each *role* (``input`` = x, ``weight`` = W, ``grad_output`` = g) has a :class:`CastConfig`:
its format, how its scale is chosen over time (``dynamic``, ``delayed``, ``static``) and its
granularity, a name of the one grammar of :mod:`lowprec.core.granularity` in its *relative*
form: stated along the contracted dimension ``K`` of each GEMM (that is what a hardware
kernel requires, and why an operand may be re-quantized per GEMM). Names without an axis
mean ``@K`` (``block:1x128`` is ``block:1x128@K``); an absolute axis is refused:

* ``tensor``: one scale for the whole operand, reused by every GEMM;
* ``axis`` (aliases ``axis:K``, ``rowwise``, and ``row`` here): one scale per index of the
  *non-contracted* dimension (row-wise scaling);
* ``block:RxC``: blocks of ``R`` along the non-contracted and ``C`` along the contracted
  dimension (``1x128`` for activations and gradients, ``128x128`` for weights);
* ``mx:B``: OCP Microscaling, ``B`` consecutive elements along the contracted dimension
  share an E8M0 (power of two) scale;
* ``nv:B``: NVFP4-style two-level scaling: ``B`` elements along the contracted dimension
  share an E4M3 scale, and one float32 scale per tensor maps the block scales into E4M3.

Shapes that a block does not divide follow the core padding policy: the quantizer pads the
operand with zeros *explicitly* (:func:`lowprec.core.granularity.pad_to_blocks`) and drops
the padding again. Zeros change neither a block's ``amax`` nor a dot product, so the result
equals that of the unpadded tensor quantized with partial blocks.

Each GEMM can also take its own formats (:attr:`Float8Config.gemms`, e.g. an MXFP8 forward
with NVFP4 gradients): :meth:`Float8Config.for_gemm` is the configuration a GEMM uses.

Example:
    >>> r = Float8Config.from_name("delayed")
    >>> r.input.scaling, r.input.history_len, r.grad_output.fmt
    ('delayed', 16, 'e5m2')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from lowprec.core.formats import get_format
from lowprec.core.granularity import Granularity, K
from lowprec.core.observe import GEMMS as GEMMS  # y = x Wᵀ, dx = g W, dW = gᵀ x
from lowprec.core.registry import Registry
from lowprec.core.scales import check_margin, check_scaled_cast, group_scale
from lowprec.float8.config_checks import GEMM_ROLES as GEMM_ROLES  # each GEMM's (a, b) roles
from lowprec.float8.config_checks import ROLES as ROLES
from lowprec.float8.config_checks import check_gemms, check_hadamard

__all__ = [
    "ATTENTION_SCALINGS",
    "PRESETS",
    "CastConfig",
    "Float8Config",
    "Float8Recipe",
    "recipe_names",
]

ATTENTION_SCALINGS = ("tensorwise", "headwise", "rowwise")
"""Values of :attr:`Float8Config.attention` (:mod:`lowprec.float8.attention`)."""

Scaling = Literal["dynamic", "delayed", "static"]

_HISTORY_LEN = 16  # CastConfig's defaults of the delayed-only fields
_ALGO: Literal["max", "most_recent"] = "max"
# the largest element format max a scaled GEMM emulates: max² · K stays finite in FP32
_MAX_ELEMENT = 2.0**48


@dataclass(frozen=True)
class CastConfig:
    """How one operand role is cast to a narrow format.

    ``scale = amax · 2^margin / fmt.max`` (rounded up to a power of two with
    ``power_of_two``) for the granularities ``tensor``, ``axis`` and ``block``, where
    ``amax`` comes from:

    * ``dynamic``: the tensor itself, every call;
    * ``delayed``: the largest (``algo="max"``) or latest (``"most_recent"``) ``amax`` of the
      previous ``history_len`` training steps. Warm-up: while the history holds no positive
      ``amax`` (the first step), the tensor's own ``amax`` is used. The history is updated
      in training mode only; a non-finite ``amax`` is not recorded;
    * ``static``: a fixed scale, either ``static_scale`` or calibrated with
      :func:`lowprec.float8.calibrate` (the running maximum of ``amax`` over the
      calibration batches), then frozen. Using it before calibration is an error.

    ``mx_scale`` picks the MX block scale: ``"floor"`` is the OCP MX v1.0 definition
    ``2^(floor(log2 amax) - emax)``, which puts a block's ``amax`` in ``[2^emax, 2^(emax+1))``
    so a maximum above ``fmt.max`` (E4M3: a mantissa above 1.75) saturates; ``"ceil"``
    rounds ``amax / fmt.max`` up to a power of two (as NVIDIA's MXFP8 training recipe
    does), so nothing saturates at the cost of up to one binade of headroom.

    MX and NVFP4 granularities have their own scale rules, and ``margin`` (binades of
    headroom, ``|x / scale| <= fmt.max · 2^-margin``) applies to them as follows:

    * ``mx``: the E8M0 exponent is shifted by ``margin``, which must be a whole number
      (``ValueError`` otherwise; an E8M0 scale is a power of two): ``"floor"`` gives
      ``2^(floor(log2 amax) - emax + margin)``, ``"ceil"`` the power of two at or above
      ``amax · 2^margin / fmt.max``: the ``margin=0`` scale times ``2^margin`` either way
      (clamped to E8M0's range);
    * ``nv``: the per-tensor scale is multiplied by ``2^margin`` and the E4M3 block scales
      are unchanged (:func:`lowprec.core.scales.nv_scale`): every scale is the
      ``margin=0`` one times ``2^margin``.

    ``power_of_two=True`` is refused (``ValueError``) for ``mx`` (its scales are powers of
    two by definition; ``mx_scale="ceil"`` is the rounding up that ``power_of_two`` means
    elsewhere) and ``nv`` (its block scales are E4M3 values, not powers of two).

    ``history_len`` and ``algo`` only mean something to delayed scaling: a non-default
    value with ``scaling="dynamic"`` or ``"static"`` raises ``ValueError`` (the scale
    comes from the tensor itself or is fixed; no history is kept).

    Delayed and static scaling keep one scale per tensor (``granularity="tensor"``): a
    history of per-row scales would depend on the batch shape.

    ``rounding`` rounds ``x / scale`` into ``fmt``: ``"nearest"`` (ties to even) or
    ``"stochastic"``: down or up to its neighbours ``lo < |v| < hi`` with
    ``P(hi) = (|v| − lo) / (hi − lo)``, so ``E[Q(v)] = v`` below saturation
    (:func:`lowprec.core.rounding.quantize`). The draws come from a counter-based stream
    keyed by the config's ``seed``, the layer, its step counter, the GEMM and the role
    (:func:`lowprec.core.hadamard.stream_seed`; :class:`~lowprec.float8.Float8Linear`
    keeps the counter in its ``state_dict``).
    """

    fmt: str = "e4m3fn"
    granularity: str = "tensor"
    scaling: Scaling = "dynamic"
    margin: float = 0.0
    power_of_two: bool = False
    history_len: int = _HISTORY_LEN
    algo: Literal["max", "most_recent"] = _ALGO
    static_scale: float | None = None
    mx_scale: Literal["floor", "ceil"] = "floor"
    rounding: Literal["nearest", "stochastic"] = "nearest"

    def __post_init__(self) -> None:
        try:
            f = get_format(self.fmt)
        except (ValueError, TypeError) as e:
            raise type(e)(f"fmt: {e}") from None
        object.__setattr__(self, "fmt", f.name)
        g = _parse(self.granularity)
        # Bound once here: no Granularity is built while torch.compile traces a GEMM.
        object.__setattr__(self, "_bound", (g.bind(0), g.bind(1)))
        if self.scaling not in ("dynamic", "delayed", "static"):
            raise ValueError(
                f"scaling must be 'dynamic', 'delayed' or 'static', got {self.scaling!r}"
            )
        if self.scaling != "dynamic" and g.kind != "tensor":
            raise ValueError(
                f"scaling={self.scaling!r} needs granularity='tensor', got "
                f"{self.granularity!r} (a history of per-row or per-block scales would "
                "depend on the batch shape)"
            )
        if self.mx_scale not in ("floor", "ceil"):
            raise ValueError(f"mx_scale must be 'floor' or 'ceil', got {self.mx_scale!r}")
        if self.mx_scale != "floor" and g.kind != "mx":
            raise ValueError("mx_scale only applies to granularity 'mx' / 'mx:B'")
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {self.rounding!r}")
        if self.rounding == "stochastic" and not f.signed:
            raise ValueError(f"rounding='stochastic' is not defined for fmt {f.name!r}")
        check_margin(self.margin)  # finite, |margin| <= 256 (a NaN failed at the first cast)
        if not isinstance(self.power_of_two, bool):
            raise TypeError("power_of_two must be a bool")
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int):
            raise TypeError("history_len must be an int")
        if self.history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {self.history_len}")
        if self.algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {self.algo!r}")
        if self.scaling != "delayed":
            for name, default in (("history_len", _HISTORY_LEN), ("algo", _ALGO)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} only applies to scaling='delayed', "
                        f"got scaling={self.scaling!r} (its scale keeps no amax history; "
                        f"leave {name} at {default!r})"
                    )
        check_scaled_cast(f, g.kind, self.power_of_two)
        if f.max > _MAX_ELEMENT:
            raise ValueError(
                f"fmt {f.name!r}: its max ({f.max:.3g}) is above 2^48; the emulated GEMM "
                "multiplies payloads near fmt.max in FP32 (C = (A_q B_q) s_A s_B), which "
                "would overflow. Keep that GEMM in high precision (high_precision_gemms) "
                "instead"
            )
        if g.kind == "mx" and self.margin != int(self.margin):
            raise ValueError(
                f"margin must be a whole number of binades for granularity "
                f"{self.granularity!r} (it shifts the E8M0 exponent), got {self.margin}"
            )
        if self.static_scale is not None:
            if self.scaling != "static":
                raise ValueError("static_scale is only used with scaling='static'")
            s = self.static_scale
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < float("inf"):
                raise ValueError(f"static_scale must be a finite number > 0, got {s!r}")

    @property
    def gemm_granularity(self) -> Granularity:
        """The granularity in the core grammar, relative to the contracted dim ``K``."""
        return _parse(self.granularity)

    def bound_granularity(self, cd: int) -> Granularity:
        """The granularity of an operand contracted over its dim ``cd`` (0 or 1):
        ``gemm_granularity.bind(cd)``."""
        if cd not in (0, 1):
            raise ValueError(f"cd must be 0 or 1, got {cd!r}")
        g: Granularity = self._bound[cd]  # type: ignore[attr-defined]
        return g

    def scale_for(self, amax: Tensor) -> Tensor:
        """The tensor-wise scale of ``amax``: ``amax · 2^margin / fmt.max``, a power of two
        with ``power_of_two``; NaN for a non-finite ``amax`` where ``fmt`` has no Inf and NaN
        codes — :func:`lowprec.core.scales.group_scale` at tensor granularity, the scale
        function the core scalers use too."""
        return group_scale(amax, self.fmt, "tensor", self.margin, self.power_of_two)

    def describe(self) -> str:
        """Short text such as ``dyn:tensor:e4m3fn`` (``...:sr`` for stochastic rounding)."""
        sr = ":sr" if self.rounding == "stochastic" else ""
        return f"{self.scaling[:3]}:{self.granularity}:{self.fmt}{sr}"


def _parse(name: str) -> Granularity:
    """A cast's granularity name in the core grammar, relative to ``K``."""
    if not isinstance(name, str):
        raise TypeError(f"granularity must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    g = Granularity.from_name("axis" if key == "row" else key, axis=K)
    if g.kind != "tensor" and not g.relative:
        raise ValueError(
            f"granularity {name!r} names an absolute axis; a float8 cast is stated along the "
            "GEMM's contracted dim K: 'axis', 'block:RxC', 'mx:B', 'nv:B' (or with '@K')"
        )
    return g


def _e4(**kw: Any) -> CastConfig:
    return CastConfig("e4m3fn", **kw)


def _e5(**kw: Any) -> CastConfig:
    return CastConfig("e5m2", **kw)


@dataclass(frozen=True)
class Float8Config:
    """A float8 training recipe: one :class:`CastConfig` per role plus matmul options.

    * ``emulate``: ``None`` (default) uses the hardware FP8 kernel (``torch._scaled_mm``)
      where it is fast — CUDA, compute capability 8.9 or newer, tensor or axis granularity,
      E4M3/E5M2 operands, dimensions multiples of 16 — and the exact emulation elsewhere;
      ``True`` always emulates; ``False`` asks for the kernel and logs a warning (once)
      where it cannot be used and the emulation runs instead.
    * ``emulation_dtype``: ``"fp32"`` (default) multiplies the quantized values in float32,
      which is exact for the products and accumulates in fp32 like the hardware; ``"bf16"``
      is faster on some CPUs and rounds the dequantized operands and the output to bf16.
    * ``fp8_saved_activations``: save the quantized input (1 byte per element for 8-bit
      formats) for the backward pass instead of the high-precision input. For tensor
      granularity the numerics are identical (backward uses the forward's quantized
      input either way). For other granularities the weight-gradient GEMM then
      re-quantizes the dequantized saved input along the token dimension: two roundings.
    * ``high_precision_gemms``: the GEMMs of the three (``"forward"`` ``y = x Wᵀ``,
      ``"input_grad"`` ``dx = g W``, ``"weight_grad"`` ``dW = gᵀ x``) that multiply the
      unquantized operands, in the GEMM's output dtype (the autocast dtype under autocast),
      instead of in float8 (with ``"weight_grad"`` the unquantized input is saved for it,
      whatever ``fp8_saved_activations``; an input that arrives quantized, FP8-gathered, is
      its quantized values). A role whose every GEMM is listed is never quantized. The
      ``rowwise-gw-hp`` preset keeps the weight gradient in high precision, as torchao's
      ``rowwise_with_gw_hp`` does.
    * ``gemms``: formats per GEMM, pairs ``(gemm, config)`` (a dict or a list of pairs is
      accepted and normalised to a tuple in :data:`GEMMS` order; ``config`` may be a
      preset name). GEMM ``gemm`` quantizes its two operands with ``config``'s casts of
      their roles — ``forward`` ``y = Q(x) Q(W)ᵀ``: ``config.input``, ``config.weight``;
      ``input_grad`` ``dx = Q(g) Q(W)``: ``config.grad_output``, ``config.weight``;
      ``weight_grad`` ``dW = Q(g)ᵀ Q(x)``: ``config.grad_output``, ``config.input`` — and
      multiplies them with ``config.emulate`` and ``config.emulation_dtype``; the other
      fields of ``config`` are not used (``fp8_saved_activations`` is this config's). A GEMM
      not listed uses this config (:meth:`for_gemm`). The delayed and static scaling state
      belongs to this config's roles: an override's cast of a role its GEMM uses must be
      ``scaling="dynamic"`` unless it equals this config's cast of that role (the GEMM then
      uses the role's scale, as a GEMM without an override does); a cast that differs
      computes its own scale from the operand (:meth:`own_cast`). An operand is shared
      between GEMMs only where both quantize it alike: the quantized input is saved for the
      weight gradient (``fp8_saved_activations``) only where the weight-gradient GEMM's
      input cast is the forward's and, if it is an override's, tensor-wise (the same
      values; else the high-precision input is saved); a tensor-wise gradient is quantized
      once for both backward GEMMs only where their casts of it are equal. A GEMM may not
      be both in ``gemms`` and in ``high_precision_gemms``; an override has neither.
      Example: ``Float8Config.from_name("tensorwise", gemms={"weight_grad": "nvfp4"})``
      (the ``tensorwise-wgrad-nvfp4`` preset).

    * ``hadamard``: GEMMs (names of :data:`GEMMS`) whose two operands are multiplied by a
      random Hadamard transform along the contracted dimension before they are quantized:
      ``A B = (A Hᵀ)(H B)`` for the block-diagonal orthogonal ``H`` of
      :func:`lowprec.core.hadamard.block_hadamard` (blocks of ``hadamard_block``: 16 for
      NVFP4, 32 for MX; signs seeded by ``hadamard_seed``, which *is* the stored sign
      vector: :func:`~lowprec.core.hadamard.random_signs`). Equal to the untransformed
      product in exact arithmetic; an outlier is spread over its block before the block
      scale is taken. The casts of such a GEMM must be dynamic (their scale is taken from
      the transformed operand), and its operands are not shared with other GEMMs.
    * ``seed``: the run seed of stochastic rounding (``CastConfig.rounding``): each cast
      draws from :func:`lowprec.core.hadamard.stream_seed` ``(seed, layer key, step,
      GEMM, role)``, the layer key and step held by the layer (its ``rng_state`` buffer).
    * ``attention``: ``None`` (default) leaves attention as the model computes it; one of
      :data:`ATTENTION_SCALINGS` runs attention's two GEMMs ``S = Q Kᵀ`` and ``O = P V``
      (and the four of its backward) in FP8, emulated, with dynamic scales per tensor
      (``"tensorwise"``), per batch and head (``"headwise"``) or per row of each operand
      along the GEMM's contracted dimension (``"rowwise"``); softmax in FP32
      (:mod:`lowprec.float8.attention`). :func:`~lowprec.float8.apply` hooks it into the
      reference model and HF transformers models (SDPA or eager attention).
    * ``fp8_router``: ``False`` (default) keeps the routers of MoE layers (the ``gate`` or
      ``router`` next to an experts module, :func:`lowprec.float8.experts.router_ids`) in
      high precision, as the routing decisions and the load-balancing loss are sensitive
      to them and they are a small share of the FLOPs; ``True`` converts them too (an
      ``nn.Linear`` router to :class:`~lowprec.float8.Float8Linear`, a ``TopKRouter`` to
      :class:`~lowprec.float8.router.Float8Router`).

    Use :meth:`from_name` for the presets (:func:`recipe_names`).
    """

    name: str = "custom"
    input: CastConfig = field(default_factory=_e4)
    weight: CastConfig = field(default_factory=_e4)
    grad_output: CastConfig = field(default_factory=_e5)
    emulate: bool | None = None
    emulation_dtype: Literal["fp32", "bf16"] = "fp32"
    fp8_saved_activations: bool = True
    high_precision_gemms: tuple[str, ...] = ()
    gemms: tuple[tuple[str, Float8Config], ...] = ()
    hadamard: tuple[str, ...] = ()
    hadamard_block: int = 16
    hadamard_seed: int = 0
    seed: int = 0
    attention: str | None = None
    fp8_router: bool = False

    def __post_init__(self) -> None:
        hp = self.high_precision_gemms
        if isinstance(hp, list):
            object.__setattr__(self, "high_precision_gemms", hp := tuple(hp))
        if not isinstance(hp, tuple) or not set(hp) <= set(GEMMS) or len(set(hp)) != len(hp):
            raise ValueError(
                f"high_precision_gemms must be distinct names among {GEMMS}, got {hp!r}"
            )
        for role in ROLES:
            c = getattr(self, role)
            if not isinstance(c, CastConfig):
                raise TypeError(f"{role} must be a CastConfig, got {type(c).__name__}")
        if self.emulate not in (None, True, False):
            raise TypeError("emulate must be None, True or False")
        if self.emulation_dtype not in ("fp32", "bf16"):
            raise ValueError(
                f"emulation_dtype must be 'fp32' or 'bf16', got {self.emulation_dtype!r}"
            )
        if not isinstance(self.fp8_saved_activations, bool):
            raise TypeError("fp8_saved_activations must be a bool")
        if not isinstance(self.fp8_router, bool):
            raise TypeError(f"fp8_router must be a bool, got {type(self.fp8_router).__name__}")
        for name in ("hadamard_seed", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        b = self.hadamard_block
        if isinstance(b, bool) or not isinstance(b, int) or b < 2 or b & (b - 1):
            raise ValueError(f"hadamard_block must be a power of two >= 2, got {b!r}")
        self._check_gemms()
        self._check_hadamard()
        if self.attention is not None and self.attention not in ATTENTION_SCALINGS:
            raise ValueError(
                f"attention must be None or one of {ATTENTION_SCALINGS}, got {self.attention!r}"
            )
        casts = [self.cast(role) for role in ROLES]
        casts += [c.cast(role) for g, c in self.gemms for role in GEMM_ROLES[g]]
        object.__setattr__(self, "_sr", any(c.rounding == "stochastic" for c in casts))

    def _check_gemms(self) -> None:
        """Validate and normalise :attr:`gemms` (:func:`.config_checks.check_gemms`)."""
        check_gemms(self)

    def _check_hadamard(self) -> None:
        """Validate and normalise :attr:`hadamard` (:func:`.config_checks.check_hadamard`)."""
        check_hadamard(self)

    @property
    def stochastic(self) -> bool:
        """Whether any cast (of a role, or of a per-GEMM config) rounds stochastically."""
        sr: bool = self._sr  # type: ignore[attr-defined]
        return sr

    def for_gemm(self, gemm: str) -> Float8Config:
        """The config GEMM ``gemm`` (one of :data:`GEMMS`) uses: its :attr:`gemms` entry,
        else this config itself."""
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        per: dict[str, Float8Config] = self._per_gemm  # type: ignore[attr-defined]
        return per.get(gemm, self)

    def gemm_cast(self, gemm: str, role: str) -> CastConfig:
        """The cast GEMM ``gemm`` quantizes ``role`` with: ``for_gemm(gemm).cast(role)``."""
        return self.for_gemm(gemm).cast(role)

    def own_cast(self, gemm: str, role: str) -> bool:
        """Whether GEMM ``gemm``'s cast of ``role`` differs from this config's cast of
        ``role`` (a per-GEMM override): the GEMM then quantizes ``role`` dynamically with
        its own scale instead of the role's (delayed, static or shared) scale."""
        own: frozenset[tuple[str, str]] = self._own  # type: ignore[attr-defined]
        return (gemm, role) in own

    def same_cast(self, role: str, a: str, b: str) -> bool:
        """Whether GEMMs ``a`` and ``b`` quantize ``role`` with equal casts."""
        same: frozenset[tuple[str, str, str]] = self._same  # type: ignore[attr-defined]
        return (role, a, b) in same

    def cast(self, role: str) -> CastConfig:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        c: CastConfig = getattr(self, role)
        return c

    def replace(self, **changes: Any) -> Float8Config:
        """A copy with fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Float8Config:
        d = dict(d)
        for role in ROLES:
            if isinstance(d.get(role), dict):
                d[role] = CastConfig(**d[role])
        if isinstance(d.get("gemms"), (list, tuple)):
            d["gemms"] = tuple(
                (p[0], cls.from_dict(p[1]) if isinstance(p[1], dict) else p[1])
                if isinstance(p, (list, tuple)) and len(p) == 2
                else p
                for p in d["gemms"]
            )
        for name in ("high_precision_gemms", "hadamard"):
            if isinstance(d.get(name), list):
                d[name] = tuple(d[name])
        return cls(**d)

    def describe(self) -> str:
        """Short text of the casts, per GEMM where :attr:`gemms` gives any, e.g.
        ``input=dyn:tensor:e4m3fn, weight=..., grad_output=...`` followed by
        ``weight_grad=[grad_output=dyn:nv:16:e2m1, input=dyn:nv:16:e2m1]``."""
        out = ", ".join(f"{role}={self.cast(role).describe()}" for role in ROLES)
        for g, c in self.gemms:
            casts = ", ".join(f"{role}={c.cast(role).describe()}" for role in GEMM_ROLES[g])
            out += f", {g}=[{casts}]"
        for g in self.high_precision_gemms:
            out += f", {g}=high-precision"
        for g in self.hadamard:
            out += f", {g}=hadamard:{self.hadamard_block}"
        if self.attention is not None:
            out += f", attention={self.attention}"
        if self.fp8_router:
            out += ", router=fp8"
        return out

    @classmethod
    def from_name(cls, name: str, **changes: Any) -> Float8Config:
        """A preset by name, optionally with fields changed. Unknown names list the valid ones.

        Example:
            >>> Float8Config.from_name("rowwise").weight.granularity
            'axis'
        """
        if not isinstance(name, str):
            raise TypeError(f"recipe name must be a str, got {type(name).__name__}")
        key = name.strip().lower()
        return PRESETS.get(key, **changes).replace(name=key)


PRESETS: Registry[Float8Config] = Registry("float8 recipe", Float8Config)
"""The float8 presets: keyword arguments of :class:`Float8Config` by name (the preset's
``name`` field is its key, filled in by :meth:`Float8Config.from_name`)."""


def recipe_names() -> list[str]:
    """Names accepted by :meth:`Float8Config.from_name`."""
    return PRESETS.names()


Float8Recipe = Float8Config
"""Alias of :class:`Float8Config` (its name before 0.2: a float8 *recipe* is a
:class:`Float8Config`; a :class:`~lowprec.recipes.Recipe` is a whole training set-up)."""
