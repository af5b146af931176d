"""``ScaledTensor``: a tensor stored as ``data × scale``.

``data`` is any floating dtype (float8 included) and ``scale`` a float32 tensor that applies
to it block-wise (each scale dim is 1, equal to the data dim, or divides it: see
:func:`lowprec.core.granularity.apply_scale`).
The ``ScaledTensor`` reports the shape of ``data`` and a
*logical* dtype: the dtype :meth:`ScaledTensor.dequantize` returns.

The payload is ``.qdata`` (``Tensor.data`` is torch's own detached alias and keeps its
meaning), the scale ``.scale``, the format of the payload ``.fmt``.

Optional metadata for consumers such as float8's GEMMs: ``.granularity`` (the absolute
:class:`~lowprec.core.granularity.Granularity` the scale was computed at; ``None`` when
unknown) and ``.unpadded_shape``: when set, ``data`` was zero-padded to whole blocks (the
padding policy of :mod:`lowprec.core.granularity`) and stands for a tensor of that smaller
shape, which :meth:`ScaledTensor.dequantize` returns (cropped; its gradient is zero-padded).

Gradient rule (straight-through): :func:`quantize_scaled` and :meth:`ScaledTensor.dequantize`
pass gradients through unchanged, ``∂L/∂x = ∂L/∂dequantize(quantize_scaled(x))``. Rounding is
treated as the identity and the scale, a statistic of the data, as a constant.

Ops: a ScaledTensor supports ``detach``, ``clone`` and ``.to(...)`` (``.to(device)`` moves
data and scale; ``.to(dtype)`` changes the logical dtype and leaves the payload alone), and
the layout ops that keep its scale layout valid (:mod:`lowprec.core.tensor_ops`:
transposes, views of a tensor-scaled value, slices, splits and ``cat`` that do not cut a
scale block, ``copy_`` into a plain tensor, ``index_put_`` of equally scaled values). Any
other op raises ``NotImplementedError`` naming the op: call ``.dequantize()`` first, or add a
rule with :func:`register_rule` (the float8 and scalify layers do).

Domains: a ScaledTensor may carry a ``domain`` name (``None`` by default). Rules registered
with ``register_rule(..., domain="name")`` (and a fallback set by :func:`register_fallback`)
apply only when an argument of the op belongs to that domain, so one technique's rules (e.g.
:mod:`lowprec.scalify`'s arithmetic) never change how another technique's tensors behave.
Lookup order: the domain's rule, the shared rule, the domain's fallback, else the error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lowprec.core import kernels
from lowprec.core.autograd import apply_fn
from lowprec.core.formats import Format, Rounding, get_format
from lowprec.core.granularity import Granularity, apply_scale, as_granularity, check_scale_shape
from lowprec.core.rounding import check_generator, to_format
from lowprec.core.scalers import Scaler, _check_scale_value
from lowprec.core.scales import amax, check_margin, check_scaled_cast, group_scale

__all__ = [
    "LOGICAL_DTYPES",
    "ScaledTensor",
    "quantize_scaled",
    "register_fallback",
    "register_rule",
]

aten = torch.ops.aten
Rule = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
_RULES: dict[Any, Rule] = {}
_PLAIN_RULES: dict[Any, Rule] = {}  # for ScaledTensors of no domain only
_DOMAIN_RULES: dict[str, dict[Any, Rule]] = {}
_FALLBACKS: dict[str, Rule] = {}
LOGICAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes a ScaledTensor may present (its logical dtype)."""


