"""Public names of a package imported when first asked for (PEP 562), so that importing the
package loads none of its modules: ``import podmonitor`` loads neither torch nor Lightning, and the
picture process imports the report classes and the figures without torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str],
               namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's ``__name__``.
        where: public name -> the submodule (relative to ``package``) that defines it.
        namespace: the package's ``globals()``; a name once imported is stored there, so later
            lookups do not reach ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(f".{where[name]}", package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
