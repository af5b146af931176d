"""``lowprec train --parallel fsdp|ddp`` and ``--nproc-per-node N``.

Under ``torchrun`` (``torchrun --nproc-per-node N -m lowprec train --parallel fsdp ...``)
every worker runs the same command: :func:`setup` starts the process group (gloo on CPU,
nccl on CUDA) and agrees on the run directory. ``lowprec train --nproc-per-node N ...``
is a convenience that starts torch's own launcher, ``python -m torch.distributed.run
--standalone --nproc-per-node N -m lowprec train ...`` (:func:`launch`); multi-node runs
use ``torchrun`` directly, with its usual flags.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from lowprec.cli.args import int_arg
from lowprec.distributed import env
from lowprec.distributed.parallel import PARALLEL
from lowprec.jobs.interrupts import exit_code

__all__ = ["add_options", "launch", "setup"]


def add_options(p: argparse.ArgumentParser) -> None:
    """``--parallel`` and ``--nproc-per-node`` of ``lowprec train``."""
    p.add_argument(
        "--parallel",
        choices=PARALLEL,
        default=None,
        help="data parallelism over the processes of torchrun: fsdp (FSDP2, FP32 shards are "
        "the master weights, low-precision all-gather) or ddp; --batch-size is the global "
        "batch; see docs/distributed.md",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int_arg(1),
        default=None,
        metavar="N",
        help="start N processes on this machine with torch's launcher "
        "(torch.distributed.run --standalone); needs --parallel",
    )


def default_out(recipe: str) -> Path:
    return Path("runs") / f"{recipe}-{datetime.now():%Y%m%d-%H%M%S}"


def _without_nproc(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Run ``lowprec <argv>`` (without ``--nproc-per-node``) under
    ``torch.distributed.run`` with ``args.nproc_per_node`` processes; the exit code.

    The launcher runs in its own session, so that Ctrl-C reaches it once: it forwards
    the signal to each worker, which finishes its step, checkpoints and exits with
    128 + signal, as one process does."""
    parser: argparse.ArgumentParser = args.parser
    if args.parallel is None:
        parser.error("--nproc-per-node needs --parallel fsdp or --parallel ddp")
    if env.launched():
        parser.error("--nproc-per-node: already running under torchrun; drop it")
    rest = _without_nproc(argv)
    if args.out is None:  # one directory for every rank
        rest += ["--out", str(default_out(args.recipe))]
    cmd = [sys.executable, "-m", "lowprec.cli.torchrun", "--standalone"]  # torch's, quiet
    cmd += ["--nproc-per-node", str(args.nproc_per_node), "-m", "lowprec", *rest]
    proc = subprocess.Popen(cmd, start_new_session=True)
    got: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if not got:
            proc.send_signal(signum)
        got.append(signum)

    old: dict[int, Any] = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got and rc != 0:
        return exit_code(got[0])
    return rc


def setup(args: argparse.Namespace) -> Path:
    """Start the process group of a ``torchrun`` worker (``--parallel``) and return the
    run directory every rank agrees on (rank 0's)."""
    parser: argparse.ArgumentParser = args.parser
    if args.parallel is None:
        if env.launched() and int(os.environ["WORLD_SIZE"]) > 1:
            parser.error("under torchrun, pass --parallel fsdp or --parallel ddp")
        return Path(args.out or default_out(args.recipe))
    if not env.launched():
        parser.error(
            "--parallel: start with torchrun --nproc-per-node N -m lowprec train ..., or "
            "add --nproc-per-node N"
        )
    env.init()
    return Path(env.on_main(lambda: str(args.out or default_out(args.recipe))))
