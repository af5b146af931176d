"""Checkpoints of a training run and resuming from them.

A checkpoint holds the run's state (model, optimizer, scaler, recipe state), the step and
the RNG states; it is never written while any of that holds Inf/NaN, so the last good one
survives a diverging run. Resuming restores it and cuts the run's logs back to its step, so
that the continued run appends exactly the steps it redoes. Process-group runs go through
:mod:`lowprec.jobs.parallel` (a DCP checkpoint written by every rank).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from lowprec.autopilot.guard import Guard, Move
from lowprec.distributed import env
from lowprec.jobs import parallel as par
from lowprec.jobs import rundir
from lowprec.jobs.rundir import (
    CHECKPOINT,
    GUARD,
    NonFiniteError,
    RunError,
    load_checkpoint,
    read_jsonl,
    save_checkpoint,
)
from lowprec.recipes import Prepared

__all__ = ["cut_logs", "fingerprint", "nonfinite_state", "restore", "save", "unrestored"]

log = logging.getLogger(__name__)


def _rng_state() -> dict[str, Any]:
    """The process's torch and Python RNG states (saved with each checkpoint)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def _leaves(state: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` of a nested state of dicts, lists and tuples, in order; a path
    joins the keys and indices with dots (``"optimizer.state.3.exp_avg"``)."""
    if isinstance(state, dict):
        items: Iterable[tuple[Any, Any]] = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        yield path, state
        return
    for k, v in items:
        yield from _leaves(v, f"{path}.{k}" if path else str(k))


def fingerprint(state: Any, path: str = "") -> dict[str, str]:
    """A digest of every leaf of a nested state (dicts, lists, tensors, Python values),
    keyed by its path (``"optimizer.state.3.exp_avg"``): a tensor's by its dtype, shape and
    bytes (BLAKE2b of its contiguous copy), any other value by its ``repr``. Two states
    are bit-identical exactly when their fingerprints are equal (up to hash collisions)."""
    out: dict[str, str] = {}
    for name, leaf in _leaves(state, path):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=16)
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            out[name] = h.hexdigest()
        else:
            out[name] = repr(leaf)
    return out


def unrestored(saved: dict[str, str], live: dict[str, str]) -> list[str]:
    """The paths whose fingerprints differ between a saved state and the live one after
    restoring it (in ``saved``'s order; a path present on one side only counts)."""
    return [k for k in saved if live.get(k) != saved[k]] + [k for k in live if k not in saved]


def nonfinite_state(prepared: Prepared) -> str | None:
    """The name of the first parameter or optimizer-state tensor holding Inf/NaN, if any."""
    named = [*prepared.model.named_parameters(),
             *_leaves(prepared.optimizer.state_dict(), "optimizer")]  # fmt: skip
    for name, t in named:
        if (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and not bool(torch.isfinite(t.detach()).all())
        ):
            return name
    if not math.isfinite(prepared.scaler.loss_scale):
        return "loss scale"
    return None


def save(
    out: Path,
    prepared: Prepared,
    step: int,
    parallel: str | None = None,
    guard: Guard | None = None,
) -> None:
    """Checkpoint at ``step``; refuses (:class:`NonFiniteError`) to write Inf/NaN state, so
    the last good checkpoint is never overwritten with it. ``parallel``: a DCP checkpoint
    written by every rank (:mod:`lowprec.jobs.parallel`). ``guard``: its state too."""
    bad = nonfinite_state(prepared)
    if bad is not None:
        raise NonFiniteError(
            f"step {step}: {bad} holds Inf/NaN; no checkpoint written (the last one is kept)",
            step,
        )
    if parallel is not None:
        par.save_checkpoint(out, prepared, step, parallel)
        return
    run = prepared.state_dict()
    state = {"step": step, "run": run, "rng": _rng_state(), "fingerprint": fingerprint(run)}
    if guard is not None:
        state["guard"] = guard.state_dict()
    save_checkpoint(out, state)


def restore(
    out: Path, prepared: Prepared, parallel: str | None = None, guard: Guard | None = None
) -> int:
    """Restore the checkpoint of ``out`` (none yet: step 0) and cut the logs back to it
    (atomic rewrites); the step to continue from. ``guard``: the moves it recorded up to the
    checkpoint's step (``guard.jsonl``) are replayed on the model first, so that the
    checkpoint's state fits it, then the guard's own state is restored."""
    if parallel is not None:
        start = 0
        if env.on_main(lambda: par.has_checkpoint(out), RunError):
            start = par.load_checkpoint(out, prepared, parallel)
        env.on_main(lambda: cut_logs(out, start), RunError)
        return start
    start = 0
    if (out / CHECKPOINT).exists():
        state = load_checkpoint(out)
        try:
            if guard is not None:
                moves = [Move.from_dict(r) for r in read_jsonl(out / GUARD)]
                guard.replay([m for m in moves if m.step <= int(state["step"])])
            prepared.load_state_dict(state["run"])
            if guard is not None:
                guard.load_state_dict(state.get("guard", {}))
        except (ValueError, KeyError, RuntimeError, TypeError) as e:
            raise RunError(
                f"--resume: checkpoint {out / CHECKPOINT} does not fit ({_first_lines(e)})"
            ) from None
        saved = state.get("fingerprint")  # (checkpoints before it have none)
        if isinstance(saved, dict):
            bad = unrestored(saved, fingerprint(prepared.state_dict()))
            if bad:  # never expected: a load that changes what it loads
                log.warning(
                    "lowprec train --resume: the restored state differs from the checkpoint's "
                    "in %d entries (first: %s); the run continues, not bit-exactly",
                    len(bad),
                    bad[0],
                )
        _set_rng_state(state["rng"])
        start = int(state["step"])
    cut_logs(out, start)
    return start


def cut_logs(out: Path, start: int) -> None:
    """Cut the logs of ``out`` back to the checkpoint's step ``start``
    (:func:`lowprec.jobs.rundir.cut_logs`: checked first, then atomic rewrites);
    :class:`RunError` unless the metrics hold steps ``1..start`` once each."""
    rundir.cut_logs(out, start, "--resume", every_step=True)


def _first_lines(e: BaseException, keep: int = 3) -> str:
    """``e``'s message on one line: torch lists every mismatched tensor of a state dict,
    one per line (kilobytes for a model of another size); the first ``keep`` lines and
    how many more."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    more = f" … and {len(lines) - keep} more" if len(lines) > keep else ""
    return " ".join(lines[:keep]) + more
