"""The autopilot: measure each linear layer's sensitivity to low-precision formats, model
each format's GEMM speed on a target GPU, and choose a format per GEMM within an error
budget (``lowprec.tune``, ``lowprec tune``; docs/autopilot.md).

* :mod:`~lowprec.autopilot.cost`: candidates, targets and their rate table, FLOPs per GEMM;
* :mod:`~lowprec.autopilot.sensitivity`: the reference and the per-GEMM measurements;
* :mod:`~lowprec.autopilot.search`: the choice, its repair and each GEMM's fallbacks;
* :mod:`~lowprec.autopilot.plan`: :class:`Plan` and :class:`Budget`, saved as JSON;
* :mod:`~lowprec.autopilot.tuner`: :func:`tune`, the entry point.
"""

from lowprec.autopilot.cost import CANDIDATES, RATES, TARGETS
from lowprec.autopilot.plan import DEFAULT_BUDGET, Budget, Plan, is_plan_dict
from lowprec.autopilot.tuner import tune

__all__ = [
    "CANDIDATES",
    "DEFAULT_BUDGET",
    "RATES",
    "TARGETS",
    "Budget",
    "Plan",
    "is_plan_dict",
    "tune",
]
