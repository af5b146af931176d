"""``python -m lowprec``: the same as the ``lowprec`` console script."""

import sys

from lowprec.cli import main

if __name__ == "__main__":
    sys.exit(main())
