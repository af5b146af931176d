"""Validation of loss-scaler configurations and loaded states (``ValueError``/``TypeError``
naming the entry)."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

__all__ = ["check_config", "check_positive", "number"]


def number(name: str, v: Any) -> float:
    """``v`` as a float; ``TypeError`` naming ``name`` for a non-number (bool included)."""
    if isinstance(v, Tensor) and v.numel() == 1 and v.dtype.is_floating_point:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    return float(v)


def check_config(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate a dynamic scaler's configuration (every entry finite, factors and bounds
    consistent); ``ValueError``/``TypeError`` name the entry. Returns it normalised."""

    def name(k: str) -> str:
        return f"{where}[{k!r}]" if where else k

    out: dict[str, Any] = {}
    for k in ("growth_factor", "backoff_factor", "min_scale", "max_scale", "init_scale"):
        if k in cfg:
            out[k] = number(name(k), cfg[k])
            if not math.isfinite(out[k]):
                raise ValueError(f"{name(k)} must be finite, got {out[k]}")
    for k in ("min_scale", "max_scale", "init_scale"):
        if k in out:
            check_positive(name(k), out[k])
    if not out["growth_factor"] > 1.0:
        raise ValueError(
            f"{name('growth_factor')} must be finite and > 1, got {cfg['growth_factor']}"
        )
    if not 0.0 < out["backoff_factor"] < 1.0:
        raise ValueError(f"{name('backoff_factor')} must be in (0, 1), got {cfg['backoff_factor']}")
    gi = cfg["growth_interval"]
    if isinstance(gi, bool) or not isinstance(gi, int):
        raise TypeError(f"{name('growth_interval')} must be an int, got {type(gi).__name__}")
    if gi < 1:
        raise ValueError(f"{name('growth_interval')} must be >= 1, got {gi}")
    out["growth_interval"] = gi
    if out["min_scale"] > out["max_scale"]:
        raise ValueError(
            f"{name('min_scale')} must be <= max_scale, got {out['min_scale']} > {out['max_scale']}"
        )
    if "init_scale" in out:
        if not out["min_scale"] <= out["init_scale"] <= out["max_scale"]:
            raise ValueError(
                f"init_scale must lie in [min_scale, max_scale] = "
                f"[{out['min_scale']}, {out['max_scale']}], got {cfg['init_scale']}"
            )
        del out["init_scale"]
    return out


def check_positive(name: str, v: float) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {v}")
