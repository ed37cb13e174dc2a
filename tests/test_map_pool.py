"""PODMonitor keeps the captures' large map buffers mapped from one batch to the next
(podmonitor.hugepages.BufferPool): the next batch's maps are written into the last batch's memory
only once nothing refers to it, so the numbers are those of a run without the pool, and maps a
careless extra keeps are never overwritten."""

from __future__ import annotations

import math

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from podmonitor import PODMonitor, hugepages
from podmonitor.engine import accumulator
from podmonitor.extras import MonitorExtra
from podmonitor.models.lightning import GPTLightningModule

T = 512  # (2, 4, 512, 512) float32 maps: 8 MiB per layer and batch, large enough for the pool


def _model_and_data() -> tuple[GPTLightningModule, DataLoader, DataLoader]:
    torch.manual_seed(0)
    model = GPTLightningModule(vocab_size=65, block_size=T, n_layer=2, n_head=4, n_embd=32, dropout=0.0,
                               warmup_steps=1, max_steps=1)
    x = torch.randint(0, 65, (8, T), generator=torch.Generator().manual_seed(1))
    val = DataLoader(TensorDataset(x, x), batch_size=2)
    train = DataLoader(TensorDataset(x[:2], x[:2]), batch_size=2)
    return model, train, val


def _fit(monitor: PODMonitor, root) -> GPTLightningModule:
    model, train, val = _model_and_data()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, accelerator="cpu", devices=1, logger=False,
                        default_root_dir=str(root),
                        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(model, train, val)
    return model


class ReadsMaps(MonitorExtra):
    """An extra that reads the per-head maps (and keeps nothing): the monitor then captures maps
    instead of reducing each layer as it is formed (its default, which forms no maps)."""

    name = "reads_maps"

    def on_attention(self, layer: str, fields: torch.Tensor) -> None:
        assert fields.dim() == 4


def _counting_take(monkeypatch) -> tuple[list[int], list[int]]:
    """Record the sizes of the pool's buffers taken fresh and reused."""
    reused, new = [], []
    take = hugepages.BufferPool.take

    def counting_take(self, nbytes):
        buf, fresh = take(self, nbytes)
        (new if fresh else reused).append(nbytes)
        return buf, fresh

    monkeypatch.setattr(hugepages.BufferPool, "take", counting_take)
    return new, reused


def _fields_and_workspace(new: list[int], reused: list[int]) -> tuple[int, int]:
    """The pool's buffers of maps or fields (8 MiB here) taken new and reused, after checking that
    the only other buffer, the update's lag-moment workspace of these fields
    (``accumulator.SHEAR_BYTES`` or less), was taken new once and reused once (the second layer's
    update at the run's end)."""
    fields = 8 * 2**20
    others_new, others_reused = [n for n in new if n != fields], [n for n in reused if n != fields]
    assert len(others_new) == 1 and others_reused == others_new and others_new[0] <= accumulator.SHEAR_BYTES
    return new.count(fields), reused.count(fields)


def _numbers(monitor: PODMonitor) -> dict[str, list[float]]:
    return {name: [*rep.dominant_scales, *rep.per_scale[0].eigenvalues.tolist(), rep.t_spec, rep.entropy]
            for name, rep in monitor.last_reports.items()}


def test_the_pool_reuses_the_maps_memory_and_changes_no_number(monkeypatch, tmp_path):
    assert hugepages.MIN_BYTES <= 2 * 4 * T * T * 4
    take = hugepages.BufferPool.take
    with monkeypatch.context() as patch:
        new, reused = _counting_take(patch)
        pooled = PODMonitor(n_snapshots=8, log_images=False, extras=[ReadsMaps()])
        _fit(pooled, tmp_path / "pooled")
    # 2 layers' maps: new in the first of 4 batches, then reused (6); at the run's end each layer's
    # queued fields are added as one batch, concatenated into a pool buffer of the same size: new
    # for the first layer (the pool is emptied after the last batch), reused for the second. The
    # update's lag-moment workspace (one size for every update of this length) likewise
    assert _fields_and_workspace(new, reused) == (3, 7)
    assert hugepages.BufferPool.take is take

    assert hugepages.current_pool() is None  # the monitor left no pool in use in this thread
    plain = PODMonitor(n_snapshots=8, log_images=False, extras=[ReadsMaps()])
    with monkeypatch.context() as patch:
        patch.setattr(hugepages, "push_pool", lambda pool: None)  # capture and accumulation without a pool
        _fit(plain, tmp_path / "plain")
    # the same maps give the same numbers; rtol allows only float32 rounding (a run of this
    # test once differed from another by 6e-7 in an eigenvalue), while maps overwritten by another
    # batch would change them at the percent level
    for name, numbers in _numbers(plain).items():
        np.testing.assert_allclose(_numbers(pooled)[name], numbers, rtol=1e-5)
        stab = {k: v for k, v in plain.last_stability[name].items() if not math.isnan(v)}
        np.testing.assert_allclose([pooled.last_stability[name][k] for k in stab], list(stab.values()), rtol=1e-6)


def test_maps_an_extra_keeps_are_never_overwritten_by_later_batches(tmp_path):
    class Keeper(MonitorExtra):  # against the advice ("keep sums, not the tensors")
        name = "keeper"

        def start_run(self, trainer, pl_module, monitored_index):
            self.kept: list[torch.Tensor] = []

        def on_attention(self, layer, fields):
            if layer == "layer_01":
                self.kept.append(fields)

    keeper = Keeper()
    model = _fit(PODMonitor(n_snapshots=8, log_images=False, extras=[keeper]), tmp_path)
    _, _, val = _model_and_data()
    assert len(keeper.kept) == 4
    for kept, (x, _) in zip(keeper.kept, val, strict=True):
        reference = model.attention_maps((x, None))[1]  # recomputed on its own, no pool
        assert torch.equal(kept, reference)


