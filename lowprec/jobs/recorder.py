"""Record a run directory from your own training loop, for ``lowprec report``.

:class:`RunRecorder` is the one writer of a run directory's records
(:mod:`lowprec.jobs.rundir`): ``lowprec train`` writes through it too. It writes
``config.json`` at the start, one ``metrics.jsonl`` line per
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
* ``grad_zero_share`` and ``grad_nonfinite_share``: the share of exact zeros and of
  Inf/NaN among the model's gradient values, counted by
  :class:`~lowprec.analysis.stats.GradTally` (the counting of ``lowprec.amp.grad_stats``)
  in post-accumulate hooks each time a backward pass accumulates a parameter's gradient
  since the last ``log`` (0 when no backward ran), unless given; ``count_grads=False``
  installs no hooks (a loop that measures its gradients itself, as ``lowprec train``);
* ``step_time``: seconds since the previous ``log`` (or the start), unless given.

Every file is strict JSON: a NaN or infinite number is written as the string ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` (:mod:`lowprec._json`); the readers of
:mod:`lowprec.jobs.rundir` read them back as floats.

Numerics: the first training-mode forward and backward of the model after the start and
after each ``log(k)`` are recorded as step index ``k`` (0-based: the step being done)
when ``k`` is a multiple of ``numerics_every`` or ``k == steps - 1``: the report shows the
first and the last tracked step. Forward passes in eval mode are never recorded. The
low-precision GEMMs (float8 linears, unit scaling's FP8 matmuls) are measured the same way
every ``gemms_every`` steps (:mod:`lowprec.analysis.gemms`: what each cast really did) into
``gemms.jsonl``; the recorder is the active GEMM observer from its start to :meth:`close`
(on this thread).

An existing non-empty directory is refused (:class:`~lowprec.jobs.rundir.RunError`) unless
``resume=True``: then its ``config.json`` must exist, and the run continues after the last
logged step, or after step ``resume_from`` (the step of the checkpoint your loop restarts
from): the records after it are dropped from both files (atomic rewrites,
:func:`~lowprec.jobs.rundir.cut_logs`; a ``resume_from`` that is not a logged step is
refused before anything changes). A resume then records its ``steps`` and ``extra``
entries in ``config.json`` where they differ (one atomic rewrite).

``writer=False`` measures as usual but writes and reads nothing: the other ranks of a
process group, whose numerics of sharded tensors are collectives that every rank joins
(with ``resume``, ``resume_from`` is then the step to continue after).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from lowprec import _faults
from lowprec._json import dumps
from lowprec.analysis.gemms import DEFAULT_EVERY, GemmRecorder
from lowprec.analysis.stats import GradTally
from lowprec.analysis.tracking import Tracker
from lowprec.core.observe import observing
from lowprec.jobs.rundir import (
    CONFIG,
    GEMMS,
    METRICS,
    NUMERICS,
    SUMMARY,
    append_jsonl,
    cut_logs,
    make_new_dir,
    read_config,
    read_metrics,
    summarize,
    write_atomic,
)
from lowprec.recipes import Recipe
from lowprec.recipes.presets import get_recipe, recipe_names

__all__ = ["RunRecorder"]

# The formats whose ranges the numerics measure: lowprec train's (jobs.train.TRACK_FORMATS).
DEFAULT_FORMATS = ("fp16", "bf16", "e4m3fn", "e5m2")
_RESERVED = {"step"}
_OWN_KEYS = ("train", "recipe", "torch")  # config.json's entries that ``extra`` cannot set


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
            early; the last step's numerics are recorded). With ``resume``, a value other
            than the recorded one replaces it in ``config.json`` (a run extended).
        scaler: a loss scaler or ``torch.amp.GradScaler``, read for ``skipped`` and
            ``loss_scale``.
        numerics_every: record numerics every this many steps (None: never).
        gemms_every: measure the low-precision GEMMs every this many steps (None: never).
        formats: the formats the numerics judge ranges against.
        resume: append to an existing run directory.
        resume_from: with ``resume``, the number of steps done at the restart.
        count_grads: count the gradients' zero and Inf/NaN shares in hooks (False: the
            loop gives ``grad_zero_share`` to every :meth:`log` itself).
        extra: more top-level entries of ``config.json`` (JSON values; ``lowprec train``:
            ``model`` and ``parallel``); ``train``, ``recipe`` and ``torch`` are the
            recorder's own. With ``resume``, they replace the recorded entries of the
            same names (the others, and ``config`` and ``recipe``, stay the run's).
        writer: False: measure, but write (and read) nothing (see the module docstring).

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
        gemms_every: int | None = DEFAULT_EVERY,
        formats: Sequence[str] = DEFAULT_FORMATS,
        resume: bool = False,
        resume_from: int | None = None,
        count_grads: bool = True,
        extra: Mapping[str, Any] | None = None,
        writer: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ValueError(f"steps must be a positive int or None, got {steps!r}")
        for arg, every in (("numerics_every", numerics_every), ("gemms_every", gemms_every)):
            if every is not None and (
                isinstance(every, bool) or not isinstance(every, int) or every < 1
            ):
                raise ValueError(f"{arg} must be a positive int or None, got {every!r}")
        if recipe is not None and not isinstance(recipe, (str, Recipe)):
            raise TypeError(f"recipe must be a str, Recipe or None, got {type(recipe).__name__}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        if extra is not None and not isinstance(extra, Mapping):
            raise TypeError(f"extra must be a mapping or None, got {type(extra).__name__}")
        own = sorted(set(extra or {}) & set(_OWN_KEYS))
        if own:
            raise ValueError(f"extra: {own[0]!r} is an entry the recorder writes itself")
        for name, flag in (("count_grads", count_grads), ("writer", writer)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.out, self.model, self.steps, self.scaler = Path(out), model, steps, scaler
        self.numerics_every, self.count_grads, self.writer = numerics_every, count_grads, writer
        self.gemms_every = gemms_every
        # checked before any write
        self._config = self._make_config(recipe, dict(config or {}), steps, dict(extra or {}))
        self._last = 0  # the last step logged
        if resume_from is not None:
            if not resume:
                raise ValueError("resume_from: only with resume=True")
            if isinstance(resume_from, bool) or not isinstance(resume_from, int):
                raise TypeError(f"resume_from must be an int, got {type(resume_from).__name__}")
            if resume_from < 0:
                raise ValueError(f"resume_from must be >= 0, got {resume_from}")
        if not writer:
            self._last = (resume_from or 0) if resume else 0
        elif resume:
            saved = read_config(self.out, "resume")
            if resume_from is not None:
                logged = [r["step"] for r in cut_logs(self.out, resume_from, "resume_from")]
            else:
                logged = [r["step"] for r in read_metrics(self.out)]
                (self.out / SUMMARY).unlink(missing_ok=True)  # a stale end-of-run file
            self._last = logged[-1] if logged else 0
            self._record_resume(saved, steps, dict(extra or {}))
        else:
            make_new_dir(self.out, "pass resume=True or another directory")
            write_atomic(self.out / CONFIG, dumps(self._config, indent=2))
        self._tracker = Tracker(model, formats, auto_step=False)
        self._gemms = GemmRecorder(model, auto_step=False)
        self._observing = observing(self._gemms)
        self._observing.__enter__()
        self._handles = [model.register_forward_pre_hook(self._on_forward)]
        self._grads = GradTally()
        if count_grads:
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
        recipe: str | Recipe | None,
        config: dict[str, Any],
        steps: int | None,
        extra: dict[str, Any],
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
        for name, part in (("config", train), ("extra", extra)):
            try:
                dumps(part)
            except (TypeError, ValueError) as e:
                raise TypeError(f"{name}: values must be JSON values ({e})") from None
        return {**out, **extra}

    def _record_resume(
        self, saved: dict[str, Any], steps: int | None, extra: dict[str, Any]
    ) -> None:
        """On resume, after the logs are cut (every check passed): record in ``config.json``
        the ``steps`` (if given) and the ``extra`` entries of this start where they differ
        from ``saved`` (a run extended, a process count changed), by an atomic rewrite, so
        a later resume that gives neither continues the run as last started. A kill leaves
        the old file or the new one; the same values rewrite nothing."""
        updated = {**saved, **extra}
        if steps is not None:
            updated["train"] = {**saved["train"], "steps": steps}
        if updated != saved:
            write_atomic(self.out / CONFIG, dumps(updated, indent=2))

    # -- hooks -------------------------------------------------------------------------------
    def _sampled(self, index: int, every: int | None) -> bool:
        if every is None:
            return False
        return index % every == 0 or (self.steps is not None and index == self.steps - 1)

    def _next(self, index: int) -> None:
        """Get ready for the step of 0-based index ``index``."""
        self._tracker.step = self._gemms.step = index
        self._tracker.enabled = self._gemms.enabled = False
        self._seen_forward = False

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        first = module.training and not self._seen_forward
        self._seen_forward = self._seen_forward or module.training
        self._tracker.enabled = first and self._sampled(self._tracker.step, self.numerics_every)
        # every forward of a sampled step (gradient accumulation: each micro-batch)
        self._gemms.enabled = module.training and self._sampled(self._gemms.step, self.gemms_every)
        self._gemms.every = 1  # the recorder decides which steps are sampled

    def _on_grad(self, p: Tensor) -> None:
        if p.grad is not None:
            self._grads.add(p.grad)  # a ScaledTensor by its payload, a DTensor by its shard

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
        if not self.count_grads and "grad_zero_share" not in metrics:
            raise ValueError("grad_zero_share: with count_grads=False, log() needs it")
        rec: dict[str, Any] = {"step": step, "loss": float(lv)}
        rec.update(self._from_scaler())
        if self.count_grads:
            counted = self._grads.result()
            rec["grad_zero_share"] = counted["grad_zero_share"]
            rec["grad_nonfinite_share"] = counted["grad_nonfinite_share"]
        rec["step_time"] = now - self._t0
        rec.update({k: _value(k, v) for k, v in metrics.items()})
        for k in ("loss_scale", "grad_zero_share", "step_time"):
            if isinstance(rec[k], bool) or not isinstance(rec[k], (int, float)):
                raise TypeError(f"{k} must be a number, got {type(rec[k]).__name__}")
        rec["skipped"] = bool(rec["skipped"])
        if self.writer:
            append_jsonl(self.out / NUMERICS, self._tracker.records)
            append_jsonl(self.out / GEMMS, self._gemms.records)
            _faults.point("metrics")  # the numerics written, not the metrics line
            append_jsonl(self.out / METRICS, [rec])
        self._tracker.records.clear()
        self._gemms.clear()
        self._grads.reset()
        self._t0, self._last = now, step
        self._next(step)
        return rec

    @property
    def gemm_records(self) -> list[dict[str, Any]]:
        """The per-GEMM records measured since the last :meth:`log` (what it will write to
        ``gemms.jsonl``; a copy)."""
        return list(self._gemms.records)

    def append(self, name: str, records: Sequence[Mapping[str, Any]]) -> None:
        """Append JSON-line ``records`` to the run directory's file ``name`` (e.g. the
        guard's moves), whole lines (:func:`~lowprec.jobs.rundir.append_jsonl`); nothing
        for a recorder that does not write."""
        if self.writer:
            append_jsonl(self.out / name, [dict(r) for r in records])

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
        """The metrics records written so far (read back from the directory; ``[]`` for a
        recorder that does not write)."""
        return read_metrics(self.out) if self.writer else []

    def write_summary(self) -> dict[str, Any]:
        """Write ``summary.json`` (:func:`~lowprec.jobs.rundir.summarize` of the records
        written) and return it; :class:`~lowprec.jobs.rundir.RunError` if there are none
        yet. A recorder that does not write writes nothing and returns ``{}``. Callable
        after :meth:`close`."""
        if not self.writer:
            return {}
        s = summarize(self.out)
        write_atomic(self.out / SUMMARY, dumps(s, indent=2))
        return s

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
        self._gemms.remove()
        self._observing.__exit__(None, None, None)
        if self.writer:
            append_jsonl(self.out / NUMERICS, self._tracker.records)
            append_jsonl(self.out / GEMMS, self._gemms.records)
        self._tracker.records.clear()
        self._gemms.clear()
        if summary and self._last > 0:
            self.write_summary()

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
