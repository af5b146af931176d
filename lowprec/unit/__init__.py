"""Unit scaling and u-μP (Blake et al., ICML 2023; Blake et al. 2024).

A unit-scaled model multiplies each op's output and each input gradient by fixed factors
so that, at initialisation, activations, activation gradients and weight gradients all
have ~unit variance: they sit in the middle of FP8/FP16's range without loss scaling or
per-tensor scales. u-μP adds learning-rate rules that make the optimal global learning
rate independent of width (and depth).

* :mod:`~lowprec.unit.core`: ``scale_fwd``, ``scale_bwd``, ``apply_constraint``.
* :mod:`~lowprec.unit.functional`: unit-scaled ops (``linear``, ``matmul``, ``softmax``,
  ``cross_entropy``, ``scaled_dot_product_attention``, ``residual_split/add``, ...).
* :mod:`~lowprec.unit.nn`: modules (``Linear``, ``MLP``, ``TransformerDecoder``, ...).
* :func:`apply` ``(model, config_or_preset)``: the technique's one entry point, a
  unit-scaled u-μP copy of a standard model, yours or an HF transformers one;
  ``config_or_preset`` is a :class:`UnitConfig` or a name of :data:`PRESETS`. Weights are
  re-initialised to unit variance (``reinit=False`` keeps them).
* :func:`unit_scale`: the transform under :func:`apply` (module conversion by probe,
  unit-variance re-init, residual adds found with ``torch.fx`` or by running the model
  once, op conversion with a torch function mode), kept for its selectable residual τ
  scheme; :func:`recipe_param_groups`: u-μP groups for a standard ``lr`` (the recipes call
  :func:`apply` and it).
* :mod:`~lowprec.unit.umup`: ``umup_param_groups`` and the residual τ rule.

Example:
    >>> import torch
    >>> from lowprec.jobs.model import CharGPT, ModelConfig
    >>> from lowprec.unit import apply, umup_param_groups
    >>> _ = torch.manual_seed(0)
    >>> cfg = ModelConfig(vocab_size=16, width=32, depth=1, heads=2)
    >>> model = apply(CharGPT(cfg))          # weights re-initialised to unit variance
    >>> opt = torch.optim.AdamW(umup_param_groups(model, lr=1.0))
    >>> idx = torch.randint(0, 16, (4, 64))
    >>> logits, loss = model(idx, idx)        # the true mean cross-entropy
    >>> loss.backward(); opt.step()
    >>> round(loss.item(), 1)                 # ln(16) = 2.77: near-uniform logits at init
    2.8
"""

from lowprec.unit.config import UnitConfig
from lowprec.unit.core import CONSTRAINTS, Constraint, apply_constraint, scale_bwd, scale_fwd
from lowprec.unit.entry import PRESETS, apply, recipe_param_groups
from lowprec.unit.lookup import unit_loss_computed
from lowprec.unit.transform import unit_scale
from lowprec.unit.umup import tag_params, umup_param_groups, umup_taus

__all__ = [
    "CONSTRAINTS",
    "PRESETS",
    "Constraint",
    "UnitConfig",
    "apply",
    "apply_constraint",
    "recipe_param_groups",
    "scale_bwd",
    "scale_fwd",
    "tag_params",
    "umup_param_groups",
    "umup_taus",
    "unit_loss_computed",
    "unit_scale",
]
