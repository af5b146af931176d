"""torch's launcher as ``lowprec train --nproc-per-node N`` starts it.

``python -m lowprec.cli.torchrun ARGS`` is ``python -m torch.distributed.run ARGS``, except
that it ends without a traceback of its own:

* a SIGINT or SIGTERM that stops the run ends the launcher with status 128 + the signal's
  number (the workers have reported the interruption on their own: rank 0's one line);
* a worker that fails (torch's ``ChildFailedError``) ends it with the first failed
  worker's status (128 + the signal's number for one killed by a signal). Rank 0 reports
  an error of the run in its own ``error:`` line; where the first worker to fail is
  another rank, or one killed by a signal, the launcher adds one ``error:`` line naming
  it, its status and its pid. torch's launcher logs (its WARNING/ERROR lines about
  stopping the other workers) are silenced unless ``LOGLEVEL`` is set, torch's own
  setting for them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

__all__ = ["main"]


def _failure_line(rank: int, exitcode: int, pid: int) -> str:
    """The launcher's one line for the first failed worker."""
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with status {exitcode}"
    hint = "" if exitcode < 0 else " (LOWPREC_TRACEBACK=1 prints each rank's traceback)"
    return f"lowprec: error: worker rank {rank} (pid {pid}) {how}{hint}"


def _quiet_launcher_logs() -> None:
    """Only CRITICAL records from torch's launcher loggers (``torch.distributed.elastic.*``):
    its WARNING and ERROR lines about stopping the other workers repeat what the failure
    line says."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    """Run torch's launcher with ``argv`` (default: the command line); its exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as run

    if "LOGLEVEL" not in os.environ:  # torch's own setting of its launcher's logging
        _quiet_launcher_logs()
    try:
        run(sys.argv[1:] if argv is None else argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = int(failure.exitcode)
        if rank != 0 or code < 0:  # rank 0's own errors are its one line already
            print(_failure_line(int(rank), code, int(failure.pid)), file=sys.stderr)
        return 128 - code if code < 0 else (code or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
