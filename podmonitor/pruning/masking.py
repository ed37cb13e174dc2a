"""Reversible head pruning: :class:`HeadMasker`.

Two kinds of model:

* the reference models (:mod:`podmonitor.models.gpt`): the attention layers' ``head_mask``
  buffer is set to 0 for the pruned heads. The buffer is saved with the model, so a checkpoint
  holds the pruning. Before masking, the pruned heads' own parameters (their q, k, v rows of
  ``c_attn``, their columns of ``c_proj``, their EGA energy row and alpha, tau) are stashed, so
  :meth:`HeadMasker.restore` gives the heads back exactly as they were when pruned, even though
  the optimiser (weight decay, momentum) may have moved them since.
* Hugging Face models (GPT-2, BERT-like, Llama-like): a forward pre-hook on each layer's output
  projection zeroes the pruned heads' slices of its input (the concatenated head outputs);
  :meth:`HeadMasker.restore` removes it. Their weights are not stashed.
* any other model whose attention calls ``torch.nn.functional.scaled_dot_product_attention``
  (nanoGPT-, litgpt-, timm-style modules): the layers are the modules whose class calls it
  (:func:`podmonitor.capture.sdpa.sdpa_modules`, in module order), their head counts read from
  ``n_head`` / ``num_heads`` / ... ; a :class:`~podmonitor.capture.sdpa.SDPAHeadMask` scales the
  pruned heads' SDPA outputs (B, H, T, E) by 0 before the heads are merged, which is zeroing
  their slices of the output projection's input. :meth:`HeadMasker.restore` removes it; the
  weights are not touched or stashed.

:meth:`HeadMasker.make_permanent` ends reversibility: for the reference models it zeroes the
pruned heads' value rows and output-projection columns (their output is then zero with or without
the mask) and keeps the mask; for Hugging Face models it removes the hooks and calls
``model.prune_heads`` (the heads are physically removed, ``config.pruned_heads`` records it); for
SDPA models, whose weight layout is unknown, the mask stays attached (the heads stay silenced).

Example:
    >>> masker = HeadMasker(model)          # a GPT, a GPTLightningModule, a HF model or an SDPA model
    >>> masker.apply({0: [1, 3], 2: [0]})   # layer index -> heads
    >>> masker.restore()                    # every head back
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..models.gpt import CausalSelfAttention

_HF_BLOCKS = ("h", "encoder.layer", "layers", "transformer.h", "decoder.layers")
_HF_OUT_PROJ = ("attn.c_proj", "attention.output.dense", "self_attn.o_proj", "self_attn.out_proj", "attention.dense")


def _get(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass
class _HFLayer:
    out_proj: nn.Module
    n_head: int
    head_dim: int


def _hf_layers(module: nn.Module) -> tuple[nn.Module, list[_HFLayer]] | None:
    """(the PreTrainedModel, its layers' output projections) or None if not a HF model."""
    try:
        from ..capture.huggingface import find_pretrained_model

        _, hf = find_pretrained_model(module)
    except ValueError:
        return None
    base = getattr(hf, "base_model", hf)
    cfg = hf.config
    n_head = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0))
    hidden = int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0))
    head_dim = int(getattr(cfg, "head_dim", 0) or (hidden // n_head if n_head else 0))
    for blocks_path in _HF_BLOCKS:
        blocks = _get(base, blocks_path)
        if isinstance(blocks, nn.ModuleList) and len(blocks):
            for proj_path in _HF_OUT_PROJ:
                projs = [_get(b, proj_path) for b in blocks]
                if all(isinstance(p, nn.Module) for p in projs):
                    return hf, [_HFLayer(p, n_head, head_dim) for p in projs]
    raise ValueError(f"{type(hf).__name__}: could not find the attention output projections "
                     f"(looked for {_HF_BLOCKS} x {_HF_OUT_PROJ})")


def _head_slices(layer: CausalSelfAttention, h: int) -> list[tuple[Tensor, tuple[Any, ...]]]:
    """(parameter, index) pairs of everything that belongs to head h only."""
    C, hs = layer.n_embd, layer.n_embd // layer.n_head
    rows = [slice(part * C + h * hs, part * C + (h + 1) * hs) for part in range(3)]  # q, k, v rows of c_attn
    out: list[tuple[Tensor, tuple[Any, ...]]] = [(layer.c_attn.weight, (r,)) for r in rows]
    if layer.c_attn.bias is not None:
        out += [(layer.c_attn.bias, (r,)) for r in rows]
    out.append((layer.c_proj.weight, (slice(None), slice(h * hs, (h + 1) * hs))))
    if layer.gate is not None:
        out += [(layer.gate.energy.weight, (h,)), (layer.gate.energy.bias, (h,)), (layer.gate.alpha, (h,)),
                (layer.gate.tau, (h,))]
    return out


@dataclass
class _SDPALayer:
    path: str  # module path, the layer name of the sdpa capture adapter
    n_head: int


def _sdpa_layers(module: nn.Module) -> list[_SDPALayer] | None:
    """The SDPA attention layers of ``module`` (None when there are none).

    Raises:
        ValueError: a layer's head count cannot be read.
    """
    from ..capture.sdpa import head_count, sdpa_modules

    found = sdpa_modules(module)
    if not found:
        return None
    layers = []
    for path, sub in found:
        n = head_count(sub)
        if n is None:
            raise ValueError(f"{path} ({type(sub).__name__}) calls scaled_dot_product_attention but its number of "
                             "heads is unknown: give it an attribute n_head or num_heads")
        layers.append(_SDPALayer(path, n))
    return layers


class HeadMasker:
    """Prune attention heads of a model reversibly (see the module docstring).

    Args:
        module: a module containing the reference attention layers, a Hugging Face model
            (or a module holding exactly one), or a model whose attention modules call
            ``torch.nn.functional.scaled_dot_product_attention``.

    Raises:
        ValueError: the module has none of them.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.kind: str
        self._ref = [m for m in module.modules() if isinstance(m, CausalSelfAttention)]
        self._hf: nn.Module | None = None
        self._hf_layers: list[_HFLayer] = []
        self._sdpa_layers: list[_SDPALayer] = []
        self._sdpa_mask: Any = None  # podmonitor.capture.sdpa.SDPAHeadMask while kind == "sdpa"
        if self._ref:
            self.kind = "reference"
        elif (found := _hf_layers(module)) is not None:
            self._hf, self._hf_layers = found
            self.kind = "huggingface"
        elif (sdpa := _sdpa_layers(module)) is not None:
            from ..capture.sdpa import SDPAHeadMask

            self._sdpa_layers = sdpa
            self._sdpa_mask = SDPAHeadMask(module)
            self.kind = "sdpa"
        else:
            raise ValueError(f"{type(module).__name__}: no podmonitor reference attention layer, no Hugging Face "
                             "model and no module calling scaled_dot_product_attention: cannot mask heads")
        self.pruned: dict[int, list[int]] = {}
        self.permanent = False
        self._stash: dict[tuple[int, int], list[Tensor]] = {}
        self._hooks: dict[int, RemovableHandle] = {}

    @property
    def n_heads(self) -> list[int]:
        """Heads per layer (before pruning)."""
        if self.kind == "reference":
            return [m.n_head for m in self._ref]
        if self.kind == "sdpa":
            return [layer.n_head for layer in self._sdpa_layers]
        return [layer.n_head for layer in self._hf_layers]

    @property
    def layer_names(self) -> list[str] | None:
        """SDPA models: the layers' module paths (the ``sdpa`` capture adapter's layer names); else None."""
        return [layer.path for layer in self._sdpa_layers] if self.kind == "sdpa" else None

    def active(self) -> list[list[bool]]:
        """(n_layer, n_head) False for pruned heads."""
        return [[h not in self.pruned.get(i, []) for h in range(n)] for i, n in enumerate(self.n_heads)]

    def _check(self, heads: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        n = self.n_heads
        out: dict[int, list[int]] = {}
        for layer, hs in heads.items():
            layer = int(layer)
            if not 0 <= layer < len(n):
                raise ValueError(f"layer {layer} out of range 0..{len(n) - 1}")
            for h in hs:
                if not 0 <= int(h) < n[layer]:
                    raise ValueError(f"head {h} out of range 0..{n[layer] - 1} in layer {layer}")
            new = sorted({int(h) for h in hs} - set(self.pruned.get(layer, [])))
            if len(set(self.pruned.get(layer, [])) | set(new)) >= n[layer]:
                raise ValueError(f"pruning {sorted(hs)} would leave layer {layer} without a head")
            if new:
                out[layer] = new
        return out

    @torch.no_grad()
    def apply(self, heads: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        """Mask ``{layer index: [heads]}`` (in addition to the heads already pruned).

        Returns:
            the heads newly masked, ``{layer: [heads]}``.

        Raises:
            ValueError: an index is out of range, or a layer would lose every head.
            RuntimeError: the pruning was made permanent.
        """
        if self.permanent:
            raise RuntimeError("the pruning was made permanent: apply a new HeadMasker to prune more")
        new = self._check(heads)
        for layer, hs in new.items():
            self.pruned[layer] = sorted(set(self.pruned.get(layer, [])) | set(hs))
            if self.kind == "reference":
                attn = self._ref[layer]
                for h in hs:
                    self._stash[(layer, h)] = [p[idx].detach().clone() for p, idx in _head_slices(attn, h)]
                mask = attn.head_mask.clone()
                mask[self.pruned[layer]] = 0.0
                attn.set_head_mask(mask)
            elif self.kind == "sdpa":
                self._sdpa_set(layer)
            else:
                self._hook(layer)
        return new

    def _sdpa_set(self, layer: int) -> None:
        spec = self._sdpa_layers[layer]
        keep = torch.ones(spec.n_head)
        keep[self.pruned[layer]] = 0.0
        self._sdpa_mask.set(spec.path, keep)
        self._sdpa_mask.attach()

    def _hook(self, layer: int) -> None:
        if layer in self._hooks:
            self._hooks[layer].remove()
        spec = self._hf_layers[layer]
        heads = list(self.pruned[layer])

        def zero_heads(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]  # (B, T, n_head * head_dim): the concatenated head outputs
            keep = torch.ones(spec.n_head, dtype=x.dtype, device=x.device)
            keep[heads] = 0.0
            x = x * keep.repeat_interleave(spec.head_dim)
            return (x, *args[1:])

        self._hooks[layer] = spec.out_proj.register_forward_pre_hook(zero_heads)

    @torch.no_grad()
    def restore(self) -> None:
        """Every pruned head back: masks cleared, stashed parameters written back (reference models).

        Raises:
            RuntimeError: the pruning was made permanent.
        """
        if self.permanent:
            raise RuntimeError("the pruning was made permanent and cannot be undone")
        if self.kind == "reference":
            for (layer, h), values in self._stash.items():
                for (p, idx), v in zip(_head_slices(self._ref[layer], h), values, strict=True):
                    p[idx] = v.to(p.device, p.dtype)
            for layer in self.pruned:
                self._ref[layer].clear_head_mask()
        elif self.kind == "sdpa":
            self._sdpa_mask.clear()
            self._sdpa_mask.detach()
        else:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
        self._stash.clear()
        self.pruned = {}

    @torch.no_grad()
    def make_permanent(self) -> None:
        """End reversibility (see the module docstring); no-op when nothing is pruned."""
        if self.permanent or not self.pruned:
            self.permanent = self.permanent or bool(self.pruned)
            return
        if self.kind == "reference":
            for layer, hs in self.pruned.items():
                attn = self._ref[layer]
                C, hd = attn.n_embd, attn.n_embd // attn.n_head
                for h in hs:
                    v_rows = slice(2 * C + h * hd, 2 * C + (h + 1) * hd)
                    attn.c_attn.weight[v_rows] = 0.0
                    if attn.c_attn.bias is not None:
                        attn.c_attn.bias[v_rows] = 0.0
                    attn.c_proj.weight[:, h * hd:(h + 1) * hd] = 0.0
        elif self.kind == "sdpa":
            pass  # the weight layout is unknown: the mask stays attached, the heads stay silenced
        else:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            assert self._hf is not None
            self._hf.prune_heads({k: list(v) for k, v in self.pruned.items()})  # type: ignore[operator]
        self._stash.clear()
        self.permanent = True

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "pruned": {int(k): list(v) for k, v in self.pruned.items()},
            "permanent": self.permanent,
            "stash": {f"{k[0]}:{k[1]}": [t.cpu() for t in v] for k, v in self._stash.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Re-apply a saved pruning to this (freshly built or loaded) model."""
        pruned = {int(k): list(v) for k, v in state.get("pruned", {}).items()}
        stash = state.get("stash", {})
        if self.kind == "reference":
            for layer, hs in pruned.items():
                mask = torch.ones(self._ref[layer].n_head)
                mask[hs] = 0.0
                self._ref[layer].set_head_mask(mask)
        self.pruned = pruned
        self.permanent = bool(state.get("permanent", False))
        if self.kind == "huggingface" and not self.permanent:
            for layer in pruned:
                self._hook(layer)
        if self.kind == "sdpa":
            self._sdpa_mask.clear()
            for layer in pruned:
                self._sdpa_set(layer)
        self._stash = {(int(k.split(":")[0]), int(k.split(":")[1])): list(v) for k, v in stash.items()}


__all__ = ["HeadMasker"]
