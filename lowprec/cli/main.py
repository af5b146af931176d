"""The ``lowprec`` command line tool.

Each subcommand is one ``_add_<name>(subparsers)`` function that builds its parser and
sets ``handler`` (a ``_Handler``) with ``set_defaults``; :data:`_COMMANDS` lists them in
the order they appear in ``--help``. A handler returns the exit code and reports bad
arguments with ``args.parser.error(...)`` (exit code 2, like argparse itself).

Example:
    $ lowprec formats
    $ lowprec formats --snr snr.png --formats fp16 e4m3fn --kmin -20 --kmax 20
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from difflib import get_close_matches
from pathlib import Path
from typing import TextIO, TypeAlias

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table

from lowprec import __version__
from lowprec._startup import end_startup_guard, run_then_guard, signal_of
from lowprec.analysis.snr import (
    SNR_DEFAULT_FORMATS,
    SNR_WINDOW_DB,
    SnrCurve,
    plot_snr,
    snr_sweep,
)
from lowprec.cli.args import path_arg
from lowprec.cli.jobs import add_demo, add_recipes, add_report, add_train
from lowprec.cli.tune import add_tune
from lowprec.core.formats import Format, format_names, get_format
from lowprec.jobs.interrupts import Interrupted, exit_code
from lowprec.jobs.rundir import RunNote, output_problem
from lowprec.jobs.train import NonFiniteError

__all__ = ["build_parser", "main"]

_Handler = Callable[[argparse.Namespace], int]
_SubParsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

_K_LIMIT = 200  # wider than every format's range (2^±150); keeps Σx² finite and non-zero


# ---------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------


def _console() -> Console:
    """A rich console on the current ``sys.stdout`` (plain text when it is not a tty)."""
    return Console(file=sys.stdout, highlight=False)


def _print_wide(console: Console, renderable: RenderableType) -> None:
    """Print ``renderable`` without squeezing it to 80 columns when stdout is not a tty."""
    if not console.is_terminal:
        wide = console.options.update_width(1000)
        needed = Measurement.get(console, wide, renderable).maximum
        console.width = max(console.width, needed)
    console.print(renderable)


def _num(x: float) -> str:
    """A format constant, readably: integers as such (``448``, ``57344``), other powers of
    two as ``2^-9``, anything else with three significant digits (``15.5``, ``3.4e+38``)."""
    if not math.isfinite(x):
        return str(x)
    if x == int(x) and abs(x) < 1e6:
        return str(int(x))
    mantissa, exponent = math.frexp(x)
    if mantissa == 0.5:
        return f"2^{exponent - 1}"
    return f"{x:.3g}"


def _format_list(text: str) -> list[Format]:
    """argparse ``type`` for ``--formats``: one name or a comma-separated list of names."""
    try:
        return [get_format(name) for name in text.split(",") if name.strip()]
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("name: ")) from None


# ---------------------------------------------------------------------------------------
# lowprec formats
# ---------------------------------------------------------------------------------------


def _add_formats(subparsers: _SubParsers) -> None:
    """``lowprec formats [--snr PATH] [--formats ...] [--kmin K] [--kmax K]``."""
    p = subparsers.add_parser(
        "formats",
        help="table of the built-in number formats; optional SNR-vs-scale plot",
        description="Print every built-in format with its range and precision. With --snr, "
        "also plot the SNR of a unit normal tensor times 2^k rounded into each format, "
        "and print each format's peak SNR and usable window (k within "
        f"{SNR_WINDOW_DB:g} dB of the peak).",
    )
    p.add_argument("--snr", type=path_arg, metavar="PATH.png", help="write the SNR plot here")
    p.add_argument(
        "--formats",
        type=_format_list,
        nargs="+",
        action="extend",
        metavar="NAME",
        help=f"formats for --snr (names or comma lists; default {' '.join(SNR_DEFAULT_FORMATS)})",
    )
    p.add_argument("--kmin", type=int, help="smallest scale exponent k for --snr (default -30)")
    p.add_argument("--kmax", type=int, help="largest scale exponent k for --snr (default 30)")
    p.set_defaults(handler=_run_formats, parser=p)


def _run_formats(args: argparse.Namespace) -> int:
    """Handler of ``lowprec formats``: validate, print the table, then the optional sweep."""
    parser: argparse.ArgumentParser = args.parser
    snr_only = [f"--{n}" for n in ("formats", "kmin", "kmax") if getattr(args, n) is not None]
    if args.snr is None and snr_only:
        parser.error(f"{'/'.join(snr_only)}: only used together with --snr PATH")
    kmin = -30 if args.kmin is None else args.kmin
    kmax = 30 if args.kmax is None else args.kmax
    if not -_K_LIMIT <= kmin <= kmax <= _K_LIMIT:
        parser.error(
            f"--kmin/--kmax: need -{_K_LIMIT} <= kmin <= kmax <= {_K_LIMIT}, "
            f"got kmin={kmin}, kmax={kmax}"
        )
    if args.snr is not None:
        _check_snr_path(parser, args.snr)  # before anything is printed
    console = _console()
    _print_wide(console, _formats_table())
    if args.snr is None:
        return 0
    groups: list[list[Format]] = args.formats or [list(map(get_format, SNR_DEFAULT_FORMATS))]
    fmts = list(dict.fromkeys(f for group in groups for f in group))  # in order, no repeats
    curves = snr_sweep(fmts, range(kmin, kmax + 1))
    plot_snr(curves, args.snr)
    console.print()
    _print_wide(console, _snr_table(curves))
    console.print(
        f"usable window: the k within {SNR_WINDOW_DB:g} dB of the peak SNR "
        "and width counts them (* = the window reaches the edge of the sweep)"
    )
    console.print(f"wrote {args.snr}")
    return 0


def _check_snr_path(parser: argparse.ArgumentParser, path: Path) -> None:
    """Exit with a usage error naming ``--snr`` unless ``path`` ends in a suffix that
    matplotlib's Agg canvas writes (``.png``, ``.pdf``, ``.svg``, ...) and its folder
    takes the file (a missing folder is created by the plot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    kinds = sorted(FigureCanvasAgg.get_supported_filetypes())
    if path.suffix.lower().removeprefix(".") not in kinds:
        parser.error(
            f"--snr: {path} must end in a format matplotlib writes ({', '.join(kinds)}), "
            f"got {path.suffix or 'no suffix'}"
        )
    problem = output_problem(path)
    if problem is not None:
        parser.error(f"--snr: {problem}")


def _formats_table() -> RenderableType:
    """One row per built-in format: its encoding, range, precision and torch dtype."""
    table = Table(title="lowprec built-in formats", title_justify="left")
    for header in (
        "name",
        "bits",
        "E",
        "M",
        "bias",
        "special",
        "max",
        "min normal",
        "min subnormal",
        "epsilon",
        "binades",
        "torch dtype",
    ):
        numeric = header in (
            "bits",
            "E",
            "M",
            "bias",
            "max",
            "min normal",
            "min subnormal",
            "epsilon",
            "binades",
        )
        table.add_column(header, justify="right" if numeric else "left", no_wrap=True)
    for name in format_names():
        f = get_format(name)
        dtype = f.torch_dtype
        table.add_row(
            f.name,
            str(f.total_bits),
            str(f.exponent_bits),
            str(f.mantissa_bits),
            str(f.bias),
            f.special + ("" if f.signed else ", unsigned"),
            _num(f.max),
            _num(f.min_normal),
            _num(f.min_subnormal),
            _num(f.epsilon),
            f"{f.binades:.1f}",
            "-" if dtype is None else str(dtype).removeprefix("torch."),
        )
    return table


def _snr_table(curves: Sequence[SnrCurve]) -> RenderableType:
    """Peak SNR and usable window of each curve."""
    table = Table(title="SNR (dB) of N(0,1) * 2^k rounded", title_justify="left")
    for header in ("format", "peak SNR (dB)", "usable k from", "to", "width"):
        table.add_column(header, justify="left" if header == "format" else "right")
    for c in curves:
        lo, hi = c.window
        edge = "*" if lo == c.ks[0] or hi == c.ks[-1] else ""
        table.add_row(c.fmt.name, f"{c.peak:.2f}", str(lo), str(hi), f"{hi - lo + 1}{edge}")
    return table


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------

_COMMANDS: tuple[Callable[[_SubParsers], None], ...] = (
    add_demo,
    add_train,
    add_tune,
    add_report,
    add_recipes,
    _add_formats,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``lowprec`` argument parser with every subcommand of :data:`_COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="lowprec",
        description="Train neural networks in low-precision formats and see the numerics.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``lowprec`` with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    Usage errors raise ``SystemExit(2)`` with a message on stderr, as argparse does. Every
    other failure is one line on stderr, ``lowprec COMMAND: error: ...``, never a
    traceback (set ``LOWPREC_TRACEBACK=1`` to see one), and ``SystemExit``: code 2 for a bad run
    directory or argument (:class:`~lowprec.jobs.rundir.RunError`, ``ValueError``,
    ``TypeError``), 1 for anything else (a file-system error, a run that stopped on
    Inf/NaN). An interrupted job exits with ``128 + signal`` (130 for Ctrl-C, 143 for
    SIGTERM, which a command process treats as a Ctrl-C: :mod:`lowprec._startup`): a job's
    own ``interrupted (...)`` line, or, for a signal it did not handle, ``aborted; run
    directories keep their last checkpoint`` (``train``, ``demo``) or ``interrupted
    (SIGINT)`` (the other commands). In the command's own process a Ctrl-C or SIGTERM
    after this returns ends it at once, quietly, with 130 / 143
    (:func:`lowprec._startup.run_then_guard`). Notes
    about repaired run files (:class:`~lowprec.jobs.rundir.RunNote`) print as
    ``note: ...``, lowprec's logged warnings as ``warning: ...``.
    """
    # A Ctrl-C from the end of the command's own handlers on: a quiet exit, never a traceback
    return run_then_guard(lambda: _main(argv))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an argument no parser knows is reported by the subcommand's parser
    (its usage, and the nearest flag it has), not the top-level one."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        sub: argparse.ArgumentParser = getattr(args, "parser", parser)
        flags = [s for a in sub._actions for s in a.option_strings if s.startswith("--")]
        near = [
            m
            for x in extras
            if x.startswith("--")
            for m in get_close_matches(x.split("=", 1)[0], flags, n=1)
        ]
        hint = f" (did you mean {' / '.join(dict.fromkeys(near))}?)" if near else ""
        sub.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    return args


def _main(argv: list[str] | None) -> int:
    args = _parse(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for a relaunch (torchrun)
    handler: _Handler = args.handler
    prog = f"lowprec {args.command}"
    try:  # the outer handler also catches a second Ctrl-C while the first is reported
        end_startup_guard()  # from here a Ctrl-C is a KeyboardInterrupt handled below
        try:
            with warnings.catch_warnings(), _log_lines():
                warnings.showwarning = _show_warning
                return handler(args)
        except Interrupted as e:
            if not _other_rank():
                print(f"{prog}: {e}", file=sys.stderr)
            return exit_code(e.signum)
        except Exception as e:
            if _during_abort(e):  # cleanup failed while a second Ctrl-C unwound: an abort
                raise KeyboardInterrupt from e
            if os.environ.get("LOWPREC_TRACEBACK"):
                raise
            if not _other_rank():
                print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
            usage = isinstance(e, (ValueError, TypeError)) and not isinstance(e, NonFiniteError)
            raise SystemExit(2 if usage else 1) from None
    except KeyboardInterrupt as e:
        signum = signal_of(e)
        print(f"{prog}: {_abort_line(args.command, signum)}", file=sys.stderr)
        return exit_code(signum)


# The commands that train into run directories: an abort leaves each at its last checkpoint.
_TRAINING = ("train", "demo")


def _abort_line(command: str, signum: int) -> str:
    """What a Ctrl-C (or SIGTERM) that the command did not turn into its own
    :class:`~lowprec.jobs.interrupts.Interrupted` message did: a training command's run
    directories keep their last checkpoint (the second of a double Ctrl-C); any other
    command was just interrupted (its outputs are written atomically, or not at all)."""
    if command in _TRAINING:
        return "aborted; run directories keep their last checkpoint"
    return f"interrupted ({signal.Signals(signum).name})"


def _other_rank() -> bool:
    """Whether this is a worker of ``torchrun`` other than rank 0 (which reports for all:
    every rank reaches the same error or interruption)."""
    return os.environ.get("RANK", "0") != "0"


def _during_abort(e: BaseException) -> bool:
    """Whether ``e`` was raised while a ``KeyboardInterrupt`` was being handled (a mode or
    context manager whose exit fails as the abort unwinds through it)."""
    seen: set[int] = set()
    c = e.__context__
    while c is not None and id(c) not in seen:
        if isinstance(c, KeyboardInterrupt):
            return True
        seen.add(id(c))
        c = c.__context__
    return False


def _one_line(e: BaseException) -> str:
    """``e`` as one line: its message (an ``OSError``'s reason and file; the type added
    where the message alone would not say what failed)."""
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror + (f": {e.filename}" if e.filename else "")
    else:
        text = str(e) or type(e).__name__
    if not isinstance(e, (ValueError, TypeError, OSError)):
        text = f"{type(e).__name__}: {text}"
    return " ".join(text.split())


class _LineHandler(logging.Handler):
    """A lowprec log record at WARNING or above as one line on the current ``sys.stderr``:
    ``warning: ...`` / ``error: ...``; rank 0's only under ``torchrun``."""

    def emit(self, record: logging.LogRecord) -> None:
        if _other_rank():  # rank 0 reports for all (every rank logs the same)
            return
        try:
            text = " ".join(record.getMessage().split())
            print(f"{record.levelname.lower()}: {text}", file=sys.stderr)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _log_lines() -> Iterator[None]:
    """The ``lowprec`` loggers' warnings and errors as ``warning: ...`` lines while a
    command runs (without a handler, Python printed the bare message)."""
    log = logging.getLogger("lowprec")
    handler = _LineHandler(logging.WARNING)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Warnings as one line on stderr: ``note: ...`` for a repaired run file; rank 0's only
    under ``torchrun`` (every rank warns the same)."""
    if _other_rank():
        return
    kind = "note" if issubclass(category, RunNote) else category.__name__
    print(f"{kind}: {message}", file=sys.stderr)