def test_two_monitors_each_remove_their_own_pool(tmp_path):
    """Two monitors on one run push and remove their pools in overlapping order (start hooks a, b;
    end hooks a, b): afterwards no pool is left in use, and both measured the same maps."""
    first, second = PODMonitor(n_snapshots=8, log_images=False), PODMonitor(n_snapshots=8, log_images=False,
                                                                          prefix="pod_again")
    model, train, val = _model_and_data()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, accelerator="cpu", devices=1, logger=False,
                        default_root_dir=str(tmp_path), callbacks=[first, second], enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(model, train, val)
    assert hugepages.current_pool() is None
    for name, numbers in _numbers(first).items():
        np.testing.assert_allclose(_numbers(second)[name], numbers, rtol=1e-5)


# ------------------------------------------------------------------ a nanoGPT that calls SDPA
NANO = dict(block_size=T, vocab_size=16, n_layer=2, n_head=4, n_embd=16)  # (2, 4, 512, 512) maps: 8 MiB


def _nano_fit(monitor: PODMonitor, root, push=None):
    from tests.capture.sdpa_models import GPTConfig, NanoGPTModule

    L.seed_everything(0)
    model = NanoGPTModule(GPTConfig(**NANO), n_train=2, n_val=8, batch_size=2)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, default_root_dir=str(root),
                        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0)
    trainer.fit(model)
    return model


def test_the_sdpa_capture_of_a_nanogpt_reuses_the_maps_memory(monkeypatch, tmp_path):
    """The recomputed SDPA maps of a model written as nanoGPT is, when an extra reads them: new
    buffers in the first batch only, and the numbers of a run without the pool. The default
    PODMonitor() forms no maps at all: its pool serves only the queued head averages."""
    with monkeypatch.context() as patch:
        new, reused = _counting_take(patch)
        pooled = PODMonitor(extras=[ReadsMaps()])
        _nano_fit(pooled, tmp_path / "pooled")
    # 2 layers x 4 batches of maps (2 new, 6 reused); the quota of 150 is not reached, so the pool
    # is kept to the run's end, where each layer's queued fields are concatenated into one of the
    # maps' buffers, idle by then (2 reused); the update's lag-moment workspace: new, then reused
    assert _fields_and_workspace(new, reused) == (2, 8)
    assert hugepages.current_pool() is None
    with monkeypatch.context() as patch:
        new, reused = _counting_take(patch)
        _nano_fit(PODMonitor(), tmp_path / "default")
    # no maps: each layer's (2, 512, 512) head averages (2 MiB) are below the pool's size; at the
    # run's end each layer's 4 queued batches are concatenated (8 MiB): new, then reused (and the
    # workspace, as above)
    assert _fields_and_workspace(new, reused) == (1, 1)
    plain = PODMonitor(extras=[ReadsMaps()])
    with monkeypatch.context() as patch:
        patch.setattr(hugepages, "push_pool", lambda pool: None)
        _nano_fit(plain, tmp_path / "plain")
    assert sorted(_numbers(plain)) == sorted(_numbers(pooled)) and len(_numbers(plain)) == 2
    for name, numbers in _numbers(plain).items():
        np.testing.assert_allclose(_numbers(pooled)[name], numbers, rtol=1e-5)


def ddp_scenario(tmp: str) -> dict:
    """Two processes (ddp_spawn) with a PODMonitor whose extra reads the maps, on the nanoGPT
    above, maps large enough for the pool; then one process validating the final weights with the
    default PODMonitor() (no pool, each layer reduced as it is formed) for reference."""
    import os
    import warnings

    from tests.capture.sdpa_models import GPTConfig, NanoGPTModule

    warnings.simplefilter("ignore", UserWarning)
    L.seed_everything(0)
    model = NanoGPTModule(GPTConfig(**NANO), n_train=4, n_val=16, batch_size=2)
    common = dict(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    monitor = PODMonitor(extras=[ReadsMaps()])  # maps, from the pool
    L.Trainer(devices=2, strategy="ddp_spawn", default_root_dir=os.path.join(tmp, "ddp"), callbacks=[monitor],
              **common).fit(model)
    hugepages.push_pool = lambda pool: None  # the reference: no pool, and the default reduced capture
    single = PODMonitor()
    L.Trainer(devices=1, default_root_dir=os.path.join(tmp, "single"), callbacks=[single], **common).validate(
        model, model.val_dataloader())
    return {"ddp": monitor.history, "single": single.history}


def test_two_processes_with_the_pool_give_the_numbers_of_one_without_it(tmp_path):
    from tests.distributed import run_scenario

    res = run_scenario("tests.test_map_pool:ddp_scenario", tmp_path, timeout=240)
    (ddp,), (single,) = res["ddp"], res["single"]
    assert sorted(ddp["layers"]) == sorted(single["layers"]) and len(ddp["layers"]) == 2
    for name, ref in single["layers"].items():
        got = ddp["layers"][name]
        assert got["n_snapshots"] == ref["n_snapshots"] == 16 and got["status"] == "ok"
        np.testing.assert_allclose(got["dominant_scales"], ref["dominant_scales"], rtol=1e-9)
        np.testing.assert_allclose(got["t_spec"], ref["t_spec"], rtol=1e-5)
        np.testing.assert_allclose(got["entropy"], ref["entropy"], rtol=1e-6)
