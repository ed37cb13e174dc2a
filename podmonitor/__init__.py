"""podmonitor: watch the attention of a transformer while it trains (scale-selective POD)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


#: The engine's public names, imported from ``podmonitor.engine`` when first asked for.
_ENGINE = ("FrequentDirections", "MemoryBudgetError", "PODAccumulator", "PODConfig", "PODReport",
           "ScaleReport", "analyze", "estimate_memory")


def __getattr__(name: str) -> Any:
    # Every public name is imported when first asked for: the callbacks need Lightning, so the
    # engine stays usable (and quick to import) without it, and ``import podmonitor`` alone loads
    # neither torch nor Lightning (the picture process imports the report classes and matplotlib
    # only).
    if name in _ENGINE:
        from . import engine

        return getattr(engine, name)
    if name in ("PODMonitor", "PODMonitorWarning"):
        from . import callback

        return getattr(callback, name)
    if name in ("SmoothnessMonitor", "SmoothnessMonitorWarning"):
        from .smoothness import callback as _smoothness

        return getattr(_smoothness, name)
    if name == "HeadPruning":
        from .pruning import HeadPruning

        return HeadPruning
    raise AttributeError(f"module 'podmonitor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
