"""podmonitor: watch the attention of a transformer while it trains (scale-selective POD)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names

if TYPE_CHECKING:
    from .callback import PODMonitor, PODMonitorWarning
    from .engine import (
        FrequentDirections,
        MemoryBudgetError,
        PODAccumulator,
        PODConfig,
        PODReport,
        ScaleReport,
        analyze,
        estimate_memory,
    )
    from .pruning import HeadPruning
    from .smoothness.callback import SmoothnessMonitor, SmoothnessMonitorWarning

__version__ = "0.1.0.dev0"


#: Where each public name lives. Every name is imported when first asked for: the callbacks need
#: Lightning, so the engine stays usable (and quick to import) without it, and ``import podmonitor``
#: alone loads neither torch nor Lightning (the picture process imports the report classes and
#: matplotlib only).
_LAZY = {
    **dict.fromkeys(("FrequentDirections", "MemoryBudgetError", "PODAccumulator", "PODConfig", "PODReport",
                     "ScaleReport", "analyze", "estimate_memory"), "engine"),
    **dict.fromkeys(("PODMonitor", "PODMonitorWarning"), "callback"),
    **dict.fromkeys(("SmoothnessMonitor", "SmoothnessMonitorWarning"), "smoothness.callback"),
    "HeadPruning": "pruning",
}

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())

__all__ = [
    "FrequentDirections",
    "HeadPruning",
    "MemoryBudgetError",
    "PODAccumulator",
    "PODConfig",
    "PODMonitor",
    "PODMonitorWarning",
    "PODReport",
    "ScaleReport",
    "SmoothnessMonitor",
    "SmoothnessMonitorWarning",
    "analyze",
    "estimate_memory",
    "__version__",
]
