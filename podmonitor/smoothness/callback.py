"""The Lightning callback :class:`SmoothnessMonitor`: attention smoothness during validation.

Flow inside Lightning's validation loop (rank zero only; other processes do nothing):

1. first validation batch: forward pre-hooks record the input X of every attention sub-layer
   (:class:`~podmonitor.smoothness.sublayers.InputCapture`); no extra forward is run;
2. end of the validation run: each sub-layer is called again as a function of X (fp32, eval
   mode, explicit softmax): the companions (entropy, ||P||_2) on every run, sigma(n) and alpha
   on every ``every_n_validations``-th run (:func:`~podmonitor.smoothness.measure_sublayer`);
3. scalars, pictures and a Markdown table go to the trainer's loggers through
   :func:`~podmonitor.reporting.sinks.sinks_for_loggers`, and one JSON line per run to
   ``<run dir>/smoothness.jsonl``.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer

from ..callback_base import MonitorCallback
from .lipschitz import JacobianMode
from .measure import LayerSmoothness, measure_sublayer
from .sublayers import AttentionSublayer, InputCapture, find_attention_sublayers

STATE_VERSION = 1
JSONL_NAME = "smoothness.jsonl"

__all__ = ["SmoothnessMonitor", "SmoothnessMonitorWarning"]


class SmoothnessMonitorWarning(UserWarning):
    """A problem inside the smoothness monitor that did not stop training."""


class SmoothnessMonitor(MonitorCallback):
    """Local Lipschitz constant of every attention sub-layer and its growth with sequence length.

    Per attention sub-layer f (all heads and the output projection, no residual), at its actual
    validation input X (the first ``n_sequences`` sequences of the first validation batch):

    - every ``every_n_validations``-th validation run: sigma(n) = ||Df(X[:n])||_2 for
      n = 16, 32, ..., T by power iteration (warm-started from the previous run), the growth
      exponent alpha of sigma(n) ~ c n^alpha with its R^2, and for causal layers a check that
      sigma(n) is non-decreasing;
    - every validation run: the normalised row entropy and ||P||_2 of the attention matrix.

    Supported models: the reference GPT (:class:`~podmonitor.models.GPTLightningModule`, softmax
    and EGA), Hugging Face models whose attention modules end with their output projection
    (GPT-2, Llama, ...) and ``torch.nn.MultiheadAttention`` self-attention. The work is done in
    eval mode, fp32, explicit softmax, on the process of global rank 0 only; the model's
    train/eval state, gradients and the global random state are left as they were. It never
    stops training: an error becomes one :class:`SmoothnessMonitorWarning` (``strict=True``
    re-raises instead).

    Args:
        every_n_validations: compute sigma(n) on every k-th validation run (the first one
            included); the sanity-check run is never monitored.
        n_sequences: b, sequences measured (the first usable ones of the first validation batch).
        prefix_lengths: prefix lengths n; default ``16, 32, ..., T`` (doubling from
            ``min_prefix``, T last). Lengths above T are clipped to T.
        min_prefix: first length of the default grid.
        n_iter: maximum power-iteration steps per prefix length (each: one jvp and one vjp).
        tol: stop when sigma changes by at most this (relative) in one step.
        companions: compute entropy and ||P||_2 on every validation run.
        modules: module paths of the attention sub-layers (default: found automatically).
        log_images: log the sigma-vs-n pictures (runs with sigma only).
        output_dir: folder of ``smoothness.jsonl`` (and PNG pictures without TensorBoard / W&B);
            default ``<trainer.log_dir or default_root_dir>/podmonitor``.
        prefix: first component of the logged tags (``"smooth/alpha/<layer>"``).
        tensorboard_layout: write a TensorBoard custom-scalars layout (one chart per metric with all
            layers) unless another podmonitor callback is attached (a TensorBoard run keeps one
            layout; the POD monitor's wins).
        mode: how J v is computed: "auto", "double_backward" or "forward".
        seed: seed of the random start vectors (a private generator).
        strict: re-raise errors instead of warning.

    Raises:
        ValueError: invalid arguments.

    Example:
        >>> from lightning import Trainer
        >>> from podmonitor.smoothness import SmoothnessMonitor
        >>> trainer = Trainer(callbacks=[SmoothnessMonitor(every_n_validations=5)])
    """

    warning_class = SmoothnessMonitorWarning

    def __init__(
        self,
        every_n_validations: int = 5,
        n_sequences: int = 4,
        prefix_lengths: Sequence[int] | None = None,
        min_prefix: int = 16,
        n_iter: int = 30,
        tol: float = 1e-3,
        companions: bool = True,
        modules: Sequence[str] | None = None,
        log_images: bool = True,
        output_dir: str | None = None,
        prefix: str = "smooth",
        tensorboard_layout: bool = True,
        mode: JacobianMode = "auto",
        seed: int = 0,
        strict: bool = False,
    ) -> None:
        if not isinstance(every_n_validations, int) or every_n_validations < 1:
            raise ValueError(f"every_n_validations must be an int >= 1, got {every_n_validations!r}")
        if not isinstance(n_sequences, int) or n_sequences < 1:
            raise ValueError(f"n_sequences must be an int >= 1, got {n_sequences!r}")
        if prefix_lengths is not None:
            prefix_lengths = [int(n) for n in prefix_lengths]
            if not prefix_lengths or min(prefix_lengths) < 1:
                raise ValueError(f"prefix_lengths must be positive ints, got {prefix_lengths!r}")
        if not isinstance(min_prefix, int) or min_prefix < 1:
            raise ValueError(f"min_prefix must be an int >= 1, got {min_prefix!r}")
        if not isinstance(n_iter, int) or n_iter < 1:
            raise ValueError(f"n_iter must be an int >= 1, got {n_iter!r}")
        if not (isinstance(tol, (int, float)) and tol >= 0):
            raise ValueError(f"tol must be a number >= 0, got {tol!r}")
        if mode not in ("auto", "double_backward", "forward"):
            raise ValueError(f"mode must be 'auto', 'double_backward' or 'forward', got {mode!r}")
        self.every_n_validations = every_n_validations
        self.n_sequences = n_sequences
        self.prefix_lengths = prefix_lengths
        self.min_prefix = min_prefix
        self.n_iter = n_iter
        self.tol = float(tol)
        self.companions = companions
        self.modules = list(modules) if modules is not None else None
        self.log_images = log_images
        self.output_dir = output_dir
        self.prefix = prefix
        self.tensorboard_layout = tensorboard_layout
        self.mode: JacobianMode = mode
        self.seed = seed
        self.strict = strict

        self._init_shell()  # history (one summary per monitored validation run), run dir
        self.validation_count = 0
        self.last_results: dict[str, LayerSmoothness] = {}
        self.warm: dict[str, dict[int, torch.Tensor]] = {}  # layer -> n -> (b, n, C) CPU vectors
        self._generator = torch.Generator().manual_seed(seed)
        self._sublayers: list[AttentionSublayer] = []
        self._capture: InputCapture | None = None
        self._capturing = False
        self._outputs: Any = None
        self._write_layout = tensorboard_layout
        self._reset_run()

    # ----------------------------------------------------------- bookkeeping
    @property
    def state_key(self) -> str:
        return self._generate_state_key(prefix=self.prefix)

    def _reset_run(self) -> None:
        self._active = False
        self._sigma_due = False
        self._captured: dict[str, Any] = {}
        self._keep: torch.Tensor | None = None
        self._done_capturing = False
        self._errors: list[str] = []

    def _warn(self, where: str, err: BaseException) -> None:
        msg = f"SmoothnessMonitor: {where} failed ({type(err).__name__}: {err})"
        self._errors.append(msg)
        self._warn_or_raise(msg, err, stacklevel=4)

    def _stop_capture(self) -> None:
        if self._capture is not None and self._capturing:
            try:
                self._capture.stop()
            except Exception as err:  # noqa: BLE001 - removing hooks must never raise into training
                warnings.warn(f"SmoothnessMonitor: removing hooks failed: {err}", SmoothnessMonitorWarning,
                              stacklevel=2)
        self._capturing = False

    # ----------------------------------------------------------------- hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._setup_shell(trainer)  # a collective (trainer.log_dir): here, on every rank
        try:
            self._sublayers = find_attention_sublayers(pl_module, self.modules)
            if not self._sublayers:
                raise ValueError(
                    f"{type(pl_module).__name__} has no supported attention sub-layer (reference GPT "
                    "CausalSelfAttention, Hugging Face *Attention modules, torch.nn.MultiheadAttention)")
            self._capture = InputCapture(self._sublayers)
        except Exception as err:  # noqa: BLE001
            self._sublayers = []
            self._capture = None
            self._warn("finding the attention sub-layers (monitor inactive)", err)
        if self.tensorboard_layout:  # PODMonitor is recognised by class name: no import of its module
            self._write_layout = not any(
                c.__name__ == "PODMonitor" for cb in trainer.callbacks for c in type(cb).__mro__)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset_run()
        if trainer.sanity_checking or self._capture is None:
            return
        self.validation_count += 1
        self._active = int(getattr(trainer, "global_rank", 0) or 0) == 0
        self._sigma_due = (self.validation_count - 1) % self.every_n_validations == 0
        if not (self.companions or self._sigma_due):
            self._active = False

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self._active or self._done_capturing:
            return
        assert self._capture is not None
        try:
            self._capturing = True
            self._capture.start()
        except Exception as err:  # noqa: BLE001
            self._capturing = False
            self._active = False
            self._warn("attaching the input hooks", err)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self._capturing:
            return
        self._stop_capture()
        assert self._capture is not None
        self._captured = dict(self._capture.calls)
        self._capture.calls = {}
        self._done_capturing = True
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        self._keep = (mask != 0).all(dim=-1).cpu() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        if not self._captured:
            self._active = False
            self._warn("capturing the sub-layer inputs",
                       RuntimeError("no attention sub-layer was called during the first validation step"))

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stop_capture()
        if trainer.sanity_checking or not self._active or not self._captured:
            self._captured = {}
            return
        t0 = time.perf_counter()
        results: dict[str, LayerSmoothness] = {}
        for sub in self._sublayers:
            call = self._captured.get(sub.name)
            if call is None:
                continue
            try:
                with torch.inference_mode(False):
                    bound = sub.bind(call, self.n_sequences, self._keep)
                result, vectors = measure_sublayer(
                    bound, self.prefix_lengths, sigma=self._sigma_due, companions=self.companions,
                    warm=self.warm.get(sub.name), n_iter=self.n_iter, tol=self.tol, generator=self._generator,
                    mode=self.mode, min_length=self.min_prefix)
            except Exception as err:  # noqa: BLE001
                self._warn(f"measuring {sub.name}", err)
                continue
            if vectors:
                self.warm[sub.name] = vectors
            results[sub.name] = result
        self._captured = {}
        seconds = time.perf_counter() - t0
        self.last_results = results
        if results:
            try:
                self._report(trainer, results, seconds)
            except Exception as err:  # noqa: BLE001
                self._warn("logging", err)

    def _report(self, trainer: Trainer, results: dict[str, LayerSmoothness], seconds: float) -> None:
        """Rank zero only (no collective in here): write the run's outputs, each on its own."""
        from ..reporting.delivery import Outputs
        from ..reporting.smoothness import (
            smoothness_images,
            smoothness_layout,
            smoothness_markdown,
            smoothness_scalars,
        )

        step, epoch = int(trainer.global_step), int(trainer.current_epoch)
        p = self.prefix
        run_dir = self.run_dir(trainer)
        sigma_run = any(r.lengths for r in results.values())
        if self._outputs is None:
            lengths = sorted({n for r in results.values() for n in r.lengths})
            layout = smoothness_layout(lengths, p) if self._write_layout and lengths else {}
            self._outputs = Outputs("SmoothnessMonitor", SmoothnessMonitorWarning,
                                    jsonl_path=os.path.join(run_dir, JSONL_NAME),
                                    fallback_dir=os.path.join(run_dir, "images"), prefix=p, layout=layout,
                                    strict=self.strict)
        out = self._outputs
        out.clear_failures()
        out.record({
            "step": step,
            "epoch": epoch,
            "validation": self.validation_count,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "sigma_computed": sigma_run,
            "seconds": seconds,
            "errors": list(self._errors),
            "layers": {name: r.to_dict() for name, r in results.items()},
        })
        scalars: dict[str, float] = {}
        for name, r in results.items():
            scalars.update(smoothness_scalars(r, name, prefix=p))
        scalars[f"{p}/run/seconds"] = seconds
        scalars[f"{p}/run/errors"] = float(len(self._errors))
        images: dict[str, Any] = {}
        if self.log_images and sigma_run:
            try:
                images = smoothness_images(results, prefix=p)
            except Exception as err:  # noqa: BLE001 - a picture never costs the numbers
                out._failed("the pictures", "drawing", err)
        text = smoothness_markdown(results, step=step) if sigma_run else ""

        def write(sink: Any) -> None:
            sink.log_scalars(scalars, step)
            if images:
                sink.log_images(images, step)
            if text:
                sink.log_text(f"{p}/summary", text, step)

        out.send(trainer.loggers, write)
        self._history.append({
            "step": step,
            "epoch": epoch,
            "validation": self.validation_count,
            "seconds": seconds,
            "layers": {name: _headline(r) for name, r in results.items()},
            "output_failures": list(out.failures),
        })

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_capture()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_capture()
        if self._outputs is not None:
            self._outputs.close()
            self._outputs = None
        self._hand_over(trainer)

    # ------------------------------------------------------------ pickling (ddp_spawn)
    def __getstate__(self) -> dict[str, Any]:
        # torch.multiprocessing would share the generator's state tensor through a file
        # descriptor, which fails for it ("unable to resize file"): send plain bytes instead
        state = dict(self.__dict__)
        state["_generator"] = bytes(self._generator.get_state().numpy().tobytes())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        raw = state.pop("_generator")
        self.__dict__.update(state)
        self._generator = torch.Generator()
        self._generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "history": list(self._history),
            "validation_count": self.validation_count,
            "warm": {layer: {int(n): v.clone() for n, v in vecs.items()} for layer, vecs in self.warm.items()},
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            warnings.warn("SmoothnessMonitor: unknown checkpoint state version, state not restored",
                          SmoothnessMonitorWarning, stacklevel=2)
            return
        self._history = list(state_dict.get("history", []))
        self.validation_count = int(state_dict.get("validation_count", 0))
        self.warm = {str(layer): {int(n): v.detach().float().cpu() for n, v in vecs.items()}
                     for layer, vecs in state_dict.get("warm", {}).items()}
        gen = state_dict.get("generator")
        if isinstance(gen, torch.Tensor):
            self._generator.set_state(gen)


def _headline(r: LayerSmoothness) -> dict[str, Any]:
    """The few numbers of a layer kept in the history (checkpointed)."""
    comp = r.companions
    return {
        "sigma": {int(n): s for n, s in zip(r.lengths, r.sigma_mean, strict=True)},
        "alpha": r.alpha if r.fit is not None and math.isfinite(r.alpha) else None,
        "r2": r.r2 if r.fit is not None and math.isfinite(r.r2) else None,
        "status": r.fit.status if r.fit is not None else None,
        "monotone": r.monotone,
        "entropy": comp.entropy if comp is not None else None,
        "p_norm": comp.p_norm if comp is not None else None,
    }
