"""DDP scenarios (2 CPU processes, ``strategy="ddp_spawn"``) run by tests/test_ddp_defaults.py.

Each scenario is a module-level function ``(tmp_dir, *args) -> dict`` run in its own process group
under a timeout by :func:`tests.distributed.run_scenario`, so a hang fails one test only. The
callbacks run with their default settings: no ``output_dir``, the Trainer's default
checkpointing, the logger given (TensorBoard or none).
"""

from __future__ import annotations

import atexit
import glob
import json
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from podmonitor import PODMonitor
from podmonitor.models import GPTLightningModule

VOCAB, SEQ, N_VAL, BATCH = 16, 32, 160, 16


def token_data(n: int, seed: int) -> TensorDataset:
    """(x, y) next-token pairs of a learnable sequence with noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(x, (x + 1) % VOCAB)


def reference_model() -> GPTLightningModule:
    torch.manual_seed(0)
    return GPTLightningModule(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                              warmup_steps=2, max_steps=20, lr=1e-3)


class HFGPT2Module(L.LightningModule):
    """A tiny Hugging Face GPT-2 trained on (x, y) batches, written as users write one."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_model(kind: str) -> L.LightningModule:
    return reference_model() if kind == "ref" else HFGPT2Module()


class ExitProbe(L.Callback):
    """Observer, first in the callback list: in ``setup`` each rank registers an ``atexit`` handler
    that writes ``exit_probe_rank<r>.json`` into ``tmp``: whether the process group was still
    initialised when it ran. Handlers run last-registered first, so it runs after the exit
    handler podmonitor's callbacks register in their ``setup`` (called after this one's)."""

    registered = False

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.world_size > 1 and not ExitProbe.registered:
            ExitProbe.registered = True
            atexit.register(_write_exit_probe, self.tmp, trainer.global_rank)


def _write_exit_probe(tmp: str, rank: int) -> None:
    with open(os.path.join(tmp, f"exit_probe_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "initialized": torch.distributed.is_initialized()}, f)


def exit_probes(tmp: str) -> list[dict[str, Any]]:
    """What each rank's :class:`ExitProbe` wrote (the ranks have exited when ``fit`` returns)."""
    out = []
    for p in sorted(glob.glob(os.path.join(tmp, "exit_probe_rank*.json"))):
        with open(p) as f:
            out.append(json.load(f))
    return out


def trainer(tmp: str, callbacks: list, logger: str, devices: int = 2, **kw: Any) -> L.Trainer:
    if devices > 1:
        callbacks = [ExitProbe(tmp), *callbacks]
    args: dict[str, Any] = dict(max_epochs=1, accelerator="cpu", devices=devices, callbacks=callbacks,
                                logger=TensorBoardLogger(tmp, name="tb") if logger == "tb" else False,
                                default_root_dir=tmp, enable_progress_bar=False, enable_model_summary=False,
                                limit_train_batches=4)
    if devices > 1:
        args["strategy"] = "ddp_spawn"
    args.update(kw)
    return L.Trainer(**args)


def loaders() -> tuple[DataLoader, DataLoader]:
    return (DataLoader(token_data(64, 0), batch_size=BATCH), DataLoader(token_data(N_VAL, 1), batch_size=BATCH))


def records(tmp: str, name: str) -> list[dict[str, Any]]:
    """Every record of the JSON-lines files ``name`` under ``tmp`` (one run: one file)."""
    paths = sorted(glob.glob(os.path.join(tmp, "**", name), recursive=True))
    out = []
    for p in paths:
        with open(p) as f:
            out.extend({**json.loads(line), "_path": p} for line in f if line.strip())
    return out


def tensorboard_tags(tmp: str) -> list[str]:
    """Every scalar tag under ``<tmp>/tb`` (per-layer runs included, without the layer)."""
    from tests.tb_events import scalar_series

    tags: set[str] = set()
    for p in glob.glob(os.path.join(tmp, "tb", "**", "events.out.tfevents.*"), recursive=True):
        tags.update(scalar_series(p))
    return sorted(tags)


def _result(tmp: str, main_history: list, jsonl: str) -> dict[str, Any]:
    return {"records": records(tmp, jsonl), "main_history": main_history, "tags": tensorboard_tags(tmp),
            "exit_probes": exit_probes(tmp)}


def pod(tmp: str, kind: str, logger: str) -> dict[str, Any]:
    model = make_model(kind)
    monitor = PODMonitor()
    train, val = loaders()
    trainer(tmp, [monitor], logger).fit(model, train, val)
    out = _result(tmp, monitor.history, "podmonitor.jsonl")
    # the same sequences in one process, with the weights the workers ended with (ddp_spawn loads
    # rank zero's weights back into the main process's model)
    single = PODMonitor(output_dir=os.path.join(tmp, "single"))
    trainer(os.path.join(tmp, "single_root"), [single], "none", devices=1).validate(model, val)
    out["single"] = records(os.path.join(tmp, "single"), "podmonitor.jsonl")
    return out


def smooth(tmp: str, kind: str, logger: str) -> dict[str, Any]:
    from podmonitor import SmoothnessMonitor

    monitor = SmoothnessMonitor()
    train, val = loaders()
    trainer(tmp, [monitor], logger).fit(make_model(kind), train, val)
    return _result(tmp, monitor.history, "smoothness.jsonl")


def prune(tmp: str, kind: str, logger: str) -> dict[str, Any]:
    from podmonitor.pruning import HeadPruning

    pruning = HeadPruning(n_heads=1, at_step=1, strategy="random")
    train, val = loaders()
    model = make_model(kind)
    trainer(tmp, [PODMonitor(), pruning], logger).fit(model, train, val)
    out = _result(tmp, pruning.actions, "pruning.jsonl")
    out["pod_records"] = records(tmp, "podmonitor.jsonl")
    return out


def padded_rank(tmp: str) -> dict[str, Any]:
    """Rank 1's sequences are all padded: rank 0 must supply the whole quota."""
    model = HFPaddedModule()
    monitor = PODMonitor(n_snapshots=60)
    train, _ = loaders()
    x, y = token_data(N_VAL, 1).tensors
    mask = torch.ones_like(x)
    mask[1::2, -3:] = 0  # odd indices: right-padded
    val = DataLoader(TensorDataset(x, y, mask), batch_size=BATCH)
    trainer(tmp, [monitor], "none").fit(model, DataLoader(TensorDataset(*token_data(64, 0).tensors,
                                                                        torch.ones(64, SEQ, dtype=torch.long)),
                                                          batch_size=BATCH), val)
    return _result(tmp, monitor.history, "podmonitor.jsonl")


class HFPaddedModule(HFGPT2Module):
    """GPT-2 on (x, y, attention_mask) batches: padded positions carry mask 0."""

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y, mask = batch
        logits = self.model(input_ids=x, attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
