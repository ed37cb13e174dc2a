"""Fixtures for the capture tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from torch import nn

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hooks_left(module: nn.Module) -> list[str]:
    """``"path.dict"`` for every non-empty hook dictionary of ``module`` and its submodules."""
    return [
        f"{path or '<root>'}.{attr}"
        for path, sub in module.named_modules()
        for attr in _HOOK_DICTS
        if getattr(sub, attr, None)
    ]


@pytest.fixture
def assert_no_hooks() -> Callable[[nn.Module], None]:
    def check(module: nn.Module) -> None:
        left = hooks_left(module)
        assert not left, f"hooks left attached: {left}"

    return check
