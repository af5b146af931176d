"""Unit-scaling primitives: ``scale_fwd``, ``scale_bwd``, constraints.

A unit-scaled op multiplies its forward output by a fixed ``α`` and, independently, the
gradients of its inputs by fixed ``β_i``, chosen at build time so that each is ~unit
variance when the inputs and the incoming gradient are unit variance (Blake et al. 2023):

* ``scale_fwd(x, s)``: forward ``y = s·x``; backward ``∂L/∂x = ∂L/∂y`` (unscaled).
* ``scale_bwd(x, s)``: forward ``y = x``; backward ``∂L/∂x = s·∂L/∂y``.

Scaling the two passes differently makes the computed gradient differ from the true one of
the computed forward by fixed per-tensor factors. That is harmless *only at cut edges*
(a weight, or a variable whose gradient is not used to compute another op's gradient),
so the cut-edge rule is: the output and the non-cut-edge inputs of an op must share one
scale; each weight gradient gets its own. Constraints pick that shared scale:

* ``"gmean"``: ``(α·Πβ_i)^(1/(n+1))``; ``"hmean"``: ``(n+1) / (1/α + Σ 1/β_i)``;
* ``"to_output_scale"``: all ``= α``; ``"to_grad_input_scale"``: all ``= gmean(β_i)``;
* ``None``: no constraint (each scale ideal; use where every input is a cut edge).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal, ParamSpec, TypeVar, cast, get_args

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function

from lowprec.core.autograd import apply_fn
from lowprec.core.checks import check_flag as check_flag
from lowprec.core.checks import check_number as check_number

__all__ = [
    "CONSTRAINTS",
    "Constraint",
    "apply_constraint",
    "check_dim",
    "check_float",
    "check_number",
    "check_same_dtype",
    "scale_bwd",
    "scale_elementwise",
    "scale_fwd",
    "unit_op",
]

Constraint = (
    Literal[
        "gmean",
        "hmean",
        "amean",
        "to_output_scale",
        "to_grad_input_scale",
        "to_left_grad_scale",
        "to_right_grad_scale",
    ]
    | None
)
CONSTRAINTS: tuple[str | None, ...] = (*get_args(get_args(Constraint)[0]), None)

P = ParamSpec("P")
R = TypeVar("R")


_PLAIN = threading.local()


@contextlib.contextmanager
def plain_ops() -> Iterator[None]:
    """While this runs (this thread), every unit mode (:class:`lowprec.unit.mode.UnitMode`)
    passes ops through unchanged: code that must compute what the plain model computes (an
    MoE router's softmax and top-k, the load-balancing loss) runs inside it, and so does a
    unit op's own body under ``torch.compile``. Nested uses are counted."""
    _PLAIN.depth = getattr(_PLAIN, "depth", 0) + 1
    try:
        yield
    finally:
        _PLAIN.depth -= 1


def unit_op(fn: Callable[P, R]) -> Callable[P, R]:
    """Make ``fn`` overridable by torch function modes, like ``torch.nn.functional`` ops.

    Inside :func:`lowprec.unit.unit_scale`'s mode a unit op is seen as *one* call and run
    as it is, so the standard torch ops it calls inside are not converted a second time:
    eagerly the mode runs it with itself switched off; while Dynamo traces it (Dynamo does
    not dispatch a Python function to a mode) its body runs in :func:`plain_ops`. (Before,
    a unit op called in a unit model's own forward had its products scaled twice when
    compiled: ``1/√K`` too small.)
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling():
            with plain_ops():
                return fn(*args, **kwargs)
        tensors = tuple(a for a in args if isinstance(a, Tensor))
        if has_torch_function(tensors):
            out = handle_torch_function(wrapper, tensors, *args, **kwargs)
            return out  # type: ignore[no-any-return]
        return fn(*args, **kwargs)

    return wrapper


class _ScaleFwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, s: float) -> Tensor:
        return x * s

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g, None


class _ScaleBwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, s: float) -> Tensor:
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g * ctx.s, None


def _check_scale(s: object) -> float:
    """``s`` as a float; ``TypeError`` unless a finite real number. Under ``torch.compile``
    a scale from sizes may be symbolic (dynamic shapes: ``1/√batch``), finite by
    construction: only its type is checked there (the finiteness test would break the
    graph), the value in eager."""
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise TypeError(f"s must be a finite Python float, got {s!r}")
    if torch.compiler.is_compiling():
        return cast(float, s)
    if not math.isfinite(s):
        raise TypeError(f"s must be a finite Python float, got {s!r}")
    return float(s)


@unit_op
def scale_fwd(x: Tensor, s: float) -> Tensor:
    """Forward ``y = s·x``; backward passes ``∂L/∂y`` through unscaled.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = scale_fwd(x, 3.0); y.sum().backward()
        >>> y.tolist(), x.grad.tolist()
        ([3.0, 3.0], [1.0, 1.0])
    """
    s = _check_scale(s)
    return x if s == 1.0 else cast(Tensor, apply_fn(_ScaleFwd, x, s))


@unit_op
def scale_bwd(x: Tensor, s: float) -> Tensor:
    """Forward ``y = x``; backward ``∂L/∂x = s·∂L/∂y``.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = scale_bwd(x, 3.0); y.sum().backward()
        >>> y.tolist(), x.grad.tolist()
        ([1.0, 1.0], [3.0, 3.0])
    """
    s = _check_scale(s)
    return x if s == 1.0 else cast(Tensor, apply_fn(_ScaleBwd, x, s))


def apply_constraint(
    constraint: str | None, output_scale: float, *grad_input_scales: float
) -> tuple[float, ...]:
    """Return ``(α, β_1, ..., β_n)`` after applying ``constraint`` (see the module doc).

    Only the scales of the output and of the *non-cut-edge* inputs are passed here; weight
    gradient scales are left out and stay ideal.

    Example:
        >>> apply_constraint("gmean", 4.0, 1.0)
        (2.0, 2.0)
        >>> apply_constraint(None, 4.0, 1.0)
        (4.0, 1.0)
    """
    if constraint not in CONSTRAINTS:
        raise ValueError(f"constraint must be one of {list(CONSTRAINTS)}, got {constraint!r}")
    scales = (output_scale, *grad_input_scales)
    if constraint is None or not grad_input_scales:
        return scales
    n = len(scales)
    if constraint == "gmean":
        s = math.exp(sum(math.log(v) for v in scales) / n)
    elif constraint == "hmean":
        s = n / sum(1.0 / v for v in scales)
    elif constraint == "amean":
        s = sum(scales) / n
    elif constraint == "to_output_scale":
        s = output_scale
    elif constraint in ("to_left_grad_scale", "to_right_grad_scale"):
        if len(grad_input_scales) != 2:
            raise ValueError(
                f"constraint {constraint!r} ties a two-operand op's scales (output, left, "
                f"right); got {len(grad_input_scales)} gradient scale(s)"
            )
        s = grad_input_scales[0 if constraint == "to_left_grad_scale" else 1]
    else:  # to_grad_input_scale
        s = math.exp(sum(math.log(v) for v in grad_input_scales) / len(grad_input_scales))
    return (s,) * n


def check_float(name: str, x: object, optional: bool = False) -> None:
    """``TypeError`` naming ``name`` unless ``x`` is a real floating-point tensor (or
    ``None`` when ``optional``): unit ops refuse integer, bool and complex inputs rather
    than computing on them in a dtype the scales were not derived for."""
    if x is None and optional:
        return
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_constraint(constraint: object) -> None:
    """``ValueError`` unless ``constraint`` is one of :data:`CONSTRAINTS` (for a module's
    constructor: the op checks it at every call, a module already when it is built)."""
    if constraint not in CONSTRAINTS:
        raise ValueError(f"constraint must be one of {list(CONSTRAINTS)}, got {constraint!r}")


def check_dim(name: str, x: Tensor, dim: object) -> int:
    """``dim`` as a non-negative index into ``x``'s dims (a 0-dim tensor has the one dim
    ``0``/``-1`` of size 1, as torch's reductions treat it); ``TypeError`` / ``ValueError``
    naming ``name`` otherwise."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    nd = max(x.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(
            f"{name}={dim} is out of range for a tensor of {x.dim()} dims "
            f"(shape {tuple(x.shape)}): need {-nd} <= {name} < {nd}"
        )
    return dim % nd


