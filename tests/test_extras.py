"""PODMonitor's extra analyses (podmonitor.extras): driven on the monitored batches, published,
checkpointed, and an extra that raises costs only itself."""

from __future__ import annotations

import json
import warnings

import lightning as L
import pytest
import torch

from podmonitor import PODConfig, PODMonitor, PODMonitorWarning
from podmonitor.extras import ExtraResult, MonitorExtra
from tests.callback_models import TinyGPT


class TokenSum(MonitorExtra):
    """Sums the validation tokens it sees per run: a result with a literal reference."""

    name = "token_sum"

    def __init__(self) -> None:
        self.runs: list[int] = []
        self._sum = 0
        self._batches = 0

    def start_run(self, trainer, pl_module, monitored_index):
        self.runs.append(monitored_index)
        self._sum, self._batches = 0, 0

    def on_batch(self, trainer, pl_module, batch, batch_idx, outputs):
        assert not pl_module.training  # called inside the validation loop
        self._sum += int(batch[0].sum())
        self._batches += 1

    def gather_state(self):
        return {"sum": self._sum, "batches": self._batches}

    def compute(self, parts, context):
        total = sum(p["sum"] for p in parts)
        return ExtraResult(scalars={f"{context.prefix}/token_sum": float(total)},
                           texts={f"{context.prefix}/token_sum_text": f"sum {total}"},
                           record={"sum": total, "batches": sum(p["batches"] for p in parts),
                                   "layers": list(context.layer_names)})

    def state_dict(self):
        return {"runs": list(self.runs)}

    def load_state_dict(self, state):
        self.runs = list(state["runs"])


class Broken(MonitorExtra):
    name = "broken"

    def on_batch(self, trainer, pl_module, batch, batch_idx, outputs):
        raise RuntimeError("boom")


def test_extra_sees_every_monitored_batch_and_is_published(tmp_path):
    extra = TokenSum()
    monitor = PODMonitor(n_snapshots=8, config=PODConfig(n_dominant=2), log_images=False, extras=[extra, Broken()],
                         every_n_validations=2)
    model = TinyGPT()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        L.Trainer(max_epochs=3, accelerator="cpu", logger=False, callbacks=[monitor], enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path)).fit(model)
    assert extra.runs == [0, 1]  # validation runs 1 and 3 are monitored
    literal = int(sum(x.sum() for x, _ in model.val_dataloader()))
    records = [json.loads(line) for line in open(monitor.run_dir() + "/podmonitor.jsonl")]
    assert [r["token_sum"]["sum"] for r in records] == [literal, literal]
    assert records[0]["token_sum"]["batches"] == len(model.val_dataloader())
    assert records[0]["token_sum"]["layers"] == ["layer_00", "layer_01"]
    assert monitor.history[0]["token_sum"]["sum"] == literal
    # the broken extra is warned about and the POD report and the other extra are intact
    assert any("extra 'broken' failed in on_batch" in str(w.message) for w in rec
               if issubclass(w.category, PODMonitorWarning))
    assert records[0]["layers"]["layer_00"]["status"] == "ok"
    # checkpointed with the monitor
    state = monitor.state_dict()
    again = TokenSum()
    PODMonitor(extras=[again]).load_state_dict(state)
    assert again.runs == [0, 1]


def test_extras_are_validated():
    import pytest

    with pytest.raises(ValueError, match="unique names"):
        PODMonitor(extras=[TokenSum(), TokenSum()])
    with pytest.raises(ValueError, match="MonitorExtra"):
        PODMonitor(extras=[object()])


def _trainer(tmp_path, monitor, max_epochs=1):
    return L.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, callbacks=[monitor],
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     default_root_dir=str(tmp_path))


