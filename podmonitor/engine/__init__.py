"""The numerical engine: pure torch, no Lightning (METHOD.md sections 1 to 6).

The path of the data: :class:`PODAccumulator` (``accumulator``: the running state of
``running``, the snapshots in a ``store``, within the ``budget``) -> ``analysis`` ->
:class:`PODReport` (``report``). The numerical kernels: ``lags``, ``wavelets``, ``pod``, ``sketch``,
``spectrum``, ``coherency``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from .analyze import analyze  # (the function, bound over the submodule of the same name; torch-free)

if TYPE_CHECKING:
    from .accumulator import PODAccumulator
    from .budget import MemoryBudgetError, estimate_memory
    from .config import PODConfig, default_scales
    from .report import PODReport, ScaleReport
    from .sketch import FrequentDirections

#: Where each public name lives. The package imports a module only when one of its names is first
#: asked for, so that ``podmonitor.engine.report`` (the report classes) can be imported without
#: torch: the picture process unpickles reports and draws them without ever loading torch.
_LAZY = {
    "PODAccumulator": "accumulator",
    "MemoryBudgetError": "budget",
    "estimate_memory": "budget",
    "PODConfig": "config",
    "default_scales": "config",
    "PODReport": "report",
    "ScaleReport": "report",
    "FrequentDirections": "sketch",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())

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
