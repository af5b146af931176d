"""The run directory: the files a training run writes, reading them, and the checks.

A run directory holds

* ``config.json`` (:data:`CONFIG`): ``{"train": TrainConfig, "recipe": Recipe, "model":
  ModelConfig, "torch": version}``, everything needed to rebuild the run;
* ``metrics.jsonl`` (:data:`METRICS`): one JSON object per training step, ``"step"`` the
  number of steps done (1-based);
* ``numerics.jsonl`` (:data:`NUMERICS`): :mod:`lowprec.analysis.tracking` records,
  ``"step"`` the 0-based step index;
* ``gemms.jsonl`` (:data:`GEMMS`): :mod:`lowprec.analysis.gemms` records (per-GEMM
  measured numerics of the casts), ``"step"`` the 0-based step index;
* ``guard.jsonl`` (:data:`GUARD`): the moves of ``lowprec train --guard``
  (:class:`lowprec.autopilot.guard.Move`), ``"step"`` the steps done when it moved;
* ``checkpoint.pt`` (:data:`CHECKPOINT`): ``{"step", "run", "rng"}`` (and ``"guard"``);
* ``summary.json`` (:data:`SUMMARY`): :func:`summary_of` the metrics, at the end;
* ``.lock`` (:data:`LOCK`): the pid of the process training the run, which holds an
  exclusive ``flock`` on it while it runs (:class:`RunLock`; the system drops the lock
  when the process ends, however it ends, so a killed run leaves no stale lock).

Every file is strict JSON (:mod:`lowprec._json`): a NaN or infinite number, such as the loss
of a diverged run, is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``,
never as a bare ``NaN`` token that strict parsers reject; every reader here turns those
strings back into floats (files of older versions, with bare tokens, still read).

How the files are written (``docs/reliability.md`` lists what survives which failure):

* whole files (config, checkpoint, summary, and every rewrite of a JSON-lines file, such as
  the truncation to the checkpoint's step on resume) go to a temporary file in the same
  directory, are flushed to disk (``fsync``), then renamed over the old one (``os.replace``):
  a reader sees the old file or the new one, never a mix;
* JSON-lines files grow by appends of whole lines, one ``write`` call per step
  (:func:`append_jsonl`); a kill can at worst tear the last line, and every reader
  (:func:`read_jsonl`) drops a torn last line with a note (:class:`RunNote`).

Every job (train, demo, report) reads and checks run directories through this module only;
a failed check raises :class:`RunError` (a ``ValueError``) with a message for the user.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lowprec import _faults
from lowprec._json import dumps, loads
from lowprec.jobs.run_summary import summary_of

__all__ = [
    "CHECKPOINT",
    "CONFIG",
    "GEMMS",
    "GUARD",
    "LOCK",
    "METRICS",
    "NUMERICS",
    "SUMMARY",
    "NonFiniteError",
    "RunError",
    "RunLock",
    "RunNote",
    "append_jsonl",
    "cut_logs",
    "load_checkpoint",
    "make_new_dir",
    "output_problem",
    "read_config",
    "read_gemms",
    "read_jsonl",
    "read_metrics",
    "read_run",
    "save_checkpoint",
    "summarize",
    "truncate_jsonl",
    "write_atomic",
]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
CONFIG = "config.json"
SUMMARY = "summary.json"
NUMERICS = "numerics.jsonl"
GEMMS = "gemms.jsonl"
GUARD = "guard.jsonl"
LOCK = ".lock"
_TMP = ".tmp"  # suffix of the temporary files of atomic writes

# Keys every metrics record has (what summary_of reads) and every numerics record has.
_METRIC_KEYS = ("step", "loss", "skipped", "grad_zero_share", "step_time")
_NUMERIC_KEYS = ("step", "name", "kind", "below_normal", "above_max")
_GEMM_KEYS = ("step", "layer", "gemm", "operands")


class RunError(ValueError):
    """A run cannot start or resume (bad directory, missing or corrupt files)."""


class NonFiniteError(RunError):
    """The run stopped on an Inf/NaN loss or gradient (or too many skipped steps); the
    last checkpoint, written before it, is kept. ``step``: the step that failed."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class RunNote(UserWarning):
    """Something in a run directory was repaired while reading it (a torn last line)."""


