"""PODMonitor's extra analyses (podmonitor.extras): driven on the monitored batches, published,
checkpointed, and an extra that raises costs only itself."""

from __future__ import annotations

import json
import warnings

import lightning as L

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
