"""HeadImportanceProbe through PODMonitor in a real Trainer: measured damage, advice, logged outputs.

The reference for the damage is the KL divergence of the model's next-token distributions with the
head masked by hand (its slice of the output projection's weight zeroed in a copy), computed with
numpy on the same probe batches; a planted dead head (zero output projection) must come first.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from podmonitor import PODMonitor
from podmonitor.pruning import HeadImportanceProbe
from tests.pruning.test_ablation import kl_by_hand
from tests.pruning.test_pruning_callback import FAST, loaders, small_model, trainer


def test_probe_in_a_trainer_measures_the_damage_of_each_head_and_names_the_dead_one_first(tmp_path):
    model = small_model()  # 2 layers x 3 heads, width 12
    hd = 12 // 3
    with torch.no_grad():
        model.model.transformer.h[1].attn.c_proj.weight[:, 2 * hd:3 * hd] = 0  # layer 1 head 2 does nothing
    train, val = loaders()
    probe = HeadImportanceProbe()  # defaults: 2 probe batches, KL, every monitored run
    monitor = PODMonitor(config=FAST, n_snapshots=16, extras=[probe], output_dir=str(tmp_path / "pod"))
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    tr = trainer(tmp_path, [monitor], logger=logger, max_steps=1)
    tr.validate(model, val)

    advice = probe.last_advice
    assert advice is not None and advice.damage_kind == "kl" and advice.n_sequences == 16
    damage = np.array(advice.damage)  # (L, H)
    assert damage[1, 2] == 0.0 and np.all(np.delete(damage.flatten(), 5) > 1e-7)
    first = advice.drop_order[0]
    assert (first.layer_index, first.head) == (1, 2)

    # the same numbers by hand: KL of the hand-masked copy on the first 2 validation batches
    probe_batches = [b for _, b in zip(range(2), val, strict=False)]
    net = model.model.eval()
    with torch.no_grad():
        for i in range(2):
            for h in range(3):
                twin = copy.deepcopy(net)
                twin.transformer.h[i].attn.c_proj.weight[:, h * hd:(h + 1) * hd] = 0
                kl = np.concatenate([kl_by_hand(net(x)[0].numpy(), twin(x)[0].numpy()) for x, _ in probe_batches])
                assert math.isclose(damage[i, h], float(kl.mean()), rel_tol=1e-4, abs_tol=1e-9), (i, h)
    assert advice.cost["forward_passes"] == 2 * (1 + 6)

    # logged: the per-head damage scalars on TensorBoard and the entry in the JSON-lines record
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    head_tags = [t for t in tags if t.startswith("pod/importance/") and "/head_" in t]
    assert len(head_tags) == 6
    records = [json.loads(line) for line in Path(tmp_path / "pod").rglob("*.jsonl").__next__().read_text().splitlines()]
    assert any("head_importance" in json.dumps(r) or "drop_order" in json.dumps(r) for r in records)
