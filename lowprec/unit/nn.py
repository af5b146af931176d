"""Unit-scaled modules built on :mod:`lowprec.unit.functional`, unit-variance init.

``Linear``, ``LinearReadout``, ``Embedding``, ``LayerNorm``, ``RMSNorm`` subclass their
``torch.nn`` namesakes (same parameters and ``state_dict``; weights ``N(0, 1)``, biases 0,
gains 1); ``MLP`` (GELU or SwiGLU), ``MultiHeadAttention``, ``TransformerLayer`` (pre-norm,
residual τ), ``TransformerDecoder`` (a causal LM: ``forward(idx, targets=None) ->
(logits, loss)`` as :class:`lowprec.jobs.model.CharGPT`) and ``CrossEntropyLoss``.

Example:
    >>> import torch
    >>> m = TransformerDecoder(vocab_size=11, width=32, depth=2, heads=2, seq_len=8)
    >>> idx = torch.randint(0, 11, (2, 8))
    >>> logits, loss = m(idx, idx)
    >>> logits.shape, round(loss.item()) == 2  # ln(11) = 2.4 at init
    (torch.Size([2, 8, 11]), True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lowprec.unit import functional as U
from lowprec.unit.core import check_constraint, check_flag, check_number, scale_bwd
from lowprec.unit.umup import umup_taus

__all__ = [
    "GELU", "MLP", "Conv1d", "CrossEntropyLoss", "Dropout", "Embedding", "LayerNorm",
    "Linear", "LinearReadout", "MultiHeadAttention", "RMSNorm", "SiLU", "Softmax",
    "TransformerDecoder", "TransformerLayer",
]  # fmt: skip


def _size(name: str, v: object, low: int = 1) -> int:
    """``v`` as an int ``>= low``; ``TypeError`` / ``ValueError`` naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < low:
        raise ValueError(f"{name} must be >= {low}, got {v}")
    return v


def _shape(v: object) -> None:
    dims = (v,) if isinstance(v, int) else v
    if not isinstance(dims, (tuple, list, torch.Size)):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {v!r}")
    for d in dims:
        _size("normalized_shape", d, 0)


class Linear(nn.Linear):
    """:func:`~lowprec.unit.functional.linear`; weight ``N(0, 1)``, bias 0."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        constraint: str | None = "to_output_scale",
        float8: bool = False,
    ) -> None:
        check_constraint(constraint)
        self.constraint, self.float8 = constraint, check_flag("float8", float8)
        _size("in_features", in_features, 0)
        _size("out_features", out_features, 0)
        super().__init__(in_features, out_features, bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return U.linear(x, self.weight, self.bias, constraint=self.constraint, float8=self.float8)


class LinearReadout(Linear):
    """:func:`~lowprec.unit.functional.linear_readout` (forward ``1/fan_in``; input
    gradient ``1/√fan_out``, unconstrained, by default)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        constraint: str | None = None,
        float8: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias, constraint, float8)

    def forward(self, x: Tensor) -> Tensor:
        return U.linear_readout(
            x, self.weight, self.bias, constraint=self.constraint, float8=self.float8
        )


