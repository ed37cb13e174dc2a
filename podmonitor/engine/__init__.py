"""The numerical engine: pure torch, no Lightning (METHOD.md sections 1 to 6).

The path of the data: :class:`PODAccumulator` (``accumulator``: the running state of
``running``, the snapshots in a ``store``, within the ``budget``) -> ``analysis`` ->
:class:`PODReport` (``report``). The numerical kernels: ``lags``, ``wavelets``, ``pod``, ``sketch``,
``spectrum``, ``coherency``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


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
