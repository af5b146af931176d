"""Unit-scaled ops: same maths as ``torch.nn.functional`` up to fixed forward factors, with
fixed backward factors, chosen so outputs and gradients are ~unit variance at init.

Each op reads: compute ideal scales → apply the constraint (``lowprec.unit.core``) →
``scale_bwd`` the inputs → the standard op → ``scale_fwd`` the output. "Ideal" scales
assume unit-normal, independent inputs and a unit-normal incoming gradient ``g``; ``B``
below is the number of rows a weight gradient sums over (all leading dims).

Inputs: tensors must be real floating point (``TypeError`` naming the argument for an
integer, bool or complex one; indices are integer), numbers finite (``ValueError``). A
zero-size dimension gives torch's (empty or all-zero) result: each count in a scale is
taken as at least 1, so no scale divides by zero. Activation and softmax constants are
moments under ``X ~ N(0, 1)`` (:mod:`lowprec.unit.moments`).

Where a scale would cost a pass of its own, it is folded (:mod:`lowprec.unit.folded`):
:func:`linear` puts its scales in the GEMMs' ``alpha`` (and the bias in ``beta``),
:func:`softmax` keeps only its scaled output for a backward of its own; the maths is the
composition above.

The ops live in modules of their own and are re-exported here: the products (``matmul``,
``probs_matmul``, ``linear``, ``linear_readout``, ``conv1d``) in
:mod:`lowprec.unit.products`, the sums (``add``, the residual ops, ``residual_taus``) in
:mod:`lowprec.unit.adds`, the activations, softmaxes and norms in
:mod:`lowprec.unit.activations`, attention and dropout in :mod:`lowprec.unit.attention`,
embedding and the losses (cross-entropy, mean squared error) in :mod:`lowprec.unit.lookup`,
``scale_elementwise`` in :mod:`lowprec.unit.core`.

Example:
    >>> import torch
    >>> from lowprec.unit import functional as U
    >>> x, w = torch.randn(4096, 256), torch.randn(512, 256)
    >>> round(U.linear(x, w).std().item(), 1)
    1.0
"""

from __future__ import annotations

from lowprec.unit.activations import (
    gelu,
    layer_norm,
    log_softmax,
    relu,
    rms_norm,
    silu,
    silu_glu,
    softmax,
)
from lowprec.unit.adds import add, residual_add, residual_apply, residual_split, residual_taus
from lowprec.unit.attention import dropout, scaled_dot_product_attention
from lowprec.unit.core import scale_elementwise
from lowprec.unit.lookup import cross_entropy, embedding, mse_loss
from lowprec.unit.moments import gauss_moment
from lowprec.unit.products import Matmul as Matmul
from lowprec.unit.products import conv1d, linear, linear_readout, matmul, probs_matmul

__all__ = [
    "add", "conv1d", "cross_entropy", "dropout", "embedding", "gauss_moment", "gelu",
    "layer_norm", "linear", "linear_readout", "log_softmax", "matmul", "mse_loss",
    "probs_matmul", "relu", "residual_add", "residual_apply", "residual_split",
    "residual_taus", "rms_norm", "scale_elementwise", "scaled_dot_product_attention",
    "silu", "silu_glu", "softmax",
]  # fmt: skip