# ---- writing -----------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Any], None] | str | bytes) -> None:
    """Replace ``path`` atomically: write to ``path.tmp`` (``write(f)`` on the binary file,
    or the given text/bytes), flush and ``fsync`` it, then ``os.replace`` it over ``path``.
    A crash at any moment leaves the old file or the new one, and at worst a stale
    ``.tmp`` file that the next write replaces."""
    tmp = path.with_name(path.name + _TMP)
    with open(tmp, "wb") as f:
        if isinstance(write, str):
            f.write(write.encode("utf-8"))
        elif isinstance(write, bytes):
            f.write(write)
        else:
            write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def append_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Append ``records`` as JSON lines to ``path`` in one ``write`` call (``O_APPEND``): a
    kill leaves whole lines, or at worst a torn last line that :func:`read_jsonl` drops."""
    data = "".join(dumps(r) + "\n" for r in records).encode("utf-8")
    if not data:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:  # a regular file takes it in one call; loop only on a short write
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def make_new_dir(out: Path, advice: str) -> None:
    """Create ``out`` for a new run; :class:`RunError` ending in ``advice`` if it exists and
    is not an empty directory (nothing on disk is overwritten), or cannot be created."""
    if out.exists() and not out.is_dir():
        raise RunError(f"output directory {out} is a file, not a directory; give another path")
    if out.exists() and any(f.name != LOCK for f in out.iterdir()):
        raise RunError(f"output directory {out} already exists; {advice}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunError(f"cannot create output directory {out}: {e.strerror or e}") from None
    problem = _write_problem(out)
    if problem is not None:
        raise RunError(f"output directory {out} is not writable: {problem}")


class RunLock(contextlib.AbstractContextManager["RunLock"]):
    """The one process that trains a run directory ``out``: :meth:`acquire` takes an
    exclusive, non-blocking ``flock`` on ``out/.lock`` (writing this process's pid in it);
    a second process, such as a ``--resume`` started while the run still trains, gets a
    :class:`RunError` naming the holder's pid and nothing of the run is read or written
    (two processes appending to one run duplicated and interleaved its steps). The lock
    goes with the process (:meth:`release`, the context's exit, or any end of the process:
    the system releases a ``flock`` with its file descriptors). Without ``fcntl`` (not
    POSIX) it does nothing."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock if ``out`` is a directory and this process does not hold it yet
        (a directory still to be made: call again once it is)."""
        if self._fd is not None or not self.out.is_dir():
            return
        try:
            import fcntl
        except ImportError:  # not POSIX
            return
        path = self.out / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunError(f"{self.out} is not writable: {e.strerror or e}: {path}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise RunError(
                f"{self.out} is being trained by another process (pid {pid}); wait for it to "
                "end, or stop it, before starting or resuming this run"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Drop the lock; its file stays, unless the directory holds nothing else (a start
        refused before it wrote anything leaves the directory empty, as it found it)."""
        if self._fd is not None:
            try:
                if not any(f.name != LOCK for f in self.out.iterdir()):
                    (self.out / LOCK).unlink(missing_ok=True)
            except OSError:
                pass  # (the directory is gone or unreadable: nothing to tidy)
            os.close(self._fd)  # the lock goes with the descriptor
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def output_problem(path: Path) -> str | None:
    """Why the file ``path`` could not be written, checked before any work (``None`` if it
    can): it names a directory, or its folder — or, for a missing folder that the command
    would create, the nearest existing one — is not a directory or takes no new entry."""
    if path.is_dir():
        return f"{path} is a directory; give a file name"
    folder = path.parent
    here = folder
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        return f"cannot create the folder {folder}: {here} is not a directory"
    problem = _write_problem(here)
    return None if problem is None else f"cannot write in the folder {here}: {problem}"


def _write_problem(folder: Path) -> str | None:
    """Why ``folder`` takes no new entry (``None`` if it does), probed by creating a
    temporary directory in it and removing it at once: permission bits alone miss a
    read-only or virtual file system such as ``/proc``, even for root. Nothing is left."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lowprec-probe-", dir=folder))
    except OSError as e:
        return str(e.strerror or e)
    return None


# ---- reading -----------------------------------------------------------------------------


def read_config(out: Path, context: str) -> dict[str, Any]:
    """The run's ``config.json``; :class:`RunError` prefixed ``context`` (if any) if there
    is none, or it is not a JSON object with a ``"train"`` object."""
    saved, pre = out / CONFIG, f"{context}: " if context else ""
    if not saved.is_file():
        raise RunError(f"{pre}{out} is not a run directory (no {CONFIG})")
    try:
        config = loads(saved.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{pre}{saved} is corrupt or unreadable ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("train"), dict):
        raise RunError(f"{pre}{saved} is corrupt (expected an object with a 'train' object)")
    return config


def read_jsonl(path: Path, required: tuple[str, ...] = ("step",)) -> list[dict[str, Any]]:
    """The records of the JSON-lines file ``path`` (``[]`` if there is none). A torn last
    line (a kill during an append) is dropped with a :class:`RunNote` warning; any other
    bad line, or a record without the ``required`` keys or an integer ``"step"``, raises
    :class:`RunError` naming the file and line."""
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise RunError(f"{path}: unreadable ({e.strerror or e})") from None
    lines = text.split("\n")
    complete = text.endswith("\n") or not text
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        last = i == len(lines) - 1 or (i == len(lines) - 2 and not lines[-1])
        try:
            rec = loads(line)
        except json.JSONDecodeError:
            rec = None
        if not isinstance(rec, dict) or (last and not complete):
            if last:
                warnings.warn(
                    f"{path}: dropped a torn last line (line {i + 1}: a write was cut short)",
                    RunNote,
                    stacklevel=2,
                )
                break
            raise RunError(f"{path}: line {i + 1} is not a JSON object (the file is corrupt)")
        missing = [k for k in required if k not in rec]
        if missing or isinstance(rec["step"], bool) or not isinstance(rec["step"], int):
            what = f"no {', '.join(missing)}" if missing else "a non-integer step"
            raise RunError(f"{path}: line {i + 1} has {what} (not a lowprec record)")
        records.append(rec)
    return records


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    """The metrics records of run directory ``out``, in step order (see :func:`read_jsonl`)."""
    return read_jsonl(Path(out) / METRICS, _METRIC_KEYS)


def read_run(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(config, metrics, numerics)`` of a finished or running run directory (numerics
    empty if none were written); :class:`RunError` naming what is wrong if ``path`` is not
    a run directory with at least one recorded step, or one of its files is malformed."""
    p = Path(path)
    if not p.is_dir():
        raise RunError(f"{p} is not a directory (expected a run directory of `lowprec train`)")
    missing = [n for n in (CONFIG, METRICS) if not (p / n).is_file()]
    if missing:
        raise RunError(
            f"{p} is not a lowprec run directory: no {' or '.join(missing)} "
            "(make one with `lowprec train --out DIR` or `lowprec demo`)"
        )
    metrics = read_metrics(p)
    if not metrics:
        raise RunError(f"{p}: the run has no recorded steps yet ({METRICS} is empty)")
    config = read_config(p, "")
    for i, r in enumerate(metrics):
        bad = [k for k in ("loss", "grad_zero_share", "step_time") if not _is_number(r[k])]
        bad += [k for k in ("val_loss",) if k in r and not _is_number(r[k])]
        if bad:
            raise RunError(f"{p / METRICS}: record {i + 1} has a non-numeric {bad[0]}")
    try:
        numerics = read_jsonl(p / NUMERICS, _NUMERIC_KEYS)
    except RunError as e:
        raise RunError(f"{e} ({NUMERICS} is corrupt or truncated)") from None
    return config, metrics, numerics


def read_gemms(path: str | Path) -> list[dict[str, Any]]:
    """The per-GEMM records (``gemms.jsonl``) of run directory ``path``, ``[]`` if it has
    none; :class:`RunError` if the file is malformed."""
    try:
        records = read_jsonl(Path(path) / GEMMS, _GEMM_KEYS)
    except RunError as e:
        raise RunError(f"{e} ({GEMMS} is corrupt or truncated)") from None
    for i, r in enumerate(records):
        why = _gemm_problem(r)
        if why:
            raise RunError(f"{Path(path) / GEMMS}: record {i + 1} {why} (the file is corrupt)")
    return records


# a GEMM record's operand shares (numbers) and optional measures (numbers or null)
_GEMM_SHARES = ("numel", "nonfinite", "flushed", "saturated")
_GEMM_OPTIONAL = ("sqnr_db", "scale_min", "scale_max", "n_scales")


def _gemm_problem(rec: dict[str, Any]) -> str:
    """What is wrong with a ``gemms.jsonl`` record's values (``""``: nothing)."""
    if rec.get("rel_err") is not None and not _is_number(rec["rel_err"]):
        return "has a non-numeric rel_err"
    ops = rec["operands"]
    if not isinstance(ops, dict):
        return "has operands that are not an object"
    for role, op in ops.items():
        if not isinstance(op, dict):
            return f"has operand {role!r} that is not an object"
        for k in _GEMM_SHARES:
            if k in op and not _is_number(op[k]):
                return f"has a non-numeric {k} of operand {role!r}"
        for k in _GEMM_OPTIONAL:
            if op.get(k) is not None and not _is_number(op[k]):
                return f"has a non-numeric {k} of operand {role!r}"
    return ""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def truncate_jsonl(path: Path, last: int) -> None:
    """Keep the JSON lines whose ``step`` is at most ``last`` (drop those written after the
    checkpoint a run resumes from, and a torn last line), rewriting ``path`` atomically
    (:func:`write_atomic`): a kill during the rewrite leaves the old file."""
    if not path.exists():
        return
    _rewrite(path, [r for r in read_jsonl(path) if r["step"] <= last])


def _rewrite(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` by ``records`` as JSON lines (atomically), unless it holds exactly
    those lines already."""
    text = "".join(dumps(r) + "\n" for r in records)
    try:
        if path.read_text(encoding="utf-8") == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    write_atomic(path, text)


def cut_logs(out: Path, last: int, context: str, every_step: bool = False) -> list[dict[str, Any]]:
    """Cut the logs of run directory ``out`` back to ``last`` steps done, for a run that
    continues after step ``last`` (a checkpoint's): the metrics records of steps up to
    ``last`` and the numerics of step indices below it stay, the rest and ``summary.json``
    go (atomic rewrites). The metrics are read once, checked, then rewritten, so a failed
    check changes nothing on disk. The records kept.

    :class:`RunError` prefixed ``context`` unless the kept metrics end at step ``last``
    (none for ``last == 0``), in increasing order, and, with ``every_step`` (a run that logs
    every step, as ``lowprec train``), are steps ``1..last`` once each."""
    path = out / METRICS
    kept = [r for r in read_metrics(out) if r["step"] <= last]
    steps = [r["step"] for r in kept]
    if every_step and steps != list(range(1, last + 1)):
        raise RunError(
            f"{context}: {path} does not hold steps 1..{last} of the checkpoint once each "
            "(edited or lost); the run cannot continue exactly"
        )
    increasing = all(a < b for a, b in itertools.pairwise(steps))
    if not increasing or (last > 0 and (not steps or steps[-1] != last)):
        raise RunError(f"{context}: step {last} is not recorded in {path} (edited or lost)")
    if path.exists():
        _rewrite(path, kept)
    truncate_jsonl(out / NUMERICS, last - 1)  # numerics: 0-based step index
    truncate_jsonl(out / GEMMS, last - 1)
    truncate_jsonl(out / GUARD, last)  # the guard's moves: after step ``step`` (1-based)
    (out / SUMMARY).unlink(missing_ok=True)  # a stale end-of-run file
    return kept


def save_checkpoint(out: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``out/checkpoint.pt`` atomically (:func:`write_atomic`: a crash or
    a kill never leaves a half-written checkpoint)."""

    def write(f: Any) -> None:
        torch.save(state, f)
        _faults.point("checkpoint")  # written, not yet in place

    write_atomic(out / CHECKPOINT, write)


_RUN_KEYS = ("recipe", "model", "optimizer", "scaler")


def load_checkpoint(out: Path, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint of ``out`` (keys ``step``, ``run``, ``rng``; ``run`` with the keys of
    :meth:`lowprec.recipes.Prepared.state_dict`); :class:`RunError` if it is missing,
    unreadable or lacks a key. ``mmap``: its tensors are mapped from the file, not read
    (a look at its structure and step costs no copy of the weights)."""
    if not isinstance(mmap, bool):
        raise TypeError(f"mmap must be a bool, got {type(mmap).__name__}")
    path = out / CHECKPOINT
    if not path.is_file():
        raise RunError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, weights_only=True, mmap=mmap)
    except Exception as e:  # any unpickling failure means the file is corrupt
        raise RunError(f"--resume: checkpoint {path} is corrupt or unreadable ({e})") from None
    if not isinstance(state, dict) or not {"step", "run", "rng"} <= set(state):
        raise RunError(f"--resume: checkpoint {path} is corrupt (missing keys)")
    run = state["run"]
    missing = [k for k in _RUN_KEYS if not isinstance(run, dict) or k not in run]
    if missing or not isinstance(state["step"], int):
        what = f"no {', '.join(repr(k) for k in missing)} in its run state" if missing else "step"
        raise RunError(f"--resume: checkpoint {path} is corrupt ({what})")
    return state


# ---- summary -------------------------------------------------------------------------------


def summarize(out: str | Path) -> dict[str, Any]:
    """:func:`summary_of` the run directory ``out``."""
    return summary_of(read_metrics(out), read_config(Path(out), ""))
