"""podmonitor: watch the attention of a transformer while it trains (scale-selective POD)."""

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

__version__ = "0.1.0.dev0"


def __getattr__(name: str):
    # The callback needs Lightning; import it only when asked, so the engine stays usable
    # (and quick to import) without it.
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
