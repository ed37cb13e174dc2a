"""The JSON conversions (PODReport.to_dict's ``_jsonable`` and the JSON-lines ``strict_jsonable``)
against a literal walk: every entry visited, non-finite floats -> None, tensors and numpy values ->
Python ones. Their fast paths (whole arrays at once, rows of plain floats) must give the same
values."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

from podmonitor.engine.report import _jsonable
from podmonitor.reporting.sinks import strict_jsonable


def literal(x: Any) -> Any:
    """The definition, entry by entry."""
    if isinstance(x, torch.Tensor):
        return literal(x.detach().cpu().tolist())
    if isinstance(x, (np.ndarray, np.generic)):
        return literal(x.tolist())
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): literal(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [literal(v) for v in x]
    return x


def _cases() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    field = torch.rand(6, 9, generator=g, dtype=torch.float64)
    holes = field.clone()
    holes[1, 2], holes[3, 0], holes[5, 8] = math.nan, math.inf, -math.inf
    return {
        "finite float64": field,
        "finite float32": field.float(),
        "non-finite": holes,
        "non-finite float32": holes.float(),
        "integers": torch.arange(12).reshape(3, 4),
        "booleans": field > 0.5,
        "0-dim": torch.tensor(math.nan),
        "numpy finite": field.numpy(),
        "numpy non-finite": holes.numpy(),
        "numpy integers": np.arange(5, dtype=np.int32),
        "numpy scalars": [np.float64(math.inf), np.float32(0.25), np.int64(3)],
        "rows of plain floats": [[0.5, math.nan, 2.0], [math.inf, 1.0, -0.0], []],
        "mixed": {"a": [1, 0.5, None, "x", True], 0.1: (math.nan, 2.0), "t": holes[:2], "empty": []},
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_json_conversions_give_the_literal_walks_values(case):
    value = _cases()[case]
    expected = literal(value)
    for convert in (_jsonable, strict_jsonable):
        got = convert(value)
        assert got == expected
        # the same text: types too (1 and 1.0, True and 1 compare equal in Python)
        assert json.dumps(got, allow_nan=False) == json.dumps(expected, allow_nan=False)
