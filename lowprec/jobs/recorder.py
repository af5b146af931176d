"""Record a run directory from your own training loop, for ``lowprec report``.

:class:`RunRecorder` writes the files of a run directory (:mod:`lowprec.jobs.rundir`) as
``lowprec train`` does: ``config.json`` at the start, one ``metrics.jsonl`` line per
:meth:`RunRecorder.log` (appended whole, :func:`~lowprec.jobs.rundir.append_jsonl`), the
numerics of the model (:mod:`lowprec.analysis.tracking`) in ``numerics.jsonl``, and
``summary.json`` when the block ends without an exception (atomic writes,
:func:`~lowprec.jobs.rundir.write_atomic`)::

    with RunRecorder("runs/mine", model, recipe="bf16", steps=100) as rec:
        for step in range(100):
            loss = ...  # forward, backward, optimizer step
            rec.log(step + 1, loss=loss, lr=sched.get_last_lr()[0])

What each metrics record holds (``step`` = the number of steps done, 1-based, as in
``lowprec train``):

* ``loss`` (a float or a 0-dim tensor) and any other keyword given (numbers, bools,
  strings; tensors become numbers), e.g. ``val_loss``, which the report plots;
* ``skipped`` and ``loss_scale``: given, or read from ``scaler`` (a lowprec loss scaler:
  the steps it recorded since the last ``log``, any skipped, and the scale they used;
  ``torch.amp.GradScaler``: ``get_scale()``), else False and 1;
* ``grad_zero_share``: the share of exact zeros among the model's gradient values
  accumulated since the last ``log`` (post-accumulate hooks; 0 when no backward ran);
* ``step_time``: seconds since the previous ``log`` (or the start), unless given.

Numerics: the first training-mode forward and backward of the model after the start and
after each ``log(k)`` are recorded as step index ``k`` (0-based: the step being done)
when ``k`` is a multiple of ``numerics_every`` or ``k == steps - 1``: the report shows the
first and the last tracked step. Forward passes in eval mode are never recorded.

An existing non-empty directory is refused (:class:`~lowprec.jobs.rundir.RunError`) unless
``resume=True``: then its ``config.json`` must exist, and the run continues after the last
logged step, or after step ``resume_from`` (the step of the checkpoint your loop restarts
from): the records after it are dropped from both files (atomic rewrites).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from lowprec.analysis.tracking import Tracker
from lowprec.core.tensor import ScaledTensor
from lowprec.jobs.rundir import (
    CONFIG,
    METRICS,
    NUMERICS,
    SUMMARY,
    append_jsonl,
    make_new_dir,
    read_config,
    read_metrics,
    summarize,
    truncate_jsonl,
    write_atomic,
)
from lowprec.recipes import Recipe
from lowprec.recipes.presets import get_recipe, recipe_names

__all__ = ["RunRecorder"]

# The formats whose ranges the numerics measure: lowprec train's (jobs.train.TRACK_FORMATS).
DEFAULT_FORMATS = ("fp16", "bf16", "e4m3fn", "e5m2")
_RESERVED = {"step"}


def _value(key: str, v: Any) -> Any:
    """``v`` as a JSON value of a metrics record (a one-element tensor as a number)."""
    if isinstance(v, Tensor):
        if v.numel() != 1:
            raise ValueError(f"{key}: expected a number or a one-element tensor, got shape "
                             f"{tuple(v.shape)}")  # fmt: skip
        v = v.detach().item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"{key}: expected a number, bool, str or one-element tensor, got "
                    f"{type(v).__name__}")  # fmt: skip


class RunRecorder:
    """Record a run directory from any training loop (see the module docstring).

    Args:
        out: the run directory (created; must not exist or be empty unless ``resume``).
        model: the model being trained (its numerics and gradients are measured).
        recipe: the recipe's name or :class:`~lowprec.Recipe` (shown by the report; a
            preset name or a Recipe also records its techniques), or None (``"custom"``).
        config: your own settings (JSON values), stored under ``config.json``'s ``"train"``.
        steps: the planned number of steps, if known (the report marks a run that stopped
            early; the last step's numerics are recorded).
        scaler: a loss scaler or ``torch.amp.GradScaler``, read for ``skipped`` and
            ``loss_scale``.
        numerics_every: record numerics every this many steps (None: never).
        formats: the formats the numerics judge ranges against.
        resume: append to an existing run directory.
        resume_from: with ``resume``, the number of steps done at the restart.

    Example:
        >>> import tempfile, torch
        >>> m = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> with RunRecorder(tempfile.mkdtemp() + "/run", m, steps=2) as rec:
        ...     for step in range(2):
        ...         loss = m(torch.ones(8, 4)).square().mean()
        ...         loss.backward(); opt.step(); opt.zero_grad()
        ...         _ = rec.log(step + 1, loss=loss)
        >>> [r["step"] for r in rec.records()]
        [1, 2]
    """

    def __init__(
        self,
        out: str | Path,
        model: nn.Module,
        *,
        recipe: str | Recipe | None = None,
        config: Mapping[str, Any] | None = None,
        steps: int | None = None,
        scaler: Any = None,
        numerics_every: int | None = 100,
        formats: Sequence[str] = DEFAULT_FORMATS,
        resume: bool = False,
        resume_from: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ValueError(f"steps must be a positive int or None, got {steps!r}")
        if numerics_every is not None and (
            isinstance(numerics_every, bool)
            or not isinstance(numerics_every, int)
            or numerics_every < 1
        ):
            raise ValueError(
                f"numerics_every must be a positive int or None, got {numerics_every!r}"
            )
        if recipe is not None and not isinstance(recipe, (str, Recipe)):
            raise TypeError(f"recipe must be a str, Recipe or None, got {type(recipe).__name__}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        self.out, self.model, self.steps, self.scaler = Path(out), model, steps, scaler
        self.numerics_every = numerics_every
        self._config = self._make_config(recipe, dict(config or {}), steps)  # before any write
        self._last = 0  # the last step logged
        if resume_from is not None and not resume:
            raise ValueError("resume_from: only with resume=True")
        if resume:
            read_config(self.out, "resume")
            logged = [r["step"] for r in read_metrics(self.out)]
            if resume_from is not None:
                if isinstance(resume_from, bool) or not isinstance(resume_from, int):
                    raise TypeError(f"resume_from must be an int, got {type(resume_from).__name__}")
                if resume_from not in (0, *logged):
                    raise ValueError(
                        f"resume_from: step {resume_from} is not recorded in {self.out / METRICS}"
                    )
                truncate_jsonl(self.out / METRICS, resume_from)
                truncate_jsonl(self.out / NUMERICS, resume_from - 1)
                logged = [k for k in logged if k <= resume_from]
            self._last = logged[-1] if logged else 0
            (self.out / SUMMARY).unlink(missing_ok=True)  # a stale end-of-run file
        else:
            make_new_dir(self.out, "pass resume=True or another directory")
            write_atomic(self.out / CONFIG, json.dumps(self._config, indent=2))
        self._tracker = Tracker(model, formats, auto_step=False)
        self._handles = [model.register_forward_pre_hook(self._on_forward)]
        self._zeros: list[Tensor] = []
        self._numel = 0
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))  # type: ignore[no-untyped-call]
        self._seen_forward = False
        self._scaler_mark = len(getattr(scaler, "history", ()))
        self._t0 = time.perf_counter()
        self._next(self._last)
        self.closed = False

    # -- config ------------------------------------------------------------------------------
    @staticmethod
    def _make_config(
        recipe: str | Recipe | None, config: dict[str, Any], steps: int | None
    ) -> dict[str, Any]:
        rdict: dict[str, Any] = {}
        if isinstance(recipe, Recipe):
            name, rdict = recipe.name, recipe.to_dict()
        elif isinstance(recipe, str) and recipe in recipe_names():
            name, rdict = recipe, get_recipe(recipe).to_dict()
        else:
            name = recipe or "custom"
        train = {**config, "recipe": name}
        if steps is not None:
            train["steps"] = steps
        out = {"train": train, "recipe": rdict, "torch": torch.__version__, "recorder": True}
        try:
            json.dumps(out)
        except (TypeError, ValueError) as e:
            raise TypeError(f"config: values must be JSON values ({e})") from None
        return out

    # -- hooks -------------------------------------------------------------------------------
    def _sampled(self, index: int) -> bool:
        every = self.numerics_every
        if every is None:
            return False
        return index % every == 0 or (self.steps is not None and index == self.steps - 1)

    def _next(self, index: int) -> None:
        """Get ready for the step of 0-based index ``index``."""
        self._tracker.step = index
        self._tracker.enabled = False
        self._seen_forward = False

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        first = module.training and not self._seen_forward
        self._seen_forward = self._seen_forward or module.training
        self._tracker.enabled = first and self._sampled(self._tracker.step)

    def _on_grad(self, p: Tensor) -> None:
        g = p.grad
        if g is None:
            return
        data = g.qdata if isinstance(g, ScaledTensor) else g
        self._zeros.append((data == 0).sum())
        self._numel += data.numel()

    # -- logging -----------------------------------------------------------------------------
    def log(
        self, step: int | None = None, *, loss: float | Tensor, **metrics: Any
    ) -> dict[str, Any]:
        """Append the metrics record of step ``step`` (steps done, 1-based; default: the
        last logged + 1) and the numerics recorded since the last ``log``; the record.
        ``loss`` and ``metrics``: numbers (or one-element tensors), bools or strings."""
        if self.closed:
            raise RuntimeError("log(): the recorder is closed")
        if step is None:
            step = self._last + 1
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"step must be a positive int, got {step!r}")
        bad = sorted(_RESERVED & set(metrics))
        if bad:
            raise ValueError(f"metrics: {bad[0]!r} is the step argument")
        if step <= self._last:
            raise ValueError(f"step {step}: steps must increase (the last logged is {self._last})")
        now = time.perf_counter()
        lv = _value("loss", loss)
        if isinstance(lv, bool) or not isinstance(lv, (int, float)):
            raise TypeError(
                f"loss must be a number or a one-element tensor, got {type(loss).__name__}"
            )
        rec: dict[str, Any] = {"step": step, "loss": float(lv)}
        rec.update(self._from_scaler())
        rec["grad_zero_share"] = (
            float(torch.stack(self._zeros).sum()) / self._numel if self._numel else 0.0
        )
        rec["step_time"] = now - self._t0
        rec.update({k: _value(k, v) for k, v in metrics.items()})
        for k in ("loss_scale", "grad_zero_share", "step_time"):
            if isinstance(rec[k], bool) or not isinstance(rec[k], (int, float)):
                raise TypeError(f"{k} must be a number, got {type(rec[k]).__name__}")
        rec["skipped"] = bool(rec["skipped"])
        append_jsonl(self.out / NUMERICS, self._tracker.records)
        self._tracker.records.clear()
        append_jsonl(self.out / METRICS, [rec])
        self._zeros, self._numel, self._t0, self._last = [], 0, now, step
        self._next(step)
        return rec

    def _from_scaler(self) -> dict[str, Any]:
        s = self.scaler
        out: dict[str, Any] = {"skipped": False, "loss_scale": 1.0}
        if s is None:
            return out
        history = getattr(s, "history", None)
        if isinstance(history, list):  # a lowprec loss scaler: the steps since the last log
            new = history[self._scaler_mark :]
            self._scaler_mark = len(history)
            if new:
                return {"skipped": any(r.skipped for r in new), "loss_scale": new[-1].scale}
        get_scale = getattr(s, "get_scale", None)
        if callable(get_scale):
            out["loss_scale"] = float(get_scale())
        return out

    def records(self) -> list[dict[str, Any]]:
        """The metrics records written so far (read back from the directory)."""
        return read_metrics(self.out)

    # -- closing -----------------------------------------------------------------------------
    def close(self, summary: bool = True) -> None:
        """Remove the hooks, write the numerics not yet written and (``summary``, if any
        step was logged) ``summary.json``. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for h in self._handles:
            h.remove()
        self._tracker.remove()
        append_jsonl(self.out / NUMERICS, self._tracker.records)
        self._tracker.records.clear()
        if summary and self._last > 0:
            s = summarize(self.out)
            write_atomic(self.out / SUMMARY, json.dumps(s, indent=2))

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close; after an exception without the summary (the records written stay, and
        ``lowprec report`` reads them), and the exception propagates."""
        self.close(summary=exc_type is None)
