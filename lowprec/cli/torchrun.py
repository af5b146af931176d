"""torch's launcher as ``lowprec train --nproc-per-node N`` starts it.

``python -m lowprec.cli.torchrun ARGS`` is ``python -m torch.distributed.run ARGS``, except
that a SIGINT or SIGTERM that stops the run ends the launcher with status 128 + the
signal's number and without the traceback of torch's ``SignalException`` (the workers
have reported the interruption on their own: rank 0's one line).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run torch's launcher with ``argv`` (default: the command line); its exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as run

    try:
        run(sys.argv[1:] if argv is None else argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
