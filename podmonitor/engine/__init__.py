"""The numerical engine: pure torch, no Lightning (METHOD.md sections 1 to 6).

The path of the data: :class:`PODAccumulator` (``accumulator``: the running state of
``running``, the snapshots in a ``store``, within the ``budget``) -> ``analysis`` ->
:class:`PODReport` (``report``). The numerical kernels: ``lags``, ``wavelets``, ``pod``, ``sketch``,
``spectrum``, ``coherency``.
"""

from .accumulator import PODAccumulator
from .analyze import analyze
from .budget import MemoryBudgetError, estimate_memory
from .config import PODConfig, default_scales
from .report import PODReport, ScaleReport
from .sketch import FrequentDirections

__all__ = [
    "FrequentDirections",
    "MemoryBudgetError",
    "PODAccumulator",
    "PODConfig",
    "PODReport",
    "ScaleReport",
    "analyze",
    "default_scales",
    "estimate_memory",
]
