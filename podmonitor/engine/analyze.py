"""One-shot analysis: :func:`analyze`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported when called: ``podmonitor.engine`` loads without torch)
    import numpy as np
    from torch import Tensor

    from .config import PODConfig
    from .report import PODReport


def analyze(fields: Tensor | np.ndarray, config: PODConfig | None = None) -> PODReport:
    """Scale-selective POD of one layer's ensemble of attention fields.

    Args:
        fields: (N, L, L) post-softmax attention probabilities of one layer (rows are queries),
            head-averaged or of one head; torch tensor (any device) or numpy array.
        config: engine settings (default :class:`PODConfig`).

    Returns:
        :class:`PODReport`. Data problems (too few snapshots, zero variance, a sequence too short
        for the scale grid, NaN/Inf snapshots) give a flagged report (``report.status``,
        ``report.messages``) rather than an exception.

    Raises:
        ValueError, TypeError: malformed input (not (N, L, L), not square, not real).

    Example:
        >>> from podmonitor import analyze, PODConfig
        >>> report = analyze(fields, config=PODConfig())
        >>> report.dominant_scales, report.t_spec, report.effective_rank[0.1]
    """
    from .accumulator import PODAccumulator

    acc = PODAccumulator(config)
    acc.update(fields)
    return acc.compute()
