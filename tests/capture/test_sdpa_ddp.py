"""The sdpa adapter under DDP: 2 CPU processes (ddp_spawn), default PODMonitor(), a nanoGPT-style model.

The scenario runs in its own process group under a timeout (tests/distributed.py): a hang fails
this test only. Rank zero's record must equal one process analysing the same 150 sequences with
the weights the workers ended with, and the layers must carry the same module-path names.
"""

from __future__ import annotations

import glob
import json
import math
import os
import warnings
from typing import Any

import pytest

from tests.distributed import run_scenario

TIMEOUT = 240


def _records(root: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(root, "**", "podmonitor.jsonl"), recursive=True)):
        with open(path) as fh:
            out.extend(json.loads(line) for line in fh if line.strip())
    return [r for r in out if r.get("kind", "report") == "report"]


def scenario(tmp: str, kind: str = "nanogpt") -> dict[str, Any]:
    """Fit on 2 processes with the default monitor, then validate the final weights in one process.
    ``kind``: "nanogpt" (every call causal) or "encoder_decoder" (the first block bidirectional)."""
    import lightning as L
    import torch

    from podmonitor import PODMonitor
    from tests.capture.sdpa_models import EncoderDecoderGPTModule, NanoGPTModule

    warnings.simplefilter("ignore", UserWarning)
    L.seed_everything(0)
    model = NanoGPTModule() if kind == "nanogpt" else EncoderDecoderGPTModule()
    monitor = PODMonitor()
    common = dict(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, limit_train_batches=4)
    L.Trainer(devices=2, strategy="ddp_spawn", default_root_dir=os.path.join(tmp, "ddp"), callbacks=[monitor],
              **common).fit(model)
    single = PODMonitor(output_dir=os.path.join(tmp, "single"))
    L.Trainer(devices=1, default_root_dir=os.path.join(tmp, "single_root"), callbacks=[single], **common).validate(
        model, model.val_dataloader())
    modes = len(torch.overrides._get_current_function_mode_stack())
    return {"ddp": _records(os.path.join(tmp, "ddp")), "single": _records(os.path.join(tmp, "single")),
            "main_history": monitor.history, "modes_left": modes}


def _close(a, b, rel=1e-9):
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


@pytest.mark.parametrize("kind", ["nanogpt", "encoder_decoder"])
def test_sdpa_ddp_default_monitor_matches_one_process(tmp_path, kind):
    res = run_scenario(f"tests.capture.test_sdpa_ddp:scenario:{kind}", tmp_path, timeout=TIMEOUT)
    assert res["modes_left"] == 0
    (rec,) = res["ddp"]  # rank zero alone writes, one record for the one monitored run
    (single,) = res["single"]
    names = ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]
    assert sorted(rec["layers"]) == sorted(single["layers"]) == names  # module paths, the same in every process
    assert rec["n_taken"] == 150
    for name in names:
        layer, ref = rec["layers"][name], single["layers"][name]
        assert layer["n_snapshots"] == ref["n_snapshots"] == 150
        # each layer as it is: a bidirectional first block beside a causal one is read per layer
        causal = not (kind == "encoder_decoder" and name.endswith("h.0.attn"))
        assert layer["status"] == "ok" and layer["causal"] is ref["causal"] is causal
        assert layer["dominant_scales"] == pytest.approx(ref["dominant_scales"], rel=1e-9)
        assert _close(layer["t_spec"], ref["t_spec"])
    assert len(res["main_history"]) == 1