def register_rule(
    *ops: Any, domain: str | tuple[str, ...] | None = None, plain_only: bool = False
) -> Callable[[Rule], Rule]:
    """Register ``fn(func, args, kwargs)`` as the ScaledTensor rule for aten ``ops``.

    With ``domain`` (a name or several) the rule applies only to ops on tensors of that
    domain (see the module docstring); without, to every ScaledTensor. ``plain_only``:
    only to ScaledTensors of no domain (a domain's own rules and fallback keep deciding
    for its tensors).

    Example:
        >>> @register_rule(torch.ops.aten.neg.default)
        ... def _neg(func, args, kwargs):
        ...     x = args[0]
        ...     return ScaledTensor(-x.qdata, x.scale, dtype=x.dtype, fmt=x.fmt)
    """

    domains = (domain,) if isinstance(domain, str) else domain

    def deco(fn: Rule) -> Rule:
        for op in ops:
            if plain_only:
                _PLAIN_RULES[op] = fn
            elif domains is None:
                _RULES[op] = fn
            for d in domains or ():
                _DOMAIN_RULES.setdefault(d, {})[op] = fn
        return fn

    return deco


def register_fallback(domain: str, fn: Rule) -> None:
    """Use ``fn(func, args, kwargs)`` for every op without a rule on ``domain``'s tensors."""
    _FALLBACKS[domain] = fn


def _domain_of(args: tuple[Any, ...]) -> str | None:
    """The domain of the first ScaledTensor argument (lists one level deep included)."""
    for a in args:
        if isinstance(a, ScaledTensor):
            if a._domain is not None:
                return a._domain
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, ScaledTensor) and b._domain is not None:
                    return b._domain
    return None


def _validate(
    data: Tensor, scale: Tensor | float, dtype: torch.dtype | None, fmt: str | Format | None
) -> tuple[Tensor, torch.dtype, str | None]:
    if not isinstance(data, Tensor) or isinstance(data, ScaledTensor):
        raise TypeError(f"data must be a plain torch.Tensor, got {type(data).__name__}")
    if not data.dtype.is_floating_point:
        raise TypeError(f"data must be a floating-point tensor, got dtype {data.dtype}")
    if isinstance(scale, Tensor) and scale.device != data.device:
        raise ValueError(f"scale is on {scale.device} but data is on {data.device}")
    scale_t = _check_scale_value(scale, "scale").to(data.device)
    check_scale_shape(tuple(scale_t.shape), tuple(data.shape))
    if dtype is None:
        dtype = data.dtype if data.dtype in LOGICAL_DTYPES else torch.float32
    elif dtype not in LOGICAL_DTYPES:
        raise ValueError(f"dtype must be one of {LOGICAL_DTYPES}, got {dtype}")
    return scale_t, dtype, None if fmt is None else get_format(fmt, arg="fmt").name


_Meta = tuple[torch.dtype, str | None, str | None, Granularity | None, tuple[int, ...] | None]


def _check_meta(
    data: Tensor, granularity: Granularity | None, unpadded: tuple[int, ...] | None
) -> None:
    if granularity is not None and not isinstance(granularity, Granularity):
        raise TypeError(f"granularity must be a Granularity, got {type(granularity).__name__}")
    if unpadded is None:
        return
    if (
        not isinstance(unpadded, tuple)
        or len(unpadded) != data.dim()
        or not all(
            isinstance(n, int) and 0 <= n <= d for n, d in zip(unpadded, data.shape, strict=True)
        )
    ):
        raise ValueError(
            f"unpadded_shape must be a tuple of ints no larger than data's shape "
            f"{tuple(data.shape)}, got {unpadded!r}"
        )


