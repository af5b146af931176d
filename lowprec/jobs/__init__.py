"""Jobs: the reference model and data, the run directory, ``train``, ``demo`` and ``report``.

Each job is a function the CLI calls; jobs share the run directory's layout
(:mod:`lowprec.jobs.rundir`) and never import each other sideways.
"""
