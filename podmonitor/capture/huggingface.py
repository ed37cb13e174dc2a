"""Capture from a Hugging Face ``transformers.PreTrainedModel`` during the module's own forward.

``transformers`` is optional: this module never imports it unless the user's code already
did (a model built from it is the only thing this adapter can capture).
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from podmonitor.capture._util import accepts, get_arg, layer_names, set_arg, strictly_upper_is_zero
from podmonitor.capture.base import CaptureAdapter, CapturedAttention
from podmonitor.capture.hooks import HookHandles


def pretrained_model_class() -> type | None:
    """``transformers.PreTrainedModel`` if transformers is already imported, else None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - broken installation
        return None
    return PreTrainedModel


def find_pretrained_model(module: nn.Module) -> tuple[str, nn.Module]:
    """``(path, model)``: the Hugging Face model of ``module``.

    ``module`` itself if it is a ``PreTrainedModel``; else its only direct child that is one;
    else the only outermost one among its submodules.

    Raises:
        ValueError: there is none, or several (name the one to use with
            ``HuggingFaceAdapter(model="path.to.it")``).
    """
    ptm = pretrained_model_class()
    if ptm is None:
        raise ValueError(f"{type(module).__name__} contains no transformers.PreTrainedModel (transformers not loaded)")
    if isinstance(module, ptm):
        return "", module
    direct = [(name, child) for name, child in module.named_children() if isinstance(child, ptm)]
    if len(direct) == 1:
        return direct[0]
    outermost: list[tuple[str, nn.Module]] = []
    for path, sub in module.named_modules():
        if isinstance(sub, ptm) and not any(path.startswith(p + ".") for p, _ in outermost):
            outermost.append((path, sub))
    if len(outermost) == 1:
        return outermost[0]
    if not outermost:
        raise ValueError(f"{type(module).__name__} contains no transformers.PreTrainedModel")
    raise ValueError(
        f"{type(module).__name__} contains several Hugging Face models ({[p for p, _ in outermost]}); "
        "choose one with HuggingFaceAdapter(model='<path>')"
    )


def _configs(model: nn.Module) -> list[Any]:
    """Every config object of ``model`` and its Hugging Face submodels, sub-configs included."""
    ptm = pretrained_model_class()
    found: dict[int, Any] = {}

    def add(cfg: Any) -> None:
        if cfg is None or id(cfg) in found:
            return
        found[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", None) or {}:
            add(getattr(cfg, key, None))

    for sub in model.modules():
        if ptm is not None and isinstance(sub, ptm):
            add(getattr(sub, "config", None))
    return list(found.values())


def config_causal(model: nn.Module) -> bool | None:
    """Causality of the self-attention of ``model`` from its config, None when it does not say.

    ``config.is_decoder`` -> True; a model type with a masked-LM head in transformers
    (BERT, RoBERTa, ...) that is not a decoder -> False; a model type with a causal-LM
    head only (GPT-2, Llama, ...) -> True; encoder-decoder models -> None.
    """
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "is_encoder_decoder", False):
        return None
    if getattr(cfg, "is_decoder", False):
        return True
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )
    except ImportError:  # pragma: no cover - very old or very new transformers
        return None
    model_type = getattr(cfg, "model_type", None)
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return False
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return True
    return None


def _attentions_of(output: Any) -> Any:
    if isinstance(output, Mapping):
        return output.get("attentions")
    return getattr(output, "attentions", None)


def _without_attentions(output: Any) -> Any:
    """A copy of a ``ModelOutput`` without its ``attentions`` (what the caller would have got)."""
    if not isinstance(output, Mapping) or "attentions" not in output:
        return output
    try:
        return type(output)(**{k: v for k, v in output.items() if k != "attentions"})
    except TypeError:  # not a dataclass-like ModelOutput: leave it
        return output


@dataclass
class _Call:
    forced_attentions: bool
    forced_return_dict: bool
    attention_mask: Any


