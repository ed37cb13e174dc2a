"""Temporary head gates for measuring head importance: :class:`HeadGates`.

A gate g_h multiplies head h's output before the layer's output projection, the xi_h of Michel
et al. 2019: g = 0 removes the head (its slice of the projection's input is zero), g = 1 keeps
it, and a gate that requires gradients gets d loss / d g. Gates are for measurements: set,
used for some forward passes, cleared; outside ``with gates:`` the model is untouched. (The
persistent, checkpointed pruning of :class:`~podmonitor.pruning.HeadPruning` is
:class:`~podmonitor.pruning.masking.HeadMasker`.)

How each kind of model is gated (``kind="auto"`` tries them in this order):

* ``"reference"`` (:mod:`podmonitor.models.gpt`): the layer's ``head_mask`` buffer is swapped
  for ``head_mask * g`` while the gate is set (heads already masked stay masked).
* ``"huggingface"``: a forward pre-hook on each layer's output projection (``attn.c_proj``,
  ``attention.output.dense``, ``self_attn.o_proj``, ...) multiplies head h's slice of its input
  (the concatenated head outputs) by g_h. The forward call belongs to the user's module, so
  transformers' own ``head_mask`` argument cannot be passed; the tests check the hook against it.
* ``"torch_mha"`` (``nn.MultiheadAttention``): its output projection is applied inside
  ``F.multi_head_attention_forward`` (and in the fused fast path of ``nn.TransformerEncoderLayer``),
  never as a module call, so the projection weight is parametrised as ``W * g`` column-wise
  (``torch.nn.utils.parametrize``, registered while attached): the same as zeroing the head's
  slice of the input. One gate per layer, not per sequence.
* ``"sdpa"`` (modules calling ``torch.nn.functional.scaled_dot_product_attention``): each layer's
  SDPA output (B, H, T, E) is scaled per head by
  :class:`~podmonitor.capture.sdpa.SDPAHeadMask`, before the model merges the heads.
* ``"projection"`` (explicit attention written by hand): a module with a head count attribute
  (``n_head``, ``num_heads``, ...) and a linear output projection child (``c_proj``, ``proj``,
  ``out_proj``, ``o_proj``, ``dense``, ``wo``) whose input is the concatenated heads; or name the
  projections yourself, ``HeadGates(model, projections={"blocks.0.attn.proj": 4, ...})``.

Example:
    >>> gates = HeadGates(model)                 # kind found automatically
    >>> with gates, gates.zeroed({0: [2]}):      # layer 0 head 2 removed
    ...     logits = model(x)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..capture.hooks import HookHandles
from ..models.gpt import CausalSelfAttention

KINDS = ("reference", "huggingface", "torch_mha", "sdpa", "projection")
_PROJECTION_NAMES = ("c_proj", "proj", "out_proj", "o_proj", "dense", "wo")


@dataclass
class GatedLayer:
    """One attention layer that can be gated.

    Attributes:
        name: module path of the attention module (or of its output projection, kind "projection").
        n_head: heads of the layer.
        head_dim: width of one head's slice of the projection input (None for kind "sdpa").
        module: what is hooked: the attention module (reference, torch_mha, sdpa) or the output
            projection (huggingface, projection).
    """

    name: str
    n_head: int
    head_dim: int | None
    module: nn.Module


class _ColumnGate(nn.Module):
    """Parametrisation ``W -> W * g`` over the input columns (head slices) of a projection weight."""

    def __init__(self, owner: HeadGates, index: int, head_dim: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.head_dim = head_dim

    def forward(self, weight: Tensor) -> Tensor:
        g = self.owner._gates.get(self.index)
        if g is None:
            return weight
        return weight * g.to(weight.dtype).repeat_interleave(self.head_dim)[None, :]


def _named_paths(module: nn.Module) -> dict[int, str]:
    return {id(m): p for p, m in module.named_modules()}


def _reference_layers(module: nn.Module) -> list[GatedLayer]:
    paths = _named_paths(module)
    return [GatedLayer(paths[id(m)] or "self", m.n_head, m.n_embd // m.n_head, m)
            for m in module.modules() if isinstance(m, CausalSelfAttention)]


def _hf_gated_layers(module: nn.Module) -> list[GatedLayer] | None:
    from .masking import _hf_layers  # the same projections HeadMasker hooks

    found = _hf_layers(module)
    if found is None:
        return None
    paths = _named_paths(module)
    return [GatedLayer(paths.get(id(layer.out_proj), "?"), layer.n_head, layer.head_dim, layer.out_proj)
            for layer in found[1]]


def _mha_layers(module: nn.Module) -> list[GatedLayer]:
    paths = _named_paths(module)
    return [GatedLayer(paths[id(m)] or "self", m.num_heads, m.head_dim, m)
            for m in module.modules() if isinstance(m, nn.MultiheadAttention)]


def _sdpa_layers(module: nn.Module) -> list[GatedLayer]:
    from ..capture.sdpa import head_count, sdpa_modules

    out = []
    for path, sub in sdpa_modules(module):
        n = head_count(sub)
        if n is None:
            raise ValueError(f"{path} ({type(sub).__name__}) calls scaled_dot_product_attention but has no head count "
                             "attribute (n_head, num_heads, ...): name its output projection with "
                             "HeadGates(model, projections={'<path>.<proj>': n_head})")
        out.append(GatedLayer(path, n, None, sub))
    return out


def _projection_layers(module: nn.Module, projections: Mapping[str, int] | None) -> list[GatedLayer]:
    from ..capture.sdpa import head_count

    named = dict(module.named_modules())
    out: list[GatedLayer] = []
    if projections is not None:
        for path, n in projections.items():
            proj = named.get(path)
            if not isinstance(proj, nn.Linear):
                raise ValueError(f"projections: {path!r} is not an nn.Linear of {type(module).__name__}")
            if n < 1 or proj.in_features % n:
                raise ValueError(f"projections: {path!r} has {proj.in_features} inputs, not divisible by {n} heads")
            out.append(GatedLayer(path, int(n), proj.in_features // int(n), proj))
        return out
    for path, sub in named.items():
        n = head_count(sub) if sub is not module else None
        if n is None:
            continue
        for child in _PROJECTION_NAMES:
            proj = getattr(sub, child, None)
            if isinstance(proj, nn.Linear) and proj.in_features % n == 0:
                out.append(GatedLayer(f"{path}.{child}" if path else child, n, proj.in_features // n, proj))
                break
    return out


class HeadGates:
    """Multiplicative gates on the heads' outputs of a model's attention layers (see the module docstring).

    Args:
        module: the model (a LightningModule, a GPT, a Hugging Face model, any nn.Module).
        kind: one of :data:`KINDS`, or "auto" (the first that fits, in that order).
        projections: for kind "projection": ``{module path of an output projection: heads}``.

    Raises:
        ValueError: no attention layer of the kind (or of any kind) was found.
    """

    def __init__(self, module: nn.Module, kind: str = "auto",
                 projections: Mapping[str, int] | None = None) -> None:
        if kind != "auto" and kind not in KINDS:
            raise ValueError(f"kind must be 'auto' or one of {KINDS}, got {kind!r}")
        self.module = module
        if projections is not None and kind == "auto":
            kind = "projection"
        tried: list[str] = []
        layers: list[GatedLayer] = []
        for k in (KINDS if kind == "auto" else (kind,)):
            try:
                if k == "reference":
                    layers = _reference_layers(module)
                elif k == "huggingface":
                    layers = _hf_gated_layers(module) or []
                elif k == "torch_mha":
                    layers = _mha_layers(module)
                elif k == "sdpa":
                    layers = _sdpa_layers(module)
                else:
                    layers = _projection_layers(module, projections)
            except ValueError as err:
                if kind != "auto":
                    raise
                tried.append(f"{k}: {err}")
                layers = []
            if layers:
                self.kind = k
                break
            tried.append(f"{k}: none found")
        if not layers:
            raise ValueError(f"{type(module).__name__}: no attention heads to gate ({'; '.join(tried)}). "
                             "Name the output projections: HeadGates(model, projections={'<path>': n_head, ...})")
        self.layers = layers
        self._gates: dict[int, Tensor] = {}
        self._hooks = HookHandles()
        self._saved: dict[int, Tensor] = {}  # reference kind: the head_mask buffers while gated
        self._sdpa: Any = None
        self._param_order: list[list[str]] = []  # torch_mha: the projections' parameter names, in order
        self._attached = False

    # ------------------------------------------------------------------ facts
    @property
    def n_heads(self) -> list[int]:
        """Heads per layer, in model order."""
        return [layer.n_head for layer in self.layers]

    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def per_sequence(self) -> bool:
        """Whether a gate may be (B, H), one row per sequence (not for ``nn.MultiheadAttention``)."""
        return self.kind != "torch_mha"

    def inactive(self) -> dict[int, list[int]]:
        """Heads already silenced in the model itself (reference models: ``head_mask == 0``)."""
        if self.kind != "reference":
            return {}
        out = {}
        for i, layer in enumerate(self.layers):
            mask = self._saved.get(i, layer.module.head_mask)
            dead = [h for h, v in enumerate(mask.detach().flatten().tolist()) if v == 0.0]
            if dead:
                out[i] = dead
        return out

    # ------------------------------------------------------------------ attach / detach
    def attach(self) -> None:
        """Install the hooks (idempotent); gates take effect from now on."""
        if self._attached:
            return
        if self.kind in ("huggingface", "projection"):
            for i, layer in enumerate(self.layers):
                self._hooks.add(layer.module.register_forward_pre_hook(self._input_hook(i, layer)))
        elif self.kind == "torch_mha":
            self._param_order = [list(layer.module.out_proj._parameters) for layer in self.layers]
            for i, layer in enumerate(self.layers):
                assert layer.head_dim is not None
                parametrize.register_parametrization(layer.module.out_proj, "weight",
                                                     _ColumnGate(self, i, layer.head_dim), unsafe=True)
        elif self.kind == "sdpa":
            from ..capture.sdpa import SDPAHeadMask

            self._sdpa = SDPAHeadMask(self.module)
        self._attached = True
        self._apply()

    def detach(self) -> None:
        """Clear every gate and remove the hooks: the model is as before (idempotent)."""
        self.clear()
        self._hooks.remove()
        if self.kind == "torch_mha" and self._attached:
            for layer, order in zip(self.layers, self._param_order, strict=True):
                proj = layer.module.out_proj
                if parametrize.is_parametrized(proj, "weight"):
                    parametrize.remove_parametrizations(proj, "weight", leave_parametrized=False)
                params = proj._parameters  # the same Parameter objects, back in their registration order
                items = [(k, params.pop(k)) for k in order if k in params]
                params.update(items)
            self._param_order = []
        if self._sdpa is not None:
            self._sdpa.detach()
            self._sdpa = None
        self._attached = False

    def __enter__(self) -> HeadGates:
        self.attach()
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ------------------------------------------------------------------ gates
    def set(self, gates: Mapping[int, Tensor | Sequence[float]]) -> None:
        """Replace every gate: ``{layer index: (H,) or (B, H)}``; layers not named are not gated.

        Raises:
            ValueError: a layer index or a gate shape is wrong.
            RuntimeError: not attached.
        """
        if not self._attached:
            raise RuntimeError("HeadGates.set outside 'with gates:' (attach first)")
        new: dict[int, Tensor] = {}
        for i, g in gates.items():
            i = int(i)
            if not 0 <= i < len(self.layers):
                raise ValueError(f"layer {i} out of range 0..{len(self.layers) - 1}")
            t = g if isinstance(g, Tensor) else torch.tensor(list(g), dtype=torch.float32)
            h = self.layers[i].n_head
            if t.shape[-1] != h or t.dim() not in (1, 2) or (t.dim() == 2 and not self.per_sequence):
                allowed = "(H,) or (B, H)" if self.per_sequence else "(H,)"
                raise ValueError(f"gate of layer {i} must be {allowed} with H = {h}, got {tuple(t.shape)}")
            new[i] = t
        self._restore_reference()
        self._gates = new
        self._apply()

    def clear(self) -> None:
        """No gate (every head as the model has it)."""
        self._restore_reference()
        self._gates = {}
        if self._sdpa is not None:
            self._sdpa.clear()

    @contextlib.contextmanager
    def zeroed(self, heads: Mapping[int, Sequence[int]]) -> Iterator[None]:
        """Within the block, the heads ``{layer: [heads]}`` are removed (gate 0); cleared afterwards."""
        gates = {}
        for i, hs in heads.items():
            if not hs:
                continue
            g = torch.ones(self.layers[int(i)].n_head)
            g[list(hs)] = 0.0
            gates[int(i)] = g
        self.set(gates)
        try:
            yield
        finally:
            self.clear()

    # ------------------------------------------------------------------ internals
    def _restore_reference(self) -> None:
        for i, buf in self._saved.items():
            self.layers[i].module._buffers["head_mask"] = buf
        self._saved = {}

    def _apply(self) -> None:
        if not self._attached:
            return
        if self.kind == "reference":
            for i, g in self._gates.items():
                attn = self.layers[i].module
                buf = attn.head_mask
                self._saved[i] = buf
                attn._buffers["head_mask"] = buf * g.to(device=buf.device, dtype=buf.dtype)  # (H,) or (B, H)
        elif self.kind == "sdpa":
            self._sdpa.clear()
            for i, g in self._gates.items():
                self._sdpa.set(self.layers[i].name, g)
            if self._gates:
                self._sdpa.attach()
            else:
                self._sdpa.detach()

    def _input_hook(self, index: int, layer: GatedLayer) -> Any:
        head_dim = layer.head_dim
        assert head_dim is not None

        def gate_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            g = self._gates.get(index)
            if g is None:
                return None
            x = args[0]  # (B, T, H * head_dim) or (B, H * head_dim): the concatenated head outputs
            m = g.to(device=x.device, dtype=x.dtype).repeat_interleave(head_dim, dim=-1)  # (H*hd,) or (B, H*hd)
            if m.dim() == 2:
                m = m.reshape(m.shape[0], *([1] * (x.dim() - 2)), m.shape[1])
            return (x * m, *args[1:])

        return gate_input

    def __repr__(self) -> str:
        return f"HeadGates(kind={self.kind!r}, layers={len(self.layers)}, heads={self.n_heads})"


__all__ = ["KINDS", "GatedLayer", "HeadGates"]
