"""The ``lowprec`` command line tool: argument parsing → a job → printing.

``main(argv)`` is the entry point (``lowprec = "lowprec.cli:main"``); each subcommand's
parser and handler live beside it (:mod:`lowprec.cli.main` for ``formats``,
:mod:`lowprec.cli.jobs` for ``train``, ``demo``, ``report`` and ``recipes``). The CLI only
parses, calls a job or an analysis (the SNR sweep is :mod:`lowprec.analysis.snr`) and prints.
"""

from lowprec.analysis.snr import SNR_SAMPLES, SNR_SEED, unit_normal
from lowprec.cli.main import build_parser, main

__all__ = ["SNR_SAMPLES", "SNR_SEED", "build_parser", "main", "unit_normal"]