class Embedding(nn.Embedding):
    """:func:`~lowprec.unit.functional.embedding` with every ``nn.Embedding`` argument
    (``padding_idx``, ``max_norm``, ``norm_type``, ``scale_grad_by_freq``, ``sparse``);
    weight ``N(0, 1)`` (nn.Embedding's; the padding row zero)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *args: Any, **kw: Any) -> None:
        _size("num_embeddings", num_embeddings, 0)
        _size("embedding_dim", embedding_dim, 0)
        super().__init__(num_embeddings, embedding_dim, *args, **kw)

    def forward(self, idx: Tensor) -> Tensor:
        return U.embedding(
            idx,
            self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.sparse,
        )


class LayerNorm(nn.LayerNorm):
    """:func:`~lowprec.unit.functional.layer_norm` (gain 1, bias 0)."""

    def __init__(self, normalized_shape: Any, *args: Any, **kw: Any) -> None:
        _shape(normalized_shape)
        super().__init__(normalized_shape, *args, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return U.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """:func:`~lowprec.unit.functional.rms_norm` (gain 1)."""

    def __init__(self, normalized_shape: Any, *args: Any, **kw: Any) -> None:
        _shape(normalized_shape)
        super().__init__(normalized_shape, *args, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return U.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class GELU(nn.GELU):
    """:func:`~lowprec.unit.functional.gelu` with ``mult`` and ``constraint``."""

    def __init__(
        self, approximate: str = "none", mult: float = 1.0, constraint: str | None = "gmean"
    ) -> None:
        super().__init__(approximate)
        check_constraint(constraint)
        self.mult, self.constraint = check_number("mult", mult), constraint

    def forward(self, x: Tensor) -> Tensor:
        return U.gelu(x, self.approximate, mult=self.mult, constraint=self.constraint)


class SiLU(nn.SiLU):
    """:func:`~lowprec.unit.functional.silu` with ``mult`` and ``constraint``."""

    def __init__(
        self, mult: float = 1.0, constraint: str | None = "gmean", inplace: bool = False
    ) -> None:
        if inplace:
            raise ValueError("inplace=True is not supported by the unit-scaled SiLU")
        super().__init__()
        check_constraint(constraint)
        self.mult, self.constraint = check_number("mult", mult), constraint

    def forward(self, x: Tensor) -> Tensor:
        return U.silu(x, mult=self.mult, constraint=self.constraint)


class Softmax(nn.Softmax):
    """:func:`~lowprec.unit.functional.softmax` along ``dim`` with ``mult``, ``constraint``."""

    def __init__(
        self, dim: int = -1, mult: float = 1.0, constraint: str | None = "to_output_scale"
    ) -> None:
        super().__init__(dim)
        check_constraint(constraint)
        self.mult, self.constraint = check_number("mult", mult), constraint

    def forward(self, x: Tensor) -> Tensor:
        dim = -1 if self.dim is None else self.dim
        return U.softmax(x, dim, mult=self.mult, constraint=self.constraint)


class Dropout(nn.Dropout):
    """:func:`~lowprec.unit.functional.dropout` (``inplace=True``: ``ValueError``)."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        if inplace:
            raise ValueError("inplace=True is not supported by the unit-scaled Dropout")
        super().__init__(p)

    def forward(self, x: Tensor) -> Tensor:
        return U.dropout(x, self.p, self.training)


class Conv1d(nn.Conv1d):
    """:func:`~lowprec.unit.functional.conv1d` (zero padding only); weight ``N(0, 1)``,
    bias 0."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
        padding: int | str = 0, dilation: int = 1, groups: int = 1, bias: bool = True,
        padding_mode: str = "zeros", constraint: str | None = "to_output_scale",
    ) -> None:  # fmt: skip
        if padding_mode != "zeros":
            raise ValueError(f"padding_mode must be 'zeros', got {padding_mode!r}")
        check_constraint(constraint)
        self.constraint = constraint
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias)  # fmt: skip

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        pad = self.padding if isinstance(self.padding, str) else int(self.padding[0])
        return U.conv1d(x, self.weight, self.bias, int(self.stride[0]), pad,
                        int(self.dilation[0]), self.groups, constraint=self.constraint)  # fmt: skip


class MLP(nn.Module):
    """``down(act(up(x)))`` with ``act`` GELU, or SwiGLU ``down(up(x)·silu(gate(x)))``:
    unit output, input gradient and weight gradients at init (the linears unconstrained;
    with SwiGLU the input's two gradients summed at ``1/√2``)."""

    def __init__(self, width: int, hidden: int | None = None, kind: str = "gelu",
                 float8: bool = False) -> None:  # fmt: skip
        super().__init__()
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"kind must be 'gelu' or 'swiglu', got {kind!r}")
        width = _size("width", width)
        hidden = 4 * width if hidden is None else _size("hidden", hidden)
        self.kind = kind
        # constraint=None: up (and gate) and down mirror each other's fan-in and fan-out,
        # so each keeps its ideal scales; tied to the output scale, down's input gradient
        # would be 1/√(hidden/width) too small and so would up's weight gradient.
        self.up = Linear(width, hidden, constraint=None, float8=float8)
        self.gate = (
            Linear(width, hidden, constraint=None, float8=float8) if kind == "swiglu" else None
        )
        self.down = Linear(hidden, width, constraint=None, float8=float8)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is None:
            h = U.gelu(self.up(x))
        else:  # x feeds two layers: its gradient sums two unit ones, scaled back by 1/√2
            x = scale_bwd(x, 2**-0.5)
            h = U.silu_glu(self.up(x), self.gate(x))
        return self.down(h)  # type: ignore[no-any-return]