class ScaledTensor(Tensor):
    """A tensor that represents ``data * scale`` (see the module docstring).

    Example:
        >>> import torch
        >>> t = ScaledTensor(torch.tensor([1.0, -2.0]).to(torch.float8_e4m3fn), torch.tensor(0.5))
        >>> t.dequantize()
        tensor([ 0.5000, -1.0000])
    """

    _data: Tensor
    _scale: Tensor
    _fmt: str | None
    _domain: str | None
    _granularity: str | None
    _unpadded: tuple[int, ...] | None

    @staticmethod
    def __new__(
        cls,
        data: Tensor,
        scale: Tensor | float,
        dtype: torch.dtype | None = None,
        fmt: str | Format | None = None,
        requires_grad: bool = False,
        *,
        domain: str | None = None,
        granularity: Granularity | None = None,
        unpadded_shape: tuple[int, ...] | None = None,
        _trusted: bool = False,
    ) -> ScaledTensor:
        if not _trusted:
            _check_meta(data, granularity, unpadded_shape)
        if _trusted:  # built by lowprec from a scale it computed: skip the checks
            assert isinstance(scale, Tensor) and dtype is not None
            fmt_name = fmt if isinstance(fmt, str) or fmt is None else fmt.name
        else:
            scale, dtype, fmt_name = _validate(data, scale, dtype, fmt)
        out: ScaledTensor = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data.shape,
            strides=data.stride(),
            dtype=dtype,
            device=data.device,
            requires_grad=requires_grad,
        )
        out._data = data
        out._scale = scale
        out._fmt = fmt_name
        out._domain = domain
        # Kept as its canonical name (a str: plain constant metadata for torch.compile).
        out._granularity = None if granularity is None else granularity.name
        out._unpadded = None if unpadded_shape is None else tuple(unpadded_shape)
        return out

    @classmethod
    def _wrap(
        cls,
        data: Tensor,
        scale: Tensor,
        dtype: torch.dtype,
        fmt: str | None,
        domain: str | None = None,
        granularity: Granularity | None = None,
        unpadded_shape: tuple[int, ...] | None = None,
    ) -> ScaledTensor:
        """Build without validation (rules and internal use: the scale is already checked)."""
        return ScaledTensor(
            data,
            scale,
            dtype,
            fmt,
            domain=domain,
            granularity=granularity,
            unpadded_shape=unpadded_shape,
            _trusted=True,
        )

    # ---- accessors -------------------------------------------------------------------
    @property
    def qdata(self) -> Tensor:
        """The payload ``data`` (``x / scale``, in its storage dtype)."""
        return self._data

    @property
    def scale(self) -> Tensor:
        """The float32 scale; block-broadcastable to ``qdata``."""
        return self._scale

    @property
    def domain(self) -> str | None:
        """The name of the rule set that applies to this tensor (``None``: shared rules)."""
        return self._domain

    @property
    def granularity(self) -> Granularity | None:
        """The absolute granularity of the scale, when recorded."""
        return None if self._granularity is None else Granularity.from_name(self._granularity)

    @property
    def unpadded_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this stands for (``shape`` unless zero-padded)."""
        return tuple(self.shape) if self._unpadded is None else self._unpadded

    @property
    def fmt(self) -> Format | None:
        """The number format of the payload, when known."""
        return None if self._fmt is None else get_format(self._fmt)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """``data * scale`` as a plain tensor of ``dtype`` (default: the logical dtype).

        Differentiable: the gradient passes straight through to this ScaledTensor.
        """
        out: Tensor = apply_fn(_Dequantize, self, dtype or self.dtype)
        return out

    # ---- torch subclass protocol -------------------------------------------------------
    def _meta(self) -> _Meta:
        return (self.dtype, self._fmt, self._domain, self.granularity, self._unpadded)

    def __tensor_flatten__(self) -> tuple[list[str], _Meta]:
        return ["_data", "_scale"], self._meta()

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], meta: _Meta, outer_size: Any, outer_stride: Any
    ) -> ScaledTensor:
        return ScaledTensor._wrap(inner["_data"], inner["_scale"], *meta)

    def _stable_hash_for_caching(self) -> str:
        """Identity of the non-tensor metadata, for torch.compile's AOT autograd cache."""
        g, u = self._granularity, self._unpadded
        return f"lowprec.ScaledTensor:{self.dtype}:{self._fmt}:{self._domain}:{g}:{u}"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        domain = _domain_of(args)
        if domain is None:
            rule = _RULES.get(func) or _PLAIN_RULES.get(func)
        else:
            rule = _DOMAIN_RULES.get(domain, {}).get(func) or _RULES.get(func)
            rule = rule or _FALLBACKS.get(domain)
        if rule is None:
            raise NotImplementedError(
                f"ScaledTensor has no rule for {func}; call .dequantize() first, or register "
                "one with lowprec.core.tensor.register_rule"
            )
        return rule(func, args, kwargs or {})

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"ScaledTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"data_dtype={self._data.dtype}, scale_shape={tuple(self._scale.shape)}, "
            f"fmt={self._fmt}, device={self.device}"
            + (f", domain={self._domain})" if self._domain else ")")
        )


