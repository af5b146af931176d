"""``lowprec tune``: parse the flags, run :func:`lowprec.jobs.tune.run_tune`, print the plan.

Example:
    $ lowprec tune --target b200 --out plan.json
    $ lowprec train --recipe plan.json
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.table import Table

from lowprec.autopilot import Plan
from lowprec.autopilot.cost import CANDIDATES, RATES, TARGETS, check_candidates
from lowprec.cli.args import int_arg, path_arg
from lowprec.jobs.model import model_names
from lowprec.jobs.rundir import output_problem
from lowprec.jobs.train_config import LR_MAX, TrainConfig
from lowprec.jobs.tune import TuneConfig, TuneInterrupted, check_budget, plan_rows, run_tune

__all__ = ["add_tune"]


def _number(check: Callable[[float], object], name: str) -> Any:
    """argparse ``type`` of a float flag checked by ``check`` (whose message starts with
    ``name``, which argparse gives as the flag)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        try:
            check(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{name} ")) from None
        return v

    return parse


def _candidates(text: str) -> tuple[str, ...]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"no format given; name one or more of {','.join(CANDIDATES)}"
        )
    try:
        return check_candidates(names)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("candidates: ")) from None


def add_tune(subparsers: Any) -> None:
    rates = "; ".join(
        f"{t}: " + ", ".join(f"{k} {v:g}" for k, v in r.items()) for t, r in RATES.items()
    )
    d = TuneConfig()
    p = subparsers.add_parser(
        "tune",
        help="choose a format per GEMM of each layer within an error budget (the autopilot)",
        description="Measure each linear layer's sensitivity (per GEMM: loss change, "
        "gradient error, SQNR) on a few batches, and choose per GEMM among the candidates "
        "the cheapest modelled GEMM time on --target within the error budget. Writes a "
        "plan (lowprec train --recipe PLAN.json trains with it). GEMM rates relative to "
        f"BF16: {rates}. See docs/autopilot.md.",
    )
    p.add_argument("--target", choices=TARGETS, default=d.target, help=f"default {d.target}")
    p.add_argument(
        "--out",
        type=path_arg,
        default=Path("plan.json"),
        help="the plan, a .json file (default plan.json); a missing folder is created; an "
        "existing file is kept unless --force",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.add_argument("--model", choices=model_names(), default=d.model, help=f"default {d.model}")
    for name, help_ in (
        ("width", "model width"),
        ("depth", "transformer layers"),
        ("heads", "attention heads"),
        ("seq_len", "characters per sequence"),
        ("batch_size", "sequences per tuning batch"),
        ("batches", "tuning batches"),
    ):
        default = getattr(d, name)
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int_arg(1),
            default=default,
            help=f"{help_} (default {default})",
        )
    p.add_argument(
        "--budget",
        type=_number(check_budget, "budget"),
        default=None,
        help="error budget b: relative loss change b and gradient error 10*b on the tuning "
        "batches (default: loss 0.005, gradient 0.05)",
    )
    p.add_argument(
        "--candidates",
        type=_candidates,
        default=None,
        metavar="A,B,...",
        help=f"formats to choose among (default all: {','.join(CANDIDATES)}; bf16 always)",
    )
    p.add_argument("--seed", type=int_arg(0), default=d.seed, help="default 0")
    p.add_argument(
        "--steps-before",
        type=int_arg(0),
        default=d.steps_before,
        help=f"train this many BF16 steps before measuring (default {d.steps_before})",
    )
    p.add_argument(
        "--lr",
        type=_number(lambda v: TrainConfig.check_field("lr", v), "lr"),
        default=None,
        help=f"lr of --steps-before (default {d.lr:g}; at most {LR_MAX:g}); needs --steps-before",
    )
    p.set_defaults(handler=_run_tune, parser=p)


def _interruptible(job: Callable[[], Plan], out: Path) -> Plan:
    """Run ``job``; SIGINT (Ctrl-C) or SIGTERM stops it at once with
    :class:`~lowprec.jobs.tune.TuneInterrupted` (one line, exit 128 + the signal, as
    ``lowprec train``): tuning has no checkpoint to write, and the plan is written only at
    the end, atomically (a temporary file the stop left is removed)."""

    def term(signum: int, frame: FrameType | None) -> None:
        raise TuneInterrupted(signum, str(out))

    old = None
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            old = signal.signal(signal.SIGTERM, term)
    try:
        return job()
    except TuneInterrupted:
        raise
    except KeyboardInterrupt:
        raise TuneInterrupted(signal.SIGINT, str(out)) from None
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        out.with_name(out.name + ".tmp").unlink(missing_ok=True)


def _run_tune(args: argparse.Namespace) -> int:
    # --out is checked before any work: tuning takes minutes
    if args.out.suffix.lower() != ".json":
        args.parser.error(f"--out: expected a .json file, got {args.out}")
    if args.out.is_dir():
        args.parser.error(f"--out: {args.out} is a directory; give a file name (plan.json)")
    if args.out.exists() and not args.force:
        args.parser.error(f"--out: {args.out} already exists; pass --force to overwrite it")
    problem = output_problem(args.out)
    if problem is not None:
        args.parser.error(f"--out: {problem}")
    if args.lr is not None and args.steps_before == 0:
        args.parser.error("--lr: the lr of the --steps-before steps; give --steps-before N > 0")
    try:  # the flags' combination, naming the flags (as lowprec train does)
        TrainConfig.check_together({"width": args.width, "heads": args.heads}, flags=True)
        cfg = TuneConfig(
            target=args.target,
            model=args.model,
            width=args.width,
            depth=args.depth,
            heads=args.heads,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            batches=args.batches,
            budget=args.budget,
            candidates=args.candidates,
            seed=args.seed,
            steps_before=args.steps_before,
            lr=TuneConfig().lr if args.lr is None else args.lr,
        )
    except ValueError as e:
        args.parser.error(str(e))
    console = Console(file=sys.stdout, width=160, highlight=False)
    plan = _interruptible(lambda: run_tune(cfg, args.out, say=console.print), args.out)
    table = Table(title=f"plan for {plan.target}: {args.out}", title_justify="left")
    for col in ("layer", "FLOPs", "forward", "input_grad", "weight_grad", "SQNR dB", "error"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for row in plan_rows(plan):
        table.add_row(*row)
    console.print(table)
    m = plan.measured
    console.print(
        f"modelled GEMM cost {plan.cost:.3f} of BF16 on {plan.target}; measured loss change "
        f"{100 * m['loss_delta']:.3f}%, gradient error {100 * m['grad_err']:.2f}% "
        f"({m['error']:.2f} of the budget)"
    )
    console.print(f"wrote {args.out}; train with: lowprec train --recipe {args.out}")
    return 0
