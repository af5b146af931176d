"""The HTML report: compare training runs and explain their numerics in plain language.

``write_report([run_dir, ...], "report.html")`` (or ``lowprec report RUN_DIR ... -o F``)
writes one self-contained page (images embedded as PNG data URIs, no external files):

* the verdicts first (each run against its fp32 reference, or "no reference"), then a
  summary table (losses, gap to the reference, skipped steps, divergence, the worst
  underflow and overflow of the last tracked step in the run's own format, the worst
  measured GEMM cast);
* loss curves and the loss scale of all runs (:func:`plot_runs`);
* per run: a plain-language diagnosis that agrees with its verdict
  (:func:`lowprec.analysis.diagnosis.diagnose`), its per-layer plan where its recipe has
  one (:attr:`lowprec.recipes.Recipe.layers`), a per-layer table of its low-precision GEMMs
  (format per GEMM, SQNR, flushed and saturated shares, measured), per-tensor scale charts
  at initialisation and at the end, exponent histograms of the worst tensors, and tables of
  the tensors with the most underflow and overflow in the format they are stored in.

A run directory is what ``lowprec train`` writes (:mod:`lowprec.jobs.rundir`):
``config.json``, ``metrics.jsonl`` and, for the numerics, ``numerics.jsonl``
(:mod:`lowprec.analysis.tracking` records at the first and the last step) and
``gemms.jsonl`` (:mod:`lowprec.analysis.gemms` records).
"""

from __future__ import annotations

import base64
import contextlib
import html
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from lowprec._startup import Terminated, signal_of
from lowprec.analysis.diagnosis import (  # Run and diagnose re-exported: the report's API
    Run,
    diagnose,
    judged_formats,
    worst,
)
from lowprec.analysis.plots import plot_curves, plot_exp_histograms, plot_scale_chart
from lowprec.analysis.run_verdicts import summary_verdicts
from lowprec.analysis.verdicts import failing
from lowprec.jobs.interrupts import Interrupted
from lowprec.jobs.report_tables import (
    attribution_table,
    chart_formats,
    gemm_table,
    moves_table,
    plan_table,
    summary_rows,
    table,
    tensor_table,
)
from lowprec.jobs.run_summary import summary_of
from lowprec.jobs.rundir import (
    GUARD,
    RunError,
    output_problem,
    read_gemms,
    read_jsonl,
    read_metrics,
    read_run,
    write_atomic,
)

__all__ = ["ReportInterrupted", "Run", "diagnose", "load_run", "plot_runs", "write_report"]


class ReportInterrupted(Interrupted):
    """:func:`write_report` stopped by SIGINT (Ctrl-C) or SIGTERM before the page was
    written: its chart workers are stopped, its temporary files removed, and ``out`` is
    as it was (the page is written only at the end, atomically)."""

    def __init__(self, signum: int, out: str) -> None:
        super().__init__(0, signum, out)

    def __str__(self) -> str:
        return f"interrupted ({self.signal_name}); no report written to {self.out}"


def load_run(path: str | Path) -> Run:
    """Read a run directory (:func:`lowprec.jobs.rundir.read_run`); :class:`RunError` (a
    ``ValueError``) if it is not one."""
    config, metrics, numerics = read_run(path)
    summary = summary_of(metrics, config)
    moves = read_jsonl(Path(path) / GUARD)
    return Run(Path(path), config, metrics, summary, numerics, gemms=read_gemms(path), moves=moves)


def plot_runs(runs: Sequence[str | Path], path: str | Path) -> None:
    """:func:`lowprec.analysis.plots.plot_curves` of run directories (named by folder)."""
    plot_curves([(Path(r).name, read_metrics(r)) for r in runs], path)


