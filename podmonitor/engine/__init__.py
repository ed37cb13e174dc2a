"""The numerical engine: pure torch, no Lightning (METHOD.md sections 1 to 6)."""

from .accumulator import MemoryBudgetError, PODAccumulator, estimate_memory
from .analyze import analyze
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
