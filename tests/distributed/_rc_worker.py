"""``torchrun ... tests/distributed/_rc_worker.py DIR train ...``: ``python -m lowprec train
...`` in a torchrun worker that also writes its exit status to ``DIR/rc.<RANK>``.

torchrun reports its own status (1 after it received a signal), not its workers'; the
interrupt test reads each worker's from these files.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lowprec.cli import main

if __name__ == "__main__":
    rc_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    (rc_dir / f"rc.{os.environ['RANK']}").write_text(str(rc))
    sys.exit(rc)