# ---- HTML -----------------------------------------------------------------------------


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}
img{max-width:100%;border:1px solid #eee;margin:.4em 0}
.diag{background:#fff8e6;border-left:4px solid #e0a000;padding:.4em 1em}
.run{border-top:2px solid #888;margin-top:2em}
"""


def _unique_labels(runs: Sequence[Run]) -> None:
    """Label runs by directory name, adding parent folders where names repeat."""
    paths = [r.path.resolve() for r in runs]
    distinct = len(set(paths))  # the same directory given twice keeps one label
    for depth in range(1, 8):
        labels = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(labels)) == distinct:
            break
    for r, lab in zip(runs, labels, strict=True):
        r.label = lab


_Figure = tuple[Callable[..., Any], tuple[Any, ...]]


# A chart worker: `python -c` (never a re-run of the caller's __main__, which the spawn start
# method would do to a user's script without a main guard) draws the pickled figures. Its
# first act is to watch the read end of a pipe whose write end only the report holds: when
# the report dies, SIGKILL included, the read sees end-of-file and the worker exits at once
# (it does not draw on, orphaned). Standard library only, before the slow imports.
_WORKER = """\
import os, sys, threading
def _orphaned(fd=int(sys.argv[2])):
    while os.read(fd, 1):
        pass
    os._exit(1)
threading.Thread(target=_orphaned, daemon=True).start()
import pickle
for fn, args in pickle.load(open(sys.argv[1], "rb")):
    fn(*args)
"""

# The report's temporary directories: `<tempdir>/lowprec-report-XXXX`, each holding a
# `lock` file its report keeps locked (flock) while it runs. A report killed by SIGKILL (or
# cut short in its cleanup) leaves its directory behind; the lock dies with the process, so
# the next report (of any process) removes every such directory whose lock it can take.
_TMP_PREFIX = "lowprec-report-"
_LOCK = "lock"


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to the new file ``path``, readable and writable by this user only.

    The chart workers' hand-off is a pickle (functions and their in-memory arguments,
    made by this process), read back by the workers this process starts. It lives in a
    directory of ``tempfile.TemporaryDirectory`` (mode 0700) and is created 0600 and
    exclusively (``O_EXCL``: never an existing file or a planted link), so no other user
    can read or replace it between the write and the read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _draw(figures: Sequence[_Figure], tmp: Path) -> None:
    """Draw ``figures`` (function, arguments); over the CPUs this process may use, in
    fresh worker processes, when there are enough figures to pay for their start (their
    hand-off files in ``tmp``, a private directory of this report). Raises
    ``RuntimeError`` with a worker's error output if one fails. However this call ends
    (an error, a Ctrl-C, a signal turned into an exception) no worker outlives it; if this
    process is killed outright the workers exit by themselves (:data:`_WORKER`)."""
    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, 4)
    if workers < 2 or len(figures) < 8:
        for fn, args in figures:
            fn(*args)
        return
    root = str(Path(__file__).resolve().parents[2])  # where this lowprec is importable from
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path}
    procs: list[subprocess.Popen[str]] = []
    watch, alive = os.pipe()  # the workers read `watch`; `alive` closes when this process dies
    try:
        for i in range(workers):
            spec = tmp / f"figures{i}.pkl"
            _write_private(spec, pickle.dumps(list(figures[i::workers])))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER, str(spec), str(watch)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    pass_fds=(watch,),
                )
            )
        errors = [(p, p.communicate()[1]) for p in procs]
    finally:
        for p in procs:  # Ctrl-C, SIGTERM or an error here: no worker outlives the report
            if p.poll() is None:
                p.kill()
                p.wait()
        os.close(watch)
        os.close(alive)
    for p, err in errors:
        if p.returncode != 0:
            raise RuntimeError(f"drawing the report's charts failed: {err.strip()[-2000:]}")


def _remove_stale_dirs() -> None:
    """Remove the temporary directories of reports that are gone (killed outright, or cut
    short while cleaning up): this user's ``<tempdir>/lowprec-report-*`` whose lock no
    live process holds. Best effort: anything in the way is left alone."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): nothing is swept
        return
    root = Path(tempfile.gettempdir())
    try:
        candidates = [d for d in root.iterdir() if d.name.startswith(_TMP_PREFIX)]
    except OSError:
        return
    for d in candidates:
        try:
            st = d.lstat()
            if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid():
                continue
            fd = os.open(d / _LOCK, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:  # no lock yet (a report starting) or not ours: leave it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its report is running
        except OSError:
            os.close(fd)
            continue
        try:
            shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _private_dir() -> Iterator[Path]:
    """A new private temporary directory for one report (charts, the workers' hand-off),
    locked while the report runs and removed at its end; stale ones of dead reports are
    removed first (see :data:`_TMP_PREFIX`)."""
    _remove_stale_dirs()
    d = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX))
    fd = None
    try:
        try:
            import fcntl

            # locked under a private name first, then renamed: a sweeper never sees an
            # unlocked `lock` of a live report
            fd = os.open(d / ".lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(d / ".lock", d / _LOCK)
        except ImportError:
            pass
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if fd is not None:
            os.close(fd)


def _raises(handler: Any) -> bool:
    """Whether a signal handler only raises ``KeyboardInterrupt`` (Python's for SIGINT,
    ``lowprec``'s for SIGTERM): such a signal may be held back and raised later."""
    from lowprec import _startup

    return handler is signal.default_int_handler or handler is _startup.raise_terminated


@contextlib.contextmanager
def _interruptible(out: Path) -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
    """Turn SIGINT (``KeyboardInterrupt``) and SIGTERM into :class:`ReportInterrupted`.

    SIGTERM is taken over (main thread only) where it has the default action, which would
    kill the process with its workers orphaned and its temporary files left; a program's
    own SIGTERM handler, or an ignored SIGTERM, is left alone. A ``KeyboardInterrupt``
    carrying another signal (``lowprec``'s :class:`lowprec._startup.Terminated`) keeps it.
    Yields ``protect()``: a context in which a signal is held back until its end (the
    final write), then given its ordinary course (the page is written): a SIGINT raises
    ``KeyboardInterrupt``, a SIGTERM :class:`~lowprec._startup.Terminated`, or, where it
    had the default action, ends the process."""
    pending: list[int] = []
    holding = False
    old: dict[int, Any] = {}

    def term(signum: int, frame: FrameType | None) -> None:
        if holding:
            pending.append(signum)
            return
        raise ReportInterrupted(signum, str(out))

    @contextlib.contextmanager
    def protect() -> Iterator[None]:
        nonlocal holding
        saved: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                if _raises(signal.getsignal(s)) or signal.getsignal(s) is term:
                    saved[s] = signal.signal(s, term)
        holding = True
        try:
            yield
        finally:
            holding = False
            for signum, h in saved.items():
                signal.signal(signum, h)
        if not pending:
            return
        # the page is written: the signal takes its ordinary course, no longer the report's
        if pending[0] != signal.SIGTERM:
            raise KeyboardInterrupt
        if signal.SIGTERM in old:  # it had the default action: die by it, as it would have
            signal.signal(signal.SIGTERM, old.pop(signal.SIGTERM))
            os.kill(os.getpid(), signal.SIGTERM)
        raise Terminated

    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            old[signal.SIGTERM] = signal.signal(signal.SIGTERM, term)
    try:
        yield protect
    except ReportInterrupted:
        raise
    except KeyboardInterrupt as e:
        if holding or pending:
            raise
        raise ReportInterrupted(signal_of(e), str(out)) from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def write_report(
    runs: Sequence[str | Path],
    out: str | Path,
    title: str = "",
    detail: bool = True,
    tolerance: Mapping[str, float] | None = None,
) -> Path:
    """Write the HTML report comparing ``runs`` (run directories) to ``out``; see the
    module docstring. ``detail=False`` leaves out each run's scale charts and exponent
    histograms (the diagnosis and the tables stay). ``tolerance``: the seed spread of the
    val-loss gap per reference recipe, as the demo judges it
    (:func:`lowprec.analysis.run_verdicts.summary_verdicts`; none: gaps below the failure
    threshold are reported, not judged). The folder of ``out`` is created if it is
    missing (with its parents). Raises :class:`RunError` naming any directory that does
    not exist, is not a run or is given twice, or, before any work, the folder of ``out``
    if it cannot be created or written (a file stands in its way, or no permission).

    Signals: SIGINT (Ctrl-C) or SIGTERM (taken over only where it has the default action)
    before the page is written raises :class:`ReportInterrupted`, after the chart workers
    are stopped and the temporary files removed; ``out`` is untouched (an old page stays).
    One during the final atomic write is held back until the write is done, then raised as
    a ``KeyboardInterrupt`` (the page is complete). The charts and the workers' hand-off
    live in one private temporary directory, ``<tempdir>/lowprec-report-*``, locked while
    the report runs; if the report is killed outright (SIGKILL) its workers exit by
    themselves and the next report removes the directory."""
    if not runs:
        raise ValueError("runs: give at least one run directory")
    if not isinstance(detail, bool):
        raise TypeError(f"detail must be a bool, got {type(detail).__name__}")
    out = Path(out)
    with _interruptible(out) as protect:
        page = _page(runs, out, title, detail, tolerance)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunError(f"cannot create the folder {out.parent}: {e.strerror or e}") from None
        with protect():  # a reader never sees half a page, nor a signal a half-written one
            write_atomic(out, page)
    return out


def _page(
    runs: Sequence[str | Path],
    out: Path,
    title: str,
    detail: bool,
    tolerance: Mapping[str, float] | None,
) -> str:
    """The HTML page of :func:`write_report` (which checked ``detail``)."""
    problem = output_problem(out)
    if problem is not None:
        raise RunError(problem)
    seen: dict[Path, str] = {}
    for r in runs:  # the same run twice would be shown and judged twice
        if not os.path.lexists(r):
            raise RunError(f"{r} does not exist (expected a run directory of `lowprec train`)")
        key = Path(r).resolve()
        if key in seen:
            raise RunError(f"{r}: the same run directory as {seen[key]}; give each run once")
        seen[key] = str(r)
    loaded = [load_run(r) for r in runs]
    _unique_labels(loaded)
    verdicts = summary_verdicts(loaded, tolerance)
    parts = [
        f"<h1>{html.escape(title or 'lowprec numerics report')}</h1>",
        "<h2>Summary</h2>",
        "<ul>"  # the verdicts lead (lowprec.analysis.run_verdicts.summary_verdicts)
        + "".join(f"<li><b>{html.escape(n)}</b>: {html.escape(v)}</li>" for n, v in verdicts)
        + "</ul>",
        table(
            [
                "run",
                "recipe",
                "steps",
                "train loss",
                "val loss",
                "gap to reference",
                "skipped",
                "diverged",
                "worst gradient underflow",
                "worst overflow",
                "worst GEMM cast",
            ],
            summary_rows(loaded),
        ),
        "<p>Underflow: share of a gradient's values below its format's smallest normal "
        "(subnormal or lost); overflow: share of a tensor's values above its format's max; "
        "both in the format the run stores its tensors in, at the last tracked step. "
        "Worst GEMM cast: the largest share of an operand of a low-precision GEMM that its "
        "cast flushed to zero, measured (lowprec.analysis.gemms).</p>",
    ]
    with _private_dir() as t:
        # Figures are drawn together at the end (in parallel where that pays): the page
        # holds a placeholder per image until then.
        figures: list[_Figure] = [(plot_runs, ([r.path for r in loaded], t / "curves.png"))]
        images: list[tuple[Path, str]] = [(t / "curves.png", "loss curves")]

        def image(fn: Callable[..., Any], args: tuple[Any, ...], png: Path, alt: str) -> str:
            figures.append((fn, args))
            images.append((png, alt))
            return f"\0img{len(images) - 1}\0"

        parts += ["<h2>Loss curves and loss scale</h2>", "\0img0\0"]
        for i, run in enumerate(loaded):
            parts.append(
                f'<div class="run"><h2>{html.escape(run.name)} '
                f"<small>({html.escape(run.recipe)})</small></h2>"
            )
            parts.append(
                '<div class="diag"><ul>'
                + "".join(f"<li>{html.escape(n)}</li>" for n in diagnose(run, verdicts[i][1]))
                + "</ul></div>"
            )
            if failing(verdicts[i][1]):
                parts.append(attribution_table(run))
            parts.append(plan_table(run))
            parts.append(moves_table(run))
            parts.append(gemm_table(run))
            steps = run.tracked_steps
            for label, step in (
                ("at initialisation", steps[0] if steps else None),
                ("at the end", steps[-1] if len(steps) > 1 else None),
            ):
                if step is None or not detail:
                    continue
                png = t / f"scales{i}_{step}.png"
                args: tuple[Any, ...] = (
                    run.numerics,
                    step,
                    chart_formats(run),
                    png,
                    f"{run.name}: tensor scales {label} (step {step})",
                )
                parts += [
                    f"<h3>Tensor scales {label} (step {step})</h3>",
                    image(plot_scale_chart, args, png, f"{run.name} scales {label}"),
                ]
            if steps:
                last = steps[-1]
                if detail:
                    # the tensors with most values below the smallest normal of the format
                    # they are stored in; a run whose format was not tracked (FP32): of any
                    # tracked format, i.e. its smallest tensors
                    own = bool(judged_formats(run))
                    ranked = worst(run, last, "below_normal", own=own)
                    most = list(dict.fromkeys((r["name"], r["kind"]) for _, _, r in ranked))[:6]
                    png = t / f"hist{i}.png"
                    args = (run.numerics, last, most, chart_formats(run), png)
                    what = "most underflowing" if own else "smallest"
                    parts += [
                        f"<h3>Exponent histograms of the {what} tensors (step {last})</h3>",
                        image(plot_exp_histograms, args, png, f"{run.name} exponent histograms"),
                    ]
                parts.append(tensor_table(run, last, "below_normal", "Most underflow"))
                parts.append(tensor_table(run, last, "above_max", "Most overflow"))
            parts.append("</div>")
        _draw(figures, t)
        body = "\n".join(parts)
        for k, (png, alt) in enumerate(images):
            body = body.replace(f"\0img{k}\0", _img(png, alt), 1)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<link rel="icon" href="data:,">'
        f"<title>{html.escape(title or 'lowprec report')}</title><style>{_CSS}</style>"
        "</head><body>" + body + "</body></html>"
    )
