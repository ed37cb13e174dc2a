"""Attention capture: get post-softmax attention probabilities out of a model's validation step.

Adapters (tried in this order by ``select_adapter(module, "auto")``):

- :class:`ProtocolAdapter` ("protocol"): the module defines ``attention_maps(batch)``;
- :class:`SDPAAdapter` ("sdpa"): the model calls ``torch.nn.functional.scaled_dot_product_attention``
  (recomputed and self-checked per call; also the last resort when nothing else applies);
- :class:`HuggingFaceAdapter` ("huggingface"): the module holds a ``transformers.PreTrainedModel``;
- :class:`TorchMHAAdapter` ("torch_mha"): the module contains ``torch.nn.MultiheadAttention``;
- :class:`FunctionAdapter` ("function"): a user function ``fn(module, batch)``.

Every adapter returns a :class:`CapturedAttention`: per-layer (B, H, T, T) float32 fields.
When the monitor needs no per-head maps it sets the adapter's ``reduction``; the protocol
adapter (for models that support it, such as the reference GPT) and the ``sdpa`` adapter then
return a :class:`~podmonitor.capture.reduce.ReducedAttention` instead: per layer the (B, T, T)
head average and the stability sums, formed row block by row block without the maps
(:mod:`podmonitor.capture.reduce`).
:class:`SDPAHeadMask` scales heads' SDPA outputs (head masking for any SDPA model).
"""

from podmonitor.capture.base import CaptureAdapter, CapturedAttention, adapter_classes, select_adapter
from podmonitor.capture.function import FunctionAdapter
from podmonitor.capture.huggingface import HuggingFaceAdapter
from podmonitor.capture.protocol import ProtocolAdapter
from podmonitor.capture.sdpa import SDPAAdapter, SDPAHeadMask
from podmonitor.capture.torch_mha import TorchMHAAdapter

__all__ = [
    "CaptureAdapter",
    "CapturedAttention",
    "FunctionAdapter",
    "HuggingFaceAdapter",
    "ProtocolAdapter",
    "SDPAAdapter",
    "SDPAHeadMask",
    "TorchMHAAdapter",
    "adapter_classes",
    "select_adapter",
]