# ---- rules needed by autograd, compile, save/load and .to ---------------------------------


def _map_parts(x: ScaledTensor, fn: Callable[[Tensor], Tensor]) -> ScaledTensor:
    return ScaledTensor._wrap(fn(x._data), fn(x._scale), *x._meta())


@register_rule(aten.detach.default, aten.alias.default)
def _detach(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    return _map_parts(args[0], lambda t: func(t))


@register_rule(aten.clone.default)
def _clone(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    x: ScaledTensor = args[0]  # a memory format applies to the data (the scale may be 0-dim)
    return ScaledTensor._wrap(func(x._data, **kwargs), func(x._scale), *x._meta())


@register_rule(aten.copy_.default)
def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    """In-place copy of a ScaledTensor into one of the same layout (``load_state_dict``),
    or into a plain tensor (its dequantized values)."""
    dst, src = args[0], args[1]
    if not isinstance(dst, ScaledTensor) and isinstance(src, ScaledTensor):
        # Into a plain tensor: the values, as torchao's float8 tensor copies them.
        dst.copy_(src.dequantize(torch.float32 if dst.dtype not in LOGICAL_DTYPES else dst.dtype))
        out: ScaledTensor = dst  # the plain destination, as copy_ returns it
        return out
    if not isinstance(dst, ScaledTensor) or not isinstance(src, ScaledTensor):
        raise TypeError(
            "src: a plain tensor cannot be copied into a ScaledTensor (its payload and scale "
            "would have to be recomputed): build one with quantize_scaled instead"
        )
    same = (
        dst._data.shape == src._data.shape
        and dst._data.dtype == src._data.dtype
        and dst._scale.shape == src._scale.shape
        and dst._meta() == src._meta()
    )
    if not same:
        raise ValueError(
            f"src: ScaledTensor {src!r} does not match the destination {dst!r} (shape, payload "
            "dtype, scale shape and metadata must be equal)"
        )
    dst._data.copy_(src._data)
    dst._scale.copy_(src._scale)
    return dst


@register_rule(aten._to_copy.default)
def _to_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ScaledTensor:
    x: ScaledTensor = args[0]
    kw = dict(kwargs)
    dtype = kw.pop("dtype", None) or x.dtype
    if dtype not in LOGICAL_DTYPES:
        raise ValueError(f"dtype: a ScaledTensor's logical dtype must be one of {LOGICAL_DTYPES}")
    kw.pop("layout", None)
    meta = (dtype, *x._meta()[1:])
    return ScaledTensor._wrap(func(x._data, **kw), func(x._scale, **kw), *meta)


@register_rule(aten.is_same_size.default)
def _same_size(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return bool(args[0].shape == args[1].shape)


# ---- autograd -----------------------------------------------------------------------------


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: ScaledTensor, dtype: torch.dtype) -> Tensor:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        out = apply_scale(x._data.to(work), x._scale.to(work))
        ctx.padded = None
        if x._unpadded is not None:
            ctx.padded = tuple(out.shape)
            out = out[tuple(slice(0, n) for n in x._unpadded)]
        return out.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.padded is not None:
            full = grad.new_zeros(ctx.padded)
            full[tuple(slice(0, n) for n in grad.shape)] = grad
            grad = full
        return grad, None


class _QuantizeScaled(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        scale: Tensor,
        fmt: Format,
        rounding: Rounding,
        saturate: bool,
        generator: torch.Generator | None,
    ) -> ScaledTensor:
        if rounding == "nearest" and scale.dtype == torch.float32 and kernels.takes(x, fmt):
            q = kernels.run_scaled_encode(x.detach(), scale, fmt, saturate)  # one pass
            if q is not None:
                return ScaledTensor._wrap(q, scale, x.dtype, fmt.name)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        scaled = apply_scale(x.detach().to(work), scale.to(work), op="div")
        q = to_format(scaled, fmt, rounding=rounding, saturate=saturate, generator=generator)
        return ScaledTensor._wrap(q, scale, x.dtype, fmt.name)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:
        if isinstance(grad, ScaledTensor):
            grad = grad.dequantize()
        return grad, None, None, None, None, None


def quantize_scaled(
    x: Tensor,
    fmt: str | Format,
    granularity: str | Granularity | None = None,
    scaler: Scaler | None = None,
    rounding: Rounding = "nearest",
    saturate: bool = True,
    margin: float = 0.0,
    power_of_two: bool = False,
    generator: torch.Generator | None = None,
) -> ScaledTensor:
    """Scale ``x`` into ``fmt`` and return the ``ScaledTensor`` ``(data, scale)``.

    The scale comes from ``scaler`` if given (its granularity, margin and power-of-two
    rounding apply; passing ``margin`` or ``power_of_two`` too is a ``ValueError``), else from the
    current ``amax`` at ``granularity`` (default ``"tensor"``): ``amax · 2^margin / fmt.max``,
    the OCP MX E8M0 rule for ``"mx"``, two-level E4M3 scales for ``"nv"``
    (:func:`lowprec.core.scales.group_scale`). Then ``data = quantize(x / scale, fmt)``, stored in
    ``fmt``'s torch dtype when it has one (float8, fp16, bf16), else in the narrowest of
    bf16/fp16/fp32 that holds it exactly. ``saturate=True`` (default) clamps values beyond
    ``fmt.max``, which a delayed or static scale can produce. Gradient: straight-through.

    Example:
        >>> import torch
        >>> st = quantize_scaled(torch.tensor([[1.0, -896.0]]), "e4m3fn")
        >>> st.qdata.dtype, st.scale.item(), st.dequantize().tolist()
        (torch.float8_e4m3fn, 2.0, [[1.0, -896.0]])
    """
    if not isinstance(x, Tensor) or isinstance(x, ScaledTensor):
        raise TypeError(f"x must be a plain torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.dtype not in LOGICAL_DTYPES:
        raise TypeError(f"x must be float16/bfloat16/float32/float64, got dtype {x.dtype}")
    fmt = get_format(fmt, arg="fmt")
    if not isinstance(power_of_two, bool):
        raise TypeError(f"power_of_two must be a bool, got {type(power_of_two).__name__}")
    check_generator(generator, rounding)
    if scaler is not None:
        if not isinstance(scaler, Scaler):
            raise TypeError(f"scaler must be a lowprec Scaler, got {type(scaler).__name__}")
        check_margin(margin)
        if margin != 0.0 or power_of_two:  # the scaler's own apply: these would be ignored
            raise ValueError(
                f"margin {margin:g}, power_of_two {power_of_two}: the scaler's own margin "
                f"({scaler.margin:g}) and power_of_two ({scaler.power_of_two}) make the "
                "scale; set them on the scaler, or pass no scaler"
            )
        if granularity is not None and as_granularity(granularity) != scaler.granularity:
            raise ValueError(
                f"granularity {as_granularity(granularity).name} conflicts with the scaler's "
                f"{scaler.granularity.name}; pass one or the other"
            )
        if scaler.fmt != fmt:
            raise ValueError(f"fmt {fmt.name} differs from the scaler's format {scaler.fmt.name}")
        scale = scaler(x)
    else:
        g = as_granularity(granularity or "tensor")
        check_scaled_cast(fmt, g.kind, power_of_two)
        scale = group_scale(amax(x, g), fmt, g, check_margin(margin), power_of_two)
    out: ScaledTensor = apply_fn(_QuantizeScaled, x, scale, fmt, rounding, saturate, generator)
    return out


# torch.load(weights_only=True) needs to know the class is safe to rebuild.
torch.serialization.add_safe_globals([ScaledTensor])