def test_on_attention_sees_the_fields_the_monitor_accumulates(tmp_path):
    class FieldSum(MonitorExtra):
        name = "field_sum"

        def start_run(self, trainer, pl_module, monitored_index):
            self.sums, self.counts = {}, {}

        def on_attention(self, layer, fields):
            self.sums[layer] = self.sums.get(layer, 0) + fields.double().sum(dim=0)  # (H, T, T)
            self.counts[layer] = self.counts.get(layer, 0) + fields.shape[0]

    extra = FieldSum()
    monitor = PODMonitor(n_snapshots=12, config=PODConfig(n_dominant=2), log_images=False, extras=[extra])
    model = TinyGPT()
    _trainer(tmp_path, monitor).fit(model)
    # the quota: the first 12 validation sequences, whatever the batch size
    xs = torch.cat([x for x, _ in model.val_dataloader()])[:12]
    maps = model.attention_maps((xs, None))
    assert extra.counts == {"layer_00": 12, "layer_01": 12}
    for i, name in enumerate(["layer_00", "layer_01"]):
        assert torch.allclose(extra.sums[name], maps[i].double().sum(dim=0), atol=1e-9)


def test_per_head_analysis_is_an_extra_of_the_pruning_package_and_its_redundancy_is_the_formula(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=PODConfig(n_dominant=2), per_head=True, log_images=False)
    head = monitor.extras[0]
    assert type(head).__module__ == "podmonitor.pruning.allocation" and monitor.head_analysis is head
    model = TinyGPT()
    _trainer(tmp_path, monitor).fit(model)
    x, _ = next(iter(model.val_dataloader()))
    a = model.attention_maps((x, None))[1][:8].double().flatten(2)  # (8, H, T*T)
    second = torch.einsum("shp,sgp->hg", a, a) / a.shape[0]  # E_s <A^h, A^g>
    d = second.diagonal().sqrt()
    literal = second / (d[:, None] * d[None, :])
    got = monitor.last_redundancy["layer_01"].similarity
    assert torch.allclose(got, literal, atol=1e-9)
    assert monitor.last_advice is head.last_advice is not None
    assert monitor.readiness is head.readiness and monitor.last_readiness["stable"] is False
    rec = json.loads(open(monitor.run_dir() + "/podmonitor.jsonl").readline())
    assert rec["head_redundancy"]["layer_01"]["similarity"][0][1] == pytest.approx(float(literal[0, 1]))
    assert "head_analysis" not in rec  # its entries are the record's head_allocation, head_redundancy, readiness


def test_readiness_is_checkpointed_through_the_head_analysis_and_old_checkpoints_load(tmp_path):
    monitor = PODMonitor(n_snapshots=8, config=PODConfig(n_dominant=2), per_head=True, log_images=False)
    _trainer(tmp_path, monitor, max_epochs=2).fit(TinyGPT())
    state = monitor.state_dict()
    assert len(monitor.readiness.history) == 2
    again = PODMonitor(per_head=True, config=PODConfig(n_dominant=2))
    again.load_state_dict(state)
    assert again.readiness.history == monitor.readiness.history
    assert again.readiness.settled_runs == monitor.readiness.settled_runs
    # a checkpoint written before the head analysis was an extra kept the readiness at the top
    old = {k: v for k, v in state.items() if k != "extras"}
    old["readiness"] = state["extras"]["head_analysis"]["readiness"]
    older = PODMonitor(per_head=True, config=PODConfig(n_dominant=2))
    older.load_state_dict(old)
    assert older.readiness.history == monitor.readiness.history


def test_the_monitor_imports_nothing_of_the_pruning_package():
    import subprocess
    import sys

    code = ("import sys; from podmonitor import PODMonitor; PODMonitor(); "
            "print(sorted(m for m in sys.modules if m.startswith('podmonitor.pruning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_per_head_arguments_are_validated_by_the_head_analysis():
    from podmonitor.pruning import AdviceSettings

    with pytest.raises(ValueError, match="AdviceSettings"):
        PODMonitor(per_head=True, advice=object())
    with pytest.raises(ValueError, match="AdviceReadiness"):
        PODMonitor(per_head=True, readiness=object())
    with pytest.raises(ValueError, match="not among PODConfig.eps"):
        PODMonitor(per_head=True, advice=AdviceSettings(eps=0.2))
