"""Calibration of the static roles of ``Float8Linear`` layers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from lowprec.core.scalers import StaticScaler
from lowprec.float8.config import ROLES
from lowprec.float8.linear import Float8Linear

__all__ = ["calibrate", "calibrated_scalers"]


@contextlib.contextmanager
def calibrate(model: nn.Module, fresh: bool = True, training_only: bool = False) -> Iterator[None]:
    """Calibrate the static roles of every ``Float8Linear`` in ``model``.

    Inside the block, forward (and backward, for a static ``grad_output``) passes record
    the running maximum of each static role's ``amax``; on exit the scales freeze. Roles
    that saw no data raise ``ValueError`` naming them. ``fresh=False`` continues from the
    maxima the scalers hold (a calibration whose end was undone) instead of from zero.
    ``training_only=True`` records only the passes of modules in training mode (a
    calibration on training batches, between which an evaluation must not count);
    by default every pass inside the block records, ``model.eval()`` ones included.

    Example:
        >>> import torch
        >>> m = Float8Linear.from_linear(torch.nn.Linear(16, 16), "static")
        >>> with calibrate(m):
        ...     m(torch.randn(4, 16)).sum().backward()
        >>> float(m.input_static_amax) > 0
        True
    """
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    static = [m for m in layers if any(m.recipe.cast(r).scaling == "static" for r in ROLES)]
    if not static:
        raise ValueError("model: no Float8Linear with a static role to calibrate")
    if any(m.weight.device.type == "meta" for m in static):
        raise ValueError("model: a Float8Linear on the meta device has no data to calibrate")
    if not isinstance(fresh, bool):
        raise TypeError(f"fresh must be a bool, got {type(fresh).__name__}")
    if not isinstance(training_only, bool):
        raise TypeError(f"training_only must be a bool, got {type(training_only).__name__}")
    for m in static:  # a new calibration starts from scratch (it may lower a scale)
        m._calibrating = True
        m._calibrate_eval = not training_only
        for s in m.calibrated_scalers() if fresh else ():
            s.reset()
    try:
        yield
    finally:
        for m in static:
            m._calibrating = False
            m._calibrate_eval = True
    names = {id(m): n for n, m in model.named_modules()}
    empty = [
        f"{names[id(m)] or 'model'}.{r}"
        for m in static
        for r in ROLES
        if (t := m.scaling_state().get(f"{r}_static_amax")) is not None and not bool(t > 0)
    ]
    if empty:
        raise ValueError(
            f"calibrate: no data reached {empty}; run forward and backward (for grad_output) "
            "inside the calibrate block"
        )
    for m in static:
        for s in m.calibrated_scalers():
            s.freeze()


def calibrated_scalers(model: nn.Module) -> list[StaticScaler]:
    """The scalers that :func:`calibrate` calibrates: every static role without a given
    scale, of every ``Float8Linear`` in ``model``."""
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    return [s for m in layers for s in m.calibrated_scalers()]
