"""Smoothness of attention (METHOD.md section 8; Castin, Ablin & Peyre, "How Smooth Is Attention?").

Per attention sub-layer f (all heads, output projection, no residual) at its actual input X:

- sigma(n) = ||Df(X[:n])||_2, the local Lipschitz constant on prefixes of length n = 16, 32, ..., T,
  by matrix-free power iteration (:mod:`.lipschitz`);
- the growth exponent alpha of sigma(n) ~ c n^alpha with its R^2 (:mod:`.growth`);
- cheap companions: normalised row entropy and ||P||_2 of the attention matrix (:mod:`.companions`).

The engine (everything but :mod:`.callback`) needs only torch; the Lightning callback
:class:`SmoothnessMonitor` is imported lazily.
"""

from .companions import AttentionCompanions, attention_companions, cesaro_matrix, cesaro_norm, row_entropy
from .growth import GrowthFit, growth_exponent, prefix_grid
from .lipschitz import PowerIterationResult, exact_jacobian_norm, jacobian_spectral_norm, prefix_lipschitz
from .measure import LayerSmoothness, measure_module, measure_sublayer
from .sublayers import AttentionSublayer, BoundSublayer, InputCapture, find_attention_sublayers

__all__ = [
    "AttentionCompanions",
    "AttentionSublayer",
    "BoundSublayer",
    "GrowthFit",
    "InputCapture",
    "LayerSmoothness",
    "PowerIterationResult",
    "SmoothnessMonitor",
    "SmoothnessMonitorWarning",
    "attention_companions",
    "cesaro_matrix",
    "cesaro_norm",
    "exact_jacobian_norm",
    "find_attention_sublayers",
    "growth_exponent",
    "jacobian_spectral_norm",
    "measure_module",
    "measure_sublayer",
    "prefix_grid",
    "prefix_lipschitz",
    "row_entropy",
]


def __getattr__(name: str):
    # The callback needs Lightning: import it only when asked.
    if name in ("SmoothnessMonitor", "SmoothnessMonitorWarning"):
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'podmonitor.smoothness' has no attribute {name!r}")