class MultiHeadAttention(nn.Module):
    """Self-attention: ``qkv`` projection, unit SDPA (causal or not), output projection."""

    def __init__(self, width: int, heads: int, causal: bool = True, float8: bool = False,
                 dropout_p: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        _size("width", width)
        _size("heads", heads)
        if width % heads:
            raise ValueError(f"width ({width}) must be divisible by heads ({heads})")
        if not 0.0 <= check_number("dropout_p", dropout_p) < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
        self.heads, self.causal, self.dropout_p = heads, causal, float(dropout_p)
        self.qkv = Linear(width, 3 * width, float8=float8)
        self.proj = Linear(width, width, float8=float8)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3:
            raise ValueError(f"x: need (batch, seq, width), got shape {tuple(x.shape)}")
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for z in self.qkv(x).split(c, dim=-1)
        )
        p = self.dropout_p if self.training else 0.0  # attention dropout, unit-scaled
        y = U.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # type: ignore[no-any-return]


class TransformerLayer(nn.Module):
    """Pre-norm layer: ``x ← residual_add(attn(ln(x)), x, τ_a)``, then the MLP with ``τ_m``."""

    def __init__(self, width: int, heads: int, tau: tuple[float, float] = (0.5, 0.5),
                 mlp: str = "gelu", causal: bool = True, float8: bool = False,
                 dropout_p: float = 0.0) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(tau, (tuple, list)) or len(tau) != 2:
            raise TypeError(f"tau must be a pair of floats in (0, 1), got {tau!r}")
        for t in tau:
            if not 0.0 < check_number("tau", t) < 1.0:
                raise ValueError(f"tau must be a pair of floats in (0, 1), got {tau!r}")
        self.tau = (float(tau[0]), float(tau[1]))
        self.ln1, self.ln2 = LayerNorm(width), LayerNorm(width)
        self.attn = MultiHeadAttention(width, heads, causal, float8, dropout_p)
        self.mlp = MLP(width, kind=mlp, float8=float8)

    def forward(self, x: Tensor) -> Tensor:
        r, s = U.residual_split(x, self.tau[0])
        x = U.residual_add(self.attn(self.ln1(r)), s, self.tau[0])
        r, s = U.residual_split(x, self.tau[1])
        return U.residual_add(self.mlp(self.ln2(r)), s, self.tau[1])


class CrossEntropyLoss(nn.Module):
    """:func:`~lowprec.unit.functional.cross_entropy` (true loss forward, unit backward)."""

    def __init__(
        self,
        weight: Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.reduction, self.ignore_index = reduction, ignore_index
        self.label_smoothing = check_number("label_smoothing", label_smoothing)
        self.register_buffer("weight", weight)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        w = self.weight if isinstance(self.weight, Tensor) else None
        return U.cross_entropy(
            logits, targets, self.reduction, self.ignore_index, w, self.label_smoothing
        )


class TransformerDecoder(nn.Module):
    """Causal LM: token + position embeddings (unit ``add``), ``depth`` layers with u-μP's
    residual τ, final LayerNorm, readout; ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, vocab_size: int, width: int, depth: int, heads: int, seq_len: int,
                 mlp: str = "gelu", float8: bool = False) -> None:  # fmt: skip
        super().__init__()
        _size("vocab_size", vocab_size)
        _size("depth", depth, 0)
        self.seq_len = _size("seq_len", seq_len)
        self.tok, self.pos = Embedding(vocab_size, width), Embedding(seq_len, width)
        taus = umup_taus(2 * depth)
        self.layers = nn.ModuleList(
            TransformerLayer(width, heads, (taus[2 * i], taus[2 * i + 1]), mlp, True, float8)
            for i in range(depth)
        )
        self.ln_f = LayerNorm(width)
        self.head = LinearReadout(width, vocab_size, bias=False, float8=float8)
        self.loss = CrossEntropyLoss()

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"idx: sequence length {t} exceeds seq_len {self.seq_len}")
        x = U.add(self.tok(idx), self.pos(torch.arange(t, device=idx.device)))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else self.loss(logits.flatten(0, -2), targets.flatten())
        return logits, loss
