"""pytest, for the whole repository: the adapters of ``lowprec.integrations`` are collected
(imported for their doctests) only where their optional dependency is installed
(``pip install 'lowprec[hf]'`` / ``'lowprec[lightning]'``; the test and dev extras install
both, and their tests in ``tests/integrations`` skip without them)."""

from __future__ import annotations

import importlib.util

collect_ignore = [
    f"lowprec/integrations/{module}.py"
    for module, dependency in (("transformers", "transformers"), ("lightning", "lightning"))
    if importlib.util.find_spec(dependency) is None
]
