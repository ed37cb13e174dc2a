"""Time of one monitored validation run at GPT-2-small shape, split into its parts.

Usage (from the repository root)::

    python benchmarks/bench_validation_run.py                  # 12 layers x 12 heads, L = 1024, N = 150
    python benchmarks/bench_validation_run.py --seq-len 256 --n 64   # quicker
    python benchmarks/bench_validation_run.py --device cuda          # on a GPU
    python benchmarks/bench_validation_run.py --no-hugepages         # maps faulted in by 4 KiB pages

The model is the reference GPT at GPT-2-small's attention shape (12 layers, 12 heads, context
``--seq-len``) but a narrow width (``--n-embd``, default 96: head size 8), so that the model's own
forward stays cheap and what is timed is the monitor: capture (forming every layer's
(B, 12, L, L) attention; by default reduced as it is formed, row block by row block, to its head
average and per-head stability sums, :mod:`podmonitor.capture.reduce`), accumulate (the engine's
incremental update, and the stability sums), compute (the analysis at
the end of the run) and logging (how long the validation loop waited for the outputs; pictures
and sinks run in the background). Two validation runs are monitored with the defaults: the first
draws pictures (coherency map included where L <= 512), the second does not. It prints one line
per run and the target (at most 60 s).
"""

from __future__ import annotations

import argparse
import tempfile
import time

TARGET_S = 60.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n", type=int, default=150, help="snapshots per monitored run (N)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=96)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-hugepages", action="store_true",
                    help="turn off the huge-page advice of podmonitor's buffers (podmonitor.hugepages.ENABLED)")
    args = ap.parse_args(argv)

    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    from podmonitor import PODMonitor, hugepages
    from podmonitor.models.lightning import GPTLightningModule

    torch.set_num_threads(args.threads)
    hugepages.ENABLED = not args.no_hugepages
    torch.manual_seed(0)
    vocab = 65
    model = GPTLightningModule(vocab_size=vocab, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads,
                               n_embd=args.n_embd, dropout=0.0, warmup_steps=1, max_steps=2)
    x = torch.randint(0, vocab, (args.n, args.seq_len), generator=torch.Generator().manual_seed(1))
    val = DataLoader(TensorDataset(x, x), batch_size=args.batch)
    train = DataLoader(TensorDataset(x[: args.batch], x[: args.batch]), batch_size=args.batch)
    monitor = PODMonitor(n_snapshots=args.n)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(max_epochs=2, limit_train_batches=1, accelerator=args.device, devices=1,
                            logger=TensorBoardLogger(tmp), callbacks=[monitor], enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
        t0 = time.perf_counter()
        trainer.fit(model, train, val)
        wall = time.perf_counter() - t0
    print(f"GPT-2-small attention shape: {args.layers} layers x {args.heads} heads, L = {args.seq_len}, "
          f"N = {args.n}, batch {args.batch}, width {args.n_embd}, {args.threads} threads, {args.device}, "
          f"huge pages {'off' if args.no_hugepages else 'advised'}")
    print("run  pictures  capture_s  accumulate_s  compute_s  logging_s  monitor_total_s")
    for i, entry in enumerate(monitor.history):
        t = entry.get("timings", {})
        parts = [t.get(k, float("nan")) for k in ("capture_s", "accumulate_s", "compute_s", "logging_s")]
        total = sum(parts)
        print(f"{i + 1:>3}  {'yes' if i == 0 else 'no':>8}  {parts[0]:9.2f}  {parts[1]:12.2f}  {parts[2]:9.2f}  "
              f"{parts[3]:9.2f}  {total:15.2f}  {'ok' if total <= TARGET_S else 'over'} (target <= {TARGET_S:.0f} s)")
    print(f"whole fit (2 epochs of 1 training step, 2 validation runs, outputs flushed): {wall:.1f} s")
    if args.device == "cpu":
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        print(f"peak resident memory of the process: {peak:.2f} GiB")


if __name__ == "__main__":
    main()
