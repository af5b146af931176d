"""Jobs: the reference model (:mod:`~lowprec.jobs.model`) and data (:mod:`~lowprec.jobs.data`),
the run directory (:mod:`~lowprec.jobs.rundir`), ``train``, ``demo`` and ``report``.

Each job is a function the CLI calls. Jobs share the run directory's layout through
:mod:`lowprec.jobs.rundir` and never import each other for it; the demo is the one
composition of jobs (``train`` per recipe, then ``report``), through their public functions.
"""
