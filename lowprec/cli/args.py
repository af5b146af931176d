"""argparse ``type`` callables shared by the subcommands: a flag's value checked where it
is parsed, so that a bad one is one usage line naming the flag, before any work."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from lowprec.jobs.train_config import INT_MAX

__all__ = ["int_arg", "path_arg"]


def int_arg(low: int) -> Callable[[str], int]:
    """argparse ``type`` of an int flag from ``low`` to 2^63 - 1 (the most a torch seed or
    a step count takes)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= v <= INT_MAX:
            raise argparse.ArgumentTypeError(f"must be from {low} to 2^63 - 1, got {v}")
        return v

    return parse


def path_arg(text: str) -> Path:
    """argparse ``type`` of a path flag: any path but the empty one (``Path("")`` is the
    current directory, which would be read or refused as that)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a file or directory name")
    return Path(text)
