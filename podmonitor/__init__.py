"""podmonitor: watch the attention of a transformer while it trains (scale-selective POD)."""

from .engine import (
    MemoryBudgetError,
    PODAccumulator,
    PODConfig,
    PODReport,
    ScaleReport,
    analyze,
    estimate_memory,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "MemoryBudgetError",
    "PODAccumulator",
    "PODConfig",
    "PODReport",
    "ScaleReport",
    "analyze",
    "estimate_memory",
    "__version__",
]
