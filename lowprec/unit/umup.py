"""u-μP (Blake et al. 2024): per-parameter learning rates for a unit-scaled model.

With unit scaling every weight starts at unit variance and every weight gradient has unit
scale, so the μP learning-rate rules become plain fan-in factors of one global ``η``
(AdamW/Adam), for a parameter ``W`` of shape ``(fan_out, fan_in)``:

=============  ====================================  ===================================
role           found as                               learning rate
=============  ====================================  ===================================
``embedding``  ``nn.Embedding.weight``                ``η``
``weight``     hidden ``nn.Linear``/``Conv1d`` weight ``η / √fan_in · depth^-½``
``readout``    the readout ``nn.Linear`` weight,      ``η`` (its forward has ``1/fan_in``)
               an MoE router's weight
``bias``       any bias                               ``η / √fan_in`` (its layer's fan-in)
``norm``       LayerNorm/RMSNorm gains and biases     ``η / √width``
=============  ====================================  ===================================

Why these. An Adam step moves every entry by about its learning rate, so what a rule fixes
is the *relative* step of a tensor whose scale is 1 (all are, at unit-scaled init):

* hidden weight: entries move by ``η/√fan_in``; the output ``x Wᵀ/√fan_in`` then moves by
  up to ``η`` (aligned update, ``fan_in`` terms of ``η/fan_in``): μP's rule, width-stable.
* bias and norm gain/bias: they enter a unit-scale activation directly, so we give them the
  per-entry step of the weights of their layer, ``η/√fan_in`` (a norm: ``η/√width``).
  u-μP itself has no biases and non-parametric norms; at ``η`` they would move ``√fan_in``
  times faster than a weight entry. (Trained against ``η`` and against frozen: see
  ``docs/unit-scaling.md``.)
* embedding: a unit-variance table read out as it is: μP's input-weight rule ``η``
  (constant in width), not u-μP's ``η/√fan_out`` (compared in ``docs/unit-scaling.md``).
* readout: forward ``1/fan_in`` (μP), entries step ``η``: the logits move by up to ``η``.
* tied input/output embedding (one parameter used by the embedding and the readout, as
  GPT-2 and BERT): one group, under its first module's role, ``embedding``. Both roles
  have the same rule here (``η``, decayed), so the tie changes no learning rate.
* a weight stored ``(in, out)`` (HF's ``Conv1D``): its fan-in is ``shape[0]``.
* MoE (:mod:`lowprec.unit.moe`): each expert's slice of a 3-D expert weight is a hidden
  weight of fan-in ``H`` (up projection) or ``I`` (down projection), ``shape[-1]``, or
  ``shape[-2]`` when the module stores them transposed; an expert bias takes its
  weight's fan-in. The router (fan-in ``H``, fan-out ``E`` fixed) is output-like: the
  readout's rule, with its forward ``1/fan_in``.

``depth`` (optional, the number of residual layers): depth-μP's ``1/√depth`` on hidden
weights, paired with the residual rule of :func:`umup_taus`: the embedding carries weight
1 and each of the ``n`` residual branches ``mult²/n`` of the stream, so a branch's share
shrinks as ``1/n`` when the model deepens. The hyperparameter ``mult``\\ s (``act_mult``,
``softmax_mult``, ``output_mult`` of :class:`lowprec.unit.UnitConfig`, and
``residual_mult`` here) are the only other knobs; at 1 they are near-optimal, so
**sweeping only η** is enough, and the best η does not move with width (checked by
``tests/unit/test_umup.py`` and ``benchmarks/bench_umup_sweep.py``; results in
``benchmarks/README.md``). SGD gets the same factors: with unit-scaled gradients an SGD
step has the size of an Adam step at initialisation (the readout's input gradient is
unconstrained, ``1/√vocab``, for this: :func:`lowprec.unit.functional.linear_readout`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from torch import Tensor, nn

from lowprec.unit.core import check_number
from lowprec.unit.functional import residual_taus

__all__ = ["ROLES", "Role", "tag_params", "umup_param_groups", "umup_taus"]

Role = Literal["embedding", "weight", "readout", "bias", "norm"]
ROLES: tuple[Role, ...] = ("embedding", "weight", "readout", "bias", "norm")
_OPTIMIZERS = ("adamw", "adam", "sgd")


def umup_taus(n: int, residual_mult: float = 1.0) -> list[float]:
    """``τ_l`` of ``n`` residual branches under u-μP's depth rule (embedding weight 1, each
    branch ``residual_mult²/n``: ``τ_l = w/(1 + (l+1)w)``).

    Example:
        >>> [round(t, 3) for t in umup_taus(4)]
        [0.2, 0.167, 0.143, 0.125]
    """
    residual_mult = check_number("residual_mult", residual_mult, 0.0, open_low=True)
    return residual_taus(n, "weighted", weight=residual_mult**2 / max(n, 1))


def _fan_in(module: nn.Module, p: Tensor) -> int:
    """Fan-in of a weight: ``numel / shape[0]``, or ``shape[0]`` for a weight stored
    ``(in, out)`` (HF's ``Conv1D``, converted by :func:`lowprec.unit.unit_scale`)."""
    if getattr(module, "_unit_weight_in_dim", None) == 0:
        return int(p.shape[0])
    if getattr(type(module), "_unit_form", "") == "experts" and p.dim() == 3:
        return int(p.shape[-2] if getattr(module, "is_transposed", False) else p.shape[-1])
    return p.numel() // p.shape[0]


def _bias_fan_in(module: nn.Module, p: Tensor) -> int:
    """Fan-in of the layer a bias belongs to (its module's ≥2-D ``weight``), else its size."""
    w = getattr(module, "weight", None)
    if getattr(type(module), "_unit_form", "") == "experts":
        w = next((q for n, q in module.named_parameters(recurse=False)
                  if q is not p and n.endswith("_proj") and q.dim() == 3
                  and getattr(module, n + "_bias", None) is p), None)  # fmt: skip
    return _fan_in(module, w) if isinstance(w, Tensor) and w.dim() >= 2 else p.numel()


def _expert_bias(module: nn.Module, pname: str) -> bool:
    """An MoE expert bias, ``<weight>_bias`` ``(E, out)`` (:mod:`lowprec.unit.moe`)."""
    return getattr(type(module), "_unit_form", "") == "experts" and pname.endswith("_bias")


def _readout_name(model: nn.Module) -> str | None:
    report = getattr(model, "unit_report", None)
    if isinstance(report, dict) and "readout" in report:
        return report["readout"]  # type: ignore[no-any-return]
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return names[-1] if names else None


def tag_params(model: nn.Module) -> dict[str, Role]:
    """The u-μP role of each trainable parameter, by name (see the module table).

    Parameters of other module types count as ``"weight"`` if 2-D or more, else ``"bias"``.

    Example:
        >>> tag_params(nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 10)))
        {'0.weight': 'embedding', '1.weight': 'norm', '1.bias': 'norm', '2.weight': 'readout', '2.bias': 'bias'}
    """  # noqa: E501
    head = _readout_name(model)
    roles: dict[str, Role] = {}
    seen: set[int] = set()
    for mname, m in model.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue  # a tied weight: one parameter, one role, its first module's
            seen.add(id(p))
            full = f"{mname}.{pname}" if mname else pname
            role: Role
            if isinstance(m, nn.Embedding):
                role = "embedding"
            elif (
                isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or getattr(m, "_unit_role", "") == "norm"
            ):
                role = "norm"
            elif pname == "bias" or p.dim() < 2 or _expert_bias(m, pname):
                role = "bias"
            elif (mname == head and isinstance(m, nn.Linear)) or getattr(
                type(m), "_unit_form", ""
            ) == "router":
                role = "readout"
            else:
                role = "weight"
            roles[full] = role
    return roles


def umup_param_groups(
    model: nn.Module,
    lr: float,
    *,
    optimizer: str = "adamw",
    depth: int | None = None,
    weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """Parameter groups with u-μP learning rates for global ``lr`` (``η``).

    Every group has ``"params"``, ``"lr"`` (absolute), ``"lr_mult"`` (``lr / η``) and
    ``"weight_decay"`` (``weight_decay`` for weights, readout and embedding; 0 for biases
    and norms); parameters with the same settings share a group. A loop that schedules
    ``η`` sets ``group["lr"] = η_now * group["lr_mult"]``.

    Example:
        >>> gs = umup_param_groups(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)), 1.0)
        >>> [(round(g["lr_mult"], 3), len(g["params"])) for g in gs]
        [(0.25, 3), (1.0, 1)]
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(_OPTIMIZERS)}, got {optimizer!r}")
    if isinstance(lr, bool) or not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive float, got {lr!r}")
    weight_decay = check_number("weight_decay", weight_decay, 0.0)
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ValueError(f"depth must be a positive int or None, got {depth!r}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    roles = tag_params(model)
    owner: dict[str, nn.Module] = {}
    for mn, m in model.named_modules():
        for pn, _ in m.named_parameters(recurse=False):
            owner.setdefault(f"{mn}.{pn}" if mn else pn, m)
    params = {n: p for mn, m in model.named_modules()
              for pn, p in m.named_parameters(recurse=False)
              for n in [f"{mn}.{pn}" if mn else pn]}  # fmt: skip
    groups: dict[tuple[float, float], dict[str, Any]] = {}
    for name, role in roles.items():
        p = params[name]
        if role == "weight":
            mult = _fan_in(owner[name], p) ** -0.5 * (1.0 if depth is None else depth**-0.5)
        elif role == "bias":
            mult = _bias_fan_in(owner[name], p) ** -0.5
        elif role == "norm":
            mult = p.numel() ** -0.5
        else:  # embedding, readout
            mult = 1.0
        wd = weight_decay if role in ("embedding", "weight", "readout") else 0.0
        g = groups.setdefault(
            (mult, wd), {"params": [], "lr": lr * mult, "lr_mult": mult, "weight_decay": wd}
        )
        g["params"].append(p)
    return list(groups.values())
