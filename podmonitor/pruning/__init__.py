"""Early pruning decisions, measured (METHOD.md section 7).

Importance is measured, not inferred: :mod:`.heads` removes heads temporarily (head gates for the
reference models, Hugging Face models, ``nn.MultiheadAttention``, SDPA models and hand-written
attention); :mod:`.ablation` measures the damage of removing heads on validation batches (forward
passes, label-free KL by default; greedy refinement; Michel et al.'s first-order estimate);
:mod:`.probe` (:class:`HeadImportanceProbe`, an extra of PODMonitor) does it on the monitored
validation runs and publishes the advice, the POD statistics beside it with their rank
correlation to the measured damage, and the readiness (:class:`RankingReadiness`, stability of
the ranking between runs). :class:`HeadPruning` (:mod:`.callback`, needs Lightning) acts on the
measured advice with :mod:`.masking` (reversible head masks) and logs the damage right after.

The POD side stays as evidence: :mod:`.redundancy` (similarity of heads over the ensemble),
:mod:`.advisor` (the H*-based head allocation: a hypothesis, shown with its measured
correlation), :mod:`.readiness` (drift of POD subspaces, H* and that advice between runs), and
:mod:`.importance` (Michel et al. 2019 for the reference models). :mod:`.allocation`
(:class:`HeadAllocationExtra`, the extra that ``PODMonitor(per_head=True)`` adds) runs the first
three on the monitored validation runs and publishes them.
"""

from .ablation import (
    Measurer,
    first_order_importance,
    greedy_drop_order,
    single_head_damage,
    spearman,
)
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
from .allocation import HeadAllocationExtra, allocation_outputs
from .heads import HeadGates
from .importance import lowest_importance_heads, michel_head_importance, sequence_losses
from .masking import HeadMasker
from .probe import HeadImportanceProbe, HeadToDrop, MeasuredAdvice
from .readiness import AdviceReadiness, RankingReadiness, principal_angles, subspace_drift
from .redundancy import HeadRedundancy, HeadRedundancyAccumulator


def __getattr__(name: str):
    # the callback needs Lightning and imports podmonitor.callback: import it only when asked
    if name in ("HeadPruning", "PruningWarning", "random_heads", "latest_measured_advice"):
        from . import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'podmonitor.pruning' has no attribute {name!r}")


__all__ = [
    "AdviceReadiness",
    "AdviceSettings",
    "HeadAllocationAdvice",
    "HeadAllocationExtra",
    "HeadDrop",
    "HeadGates",
    "HeadImportanceProbe",
    "HeadMasker",
    "HeadPruning",
    "HeadRedundancy",
    "HeadRedundancyAccumulator",
    "HeadToDrop",
    "LayerAdvice",
    "LayerEvidence",
    "MeasuredAdvice",
    "Measurer",
    "PruningWarning",
    "RankingReadiness",
    "advise_from_reports",
    "advise_head_allocation",
    "allocation_outputs",
    "evidence_from_reports",
    "first_order_importance",
    "greedy_drop_order",
    "lowest_importance_heads",
    "michel_head_importance",
    "principal_angles",
    "random_heads",
    "sequence_losses",
    "single_head_damage",
    "spearman",
    "subspace_drift",
]