def check_same_dtype(**tensors: Tensor | None) -> None:
    """``TypeError`` naming the arguments if the given tensors differ in dtype (a matmul,
    attention or convolution does not promote: torch would fail deep inside)."""
    given = {k: t.dtype for k, t in tensors.items() if t is not None}
    if len(set(given.values())) > 1:
        listing = ", ".join(f"{k}: {d}" for k, d in given.items())
        raise TypeError(f"{', '.join(given)} must share one dtype, got {listing}")


def scale_elementwise(
    f: Callable[..., Tensor],
    output_scale: float,
    grad_input_scale: float,
    constraint: str | None = "to_output_scale",
) -> Callable[..., Tensor]:
    """``f`` (elementwise in its first argument) as a unit op: ``y = s_out·f(x, ...)``,
    ``∂x = s_in·f'(x)ᵀg``, the two scales tied by ``constraint`` (unit-scaling's
    ``scale_elementwise``; the scales are what makes ``f`` unit for unit inputs)."""
    if not callable(f):
        raise TypeError(f"f must be callable, got {type(f).__name__}")
    s_out, s_in = apply_constraint(
        constraint,
        check_number("output_scale", output_scale, 0.0, open_low=True),
        check_number("grad_input_scale", grad_input_scale, 0.0, open_low=True),
    )

    def scaled(x: Tensor, *args: object, **kwargs: object) -> Tensor:
        check_float("x", x)
        return scale_fwd(f(scale_bwd(x, s_in), *args, **kwargs), s_out)

    return scaled
