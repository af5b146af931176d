"""``Float8Conv1D``: float8 GEMMs for HF transformers' ``Conv1D`` (GPT-2, GPT, ...).

HF's ``Conv1D(nf, nx)`` is a linear layer ``y = x W + b`` whose weight is stored transposed,
``W`` of shape ``(nx, nf) = (in_features, out_features)``. :class:`Float8Conv1D` keeps that
parameter (shared, not copied) under the same name and shape, so ``state_dict`` keys and
shapes, and therefore HF checkpoints, are unchanged. Its GEMMs read the ``(out, in)`` view
``Wᵀ``: the numerics are exactly those of a :class:`~lowprec.float8.Float8Linear` converted
from the equivalent ``nn.Linear`` (weight ``Wᵀ``), and autograd returns ``dW`` in the stored
``(in, out)`` layout.

transformers is never imported: a ``Conv1D`` is recognised by its class name and its layout
(:func:`is_conv1d`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lowprec.float8.carry import _carry_extras, _carry_hooks
from lowprec.float8.config import Float8Config
from lowprec.float8.linear import Float8Linear

__all__ = ["Float8Conv1D", "is_conv1d"]


def is_conv1d(mod: nn.Module) -> bool:
    """True for an HF ``transformers.pytorch_utils.Conv1D`` (or a module of that name and
    layout, or a subclass of one): integer ``nf``/``nx``, a 2-D ``weight`` of shape
    ``(nx, nf)`` and a ``bias`` of shape ``(nf,)`` or ``None``."""
    if not any(c.__name__ == "Conv1D" for c in type(mod).__mro__):
        return False  # (a subclass: unit scaling's converted UnitConv1D)
    nf, nx = getattr(mod, "nf", None), getattr(mod, "nx", None)
    w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
    if not isinstance(nf, int) or not isinstance(nx, int) or not isinstance(w, Tensor):
        return False
    if tuple(w.shape) != (nx, nf):
        return False
    return b is None or (isinstance(b, Tensor) and tuple(b.shape) == (nf,))


class Float8Conv1D(Float8Linear):
    """A :class:`~lowprec.float8.Float8Linear` whose ``weight`` is stored ``(in, out)``, as
    HF's ``Conv1D`` stores it (see the module docstring).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Conv1D(nn.Module):  # HF's layout: weight (nx, nf), y = x @ W + b
        ...     def __init__(self, nf: int, nx: int) -> None:
        ...         super().__init__()
        ...         self.nf, self.nx = nf, nx
        ...         self.weight = nn.Parameter(torch.randn(nx, nf))
        ...         self.bias = nn.Parameter(torch.zeros(nf))
        >>> m = Float8Conv1D.from_conv1d(Conv1D(32, 64), "tensorwise")
        >>> m.weight.shape, m(torch.randn(4, 64)).shape
        (torch.Size([64, 32]), torch.Size([4, 32]))
    """

    _conv1d_cls: type[nn.Module] | None = None

    @classmethod
    def from_conv1d(cls, mod: nn.Module, recipe: str | Float8Config = "tensorwise") -> Float8Conv1D:
        """A ``Float8Conv1D`` sharing ``mod``'s parameters (no copy); ``mod`` is an HF
        ``Conv1D`` (:func:`is_conv1d`)."""
        if not is_conv1d(mod):
            raise TypeError(
                f"mod must be an HF Conv1D (weight (nx, nf), bias (nf,)), got {type(mod).__name__}"
            )
        w = mod.weight
        assert isinstance(w, nn.Parameter)
        if not w.dtype.is_floating_point:
            raise TypeError(f"mod.weight must be floating point, got dtype {w.dtype}")
        nx, nf = w.shape
        b = mod.bias
        new = cls(int(nx), int(nf), b is not None, recipe, device="meta")
        new.weight = w  # (in, out): HF's layout, name and shape
        if isinstance(b, nn.Parameter):  # built with bias=False when there is none
            new.bias = b
        new._setup(recipe)  # buffers on the parameters' device
        new.train(mod.training)
        new._conv1d_cls = type(mod)
        _carry_hooks(mod, new)
        _carry_extras(mod, new, {"weight", "bias"})
        return new

    def _gemm_weight(self) -> Tensor:
        return self.weight.t()

    def to_conv1d(self) -> nn.Module:
        """The ``Conv1D`` again, sharing this module's parameters (scaling state dropped)."""
        cls = self._conv1d_cls
        if cls is None:
            raise ValueError("Float8Conv1D: not built by from_conv1d, the Conv1D class is unknown")
        with torch.device("meta"):
            new = cls(self.out_features, self.in_features)  # Conv1D(nf, nx)
        new.weight = self.weight
        new.bias = self.bias
        new.train(self.training)
        _carry_hooks(self, new)
        _carry_extras(self, new, {"weight", "bias", *self.scaling_buffers()})
        return new

    def extra_repr(self) -> str:
        return f"nf={self.out_features}, nx={self.in_features}, weight (in, out); " + (
            super().extra_repr()
        )