class HuggingFaceAdapter(CaptureAdapter):
    """Attention of a Hugging Face model, grabbed from the module's own validation forward.

    While capturing:

    - the model is switched to eager attention (``model.set_attn_implementation("eager")``
      where the model supports switching, ``config._attn_implementation = "eager"`` on
      transformers without that method): fused kernels do not return probabilities;
    - a forward pre-hook on the model sets ``output_attentions=True`` (and ``return_dict=True``
      when the caller asked for a tuple) and a forward hook takes ``output.attentions``,
      then hands the caller the output it asked for (without ``attentions`` unless it asked
      for them, as a tuple if it asked for one). No extra forward is run.

    ``stop()`` restores every ``_attn_implementation*`` attribute of every config of the
    model (sub-configs included) to its previous value.

    Only the first forward of the model in a validation step is captured. ``valid`` is
    False for sequences whose ``attention_mask`` has a zero (the mask passed to the model
    and/or the batch's ``"attention_mask"`` entry when the batch is a dict or BatchEncoding).
    ``causal`` comes from the config (:func:`config_causal`) and otherwise from the maps
    (True iff every map is exactly zero above the diagonal). Layers are "layer_00", ...

    Args:
        model: which Hugging Face model to capture, as a submodule path of the
            LightningModule (``"model"``, ``"backbone.encoder"``) or the model itself;
            default: found by :func:`find_pretrained_model`.

    Models whose attention cannot return probabilities in eager mode, and encoder-decoder
    models (``encoder_attentions`` / ``decoder_attentions``), are not supported: use
    ``capture=fn`` there.
    """

    name = "huggingface"

    def __init__(self, model: str | nn.Module | None = None) -> None:
        self.model_spec = model
        self._model: nn.Module | None = None
        self._handles = HookHandles()
        self._saved: list[tuple[Any, dict[str, Any]]] = []
        self._pending: list[_Call] = []
        self._attentions: tuple | None = None
        self._mask: Any = None
        self._problem: str | None = None
        self._n_forwards = 0

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        ptm = pretrained_model_class()
        return ptm is not None and any(isinstance(m, ptm) for m in module.modules())

    def _resolve(self, module: nn.Module) -> nn.Module:
        if isinstance(self.model_spec, nn.Module):
            return self.model_spec
        if isinstance(self.model_spec, str):
            return module.get_submodule(self.model_spec)
        return find_pretrained_model(module)[1]

    # ----------------------------------------------------------------- start / stop
    def start(self, module: nn.Module) -> None:
        """Switch the model to eager attention and hook its forward.

        Raises:
            ValueError: no (single) Hugging Face model found.
            TypeError: the model's forward accepts no ``output_attentions``.
        """
        self.stop()
        try:
            model = self._resolve(module)
            sig = inspect.signature(model.forward)
            if not accepts(sig, "output_attentions"):
                raise TypeError(f"{type(model).__name__}.forward accepts no output_attentions argument")
            self._model = model
            for cfg in _configs(model):
                self._saved.append((cfg, {k: v for k, v in vars(cfg).items() if k.startswith("_attn")}))
            self._switch_to_eager(model)
            self._handles.add(model.register_forward_pre_hook(self._make_pre_hook(sig), with_kwargs=True))
            self._handles.add(model.register_forward_hook(self._hook))
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _switch_to_eager(model: nn.Module) -> None:
        cfg = model.config
        if getattr(cfg, "_attn_implementation", None) == "eager":
            return
        if hasattr(model, "set_attn_implementation"):
            # Models that pick their attention class at construction cannot switch (transformers
            # only warns); their sdpa classes fall back to eager when output_attentions=True.
            can_switch = getattr(model, "_can_set_attn_implementation", None)
            if can_switch is None or can_switch():
                model.set_attn_implementation("eager")
        else:  # older transformers
            cfg._attn_implementation = "eager"

    def stop(self) -> None:
        self._handles.remove()
        for cfg, saved in reversed(self._saved):
            attrs = vars(cfg)
            for key in [k for k in attrs if k.startswith("_attn") and k not in saved]:
                del attrs[key]
            attrs.update(saved)
        self._saved.clear()
        self._pending.clear()
        self._model = None
        self._clear()

    def _clear(self) -> None:
        self._attentions = None
        self._mask = None
        self._problem = None
        self._n_forwards = 0

    # ----------------------------------------------------------------- hooks
    def _make_pre_hook(self, sig: inspect.Signature) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
        def pre_hook(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            cfg = model.config
            asked_attn = get_arg(sig, args, kwargs, "output_attentions")
            if asked_attn is None:
                asked_attn = bool(getattr(cfg, "output_attentions", False))
            asked_dict = get_arg(sig, args, kwargs, "return_dict")
            if asked_dict is None:
                asked_dict = bool(getattr(cfg, "use_return_dict", getattr(cfg, "return_dict", True)))
            force_dict = not asked_dict and accepts(sig, "return_dict")
            self._pending.append(
                _Call(
                    forced_attentions=not asked_attn,
                    forced_return_dict=force_dict,
                    attention_mask=get_arg(sig, args, kwargs, "attention_mask"),
                )
            )
            args, kwargs = set_arg(sig, args, kwargs, "output_attentions", True)
            if force_dict:
                args, kwargs = set_arg(sig, args, kwargs, "return_dict", True)
            return args, kwargs

        return pre_hook

    def _hook(self, model: nn.Module, args: tuple, output: Any) -> Any:
        call = self._pending.pop() if self._pending else None
        self._n_forwards += 1
        if self._n_forwards == 1:
            attentions = _attentions_of(output)
            if attentions is None:
                keys = list(output.keys()) if isinstance(output, Mapping) else type(output).__name__
                self._problem = (
                    f"{type(model).__name__} returned no `attentions` with output_attentions=True (output: {keys}); "
                    "encoder-decoder models and models returning tuples are not supported: use capture=fn"
                )
            elif any(a is None for a in attentions):
                self._problem = (
                    f"{type(model).__name__} returned attentions=None for some layers: its attention implementation "
                    f"({getattr(model.config, '_attn_implementation', '?')}) does not return probabilities; "
                    "load the model with attn_implementation='eager'"
                )
            else:
                self._attentions = tuple(a.detach() for a in attentions)
                self._mask = call.attention_mask if call is not None else None
        if call is None:
            return None
        if call.forced_attentions:
            output = _without_attentions(output)
        if call.forced_return_dict and hasattr(output, "to_tuple"):
            output = output.to_tuple()
        return output

    # ----------------------------------------------------------------- collect
    def collect(self, module: nn.Module, batch: Any, outputs: Any) -> CapturedAttention:
        """The attention grabbed from the model's first forward in the validation step.

        Raises:
            RuntimeError: the model was not called during the step (or ``start`` was not
                called), or its output held no usable attentions.
            ValueError: the attentions are not (B, H, T, T) with one B and T for all layers.
        """
        attentions, mask, problem, n_forwards = self._attentions, self._mask, self._problem, self._n_forwards
        model = self._model
        self._clear()
        if model is None:
            raise RuntimeError("HuggingFaceAdapter.collect called without start(module)")
        if problem is not None:
            raise RuntimeError(problem)
        if n_forwards == 0 or attentions is None:
            raise RuntimeError(
                f"the Hugging Face model {type(model).__name__} was not called during {type(module).__name__}"
                ".validation_step, so no attention was captured: the validation step must run the model's "
                "forward on the batch (or use capture=fn / an attention_maps(batch) method)"
            )
        fields = list(attentions)
        try:
            captured = CapturedAttention(fields=fields, layer_names=layer_names(len(fields)))
        except (TypeError, ValueError) as err:
            raise type(err)(f"{type(model).__name__} attentions: {err}") from err
        b, t = captured.batch_size, captured.seq_len
        device = captured.fields[0].device
        valid = None
        masks = [mask]
        if isinstance(batch, Mapping):
            masks.append(batch.get("attention_mask"))
        for m in masks:
            if isinstance(m, torch.Tensor) and m.dim() == 2 and m.shape[0] == b and m.shape[1] == t:
                v = (m != 0).all(dim=-1).to(device)
                valid = v if valid is None else valid & v
        causal = config_causal(model)
        structural = strictly_upper_is_zero(captured.fields)
        if causal is None:
            causal = structural
        elif causal and not structural:
            warnings.warn(
                f"{type(model).__name__}: the config says causal but the attention has weight above the diagonal; "
                "treating it as bidirectional",
                stacklevel=2,
            )
            causal = False
        captured.valid = valid
        captured.causal = causal
        return captured

    def __repr__(self) -> str:
        return f"HuggingFaceAdapter(model={self.model_spec!r})"


__all__ = ["HuggingFaceAdapter", "config_causal", "find_pretrained_model"]
