"""Early pruning decisions from the monitor's numbers (METHOD.md section 7).

Data flows one way, as in the rest of podmonitor: the per-head fields feed
:mod:`.redundancy` (similarity of heads over the ensemble); the reports and the redundancy feed
:mod:`.advisor` (heads per layer now, recommended under the same budget, heads to drop first);
:mod:`.readiness` tracks how much the POD subspaces, H* and the advice still move between
validation runs; :mod:`.callback` (:class:`HeadPruning`, needs Lightning) acts on the advice with
:mod:`.masking` (reversible head masks). :mod:`.importance` is the gradient-based baseline of
Michel et al. 2019.
"""

from .advisor import (
    AdviceSettings,
    HeadAllocationAdvice,
    HeadDrop,
    LayerAdvice,
    LayerEvidence,
    advise_from_reports,
    advise_head_allocation,
    evidence_from_reports,
)
from .importance import lowest_importance_heads, michel_head_importance, sequence_losses
from .masking import HeadMasker
from .readiness import AdviceReadiness, principal_angles, subspace_drift
from .redundancy import HeadRedundancy, HeadRedundancyAccumulator


def __getattr__(name: str):
    # the callback needs Lightning and imports podmonitor.callback: import it only when asked
    if name in ("HeadPruning", "PruningWarning", "random_heads"):
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'podmonitor.pruning' has no attribute {name!r}")


__all__ = [
    "AdviceReadiness",
    "AdviceSettings",
    "HeadAllocationAdvice",
    "HeadDrop",
    "HeadMasker",
    "HeadPruning",
    "HeadRedundancy",
    "HeadRedundancyAccumulator",
    "LayerAdvice",
    "LayerEvidence",
    "PruningWarning",
    "advise_from_reports",
    "advise_head_allocation",
    "evidence_from_reports",
    "lowest_importance_heads",
    "michel_head_importance",
    "principal_angles",
    "random_heads",
    "sequence_losses",
    "subspace_drift",
]
