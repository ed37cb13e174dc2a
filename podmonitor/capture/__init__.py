"""Attention capture: get post-softmax attention probabilities out of a model's validation step.

Adapters (tried in this order by ``select_adapter(module, "auto")``):

- :class:`ProtocolAdapter` ("protocol"): the module defines ``attention_maps(batch)``;
- :class:`HuggingFaceAdapter` ("huggingface"): the module holds a ``transformers.PreTrainedModel``;
- :class:`TorchMHAAdapter` ("torch_mha"): the module contains ``torch.nn.MultiheadAttention``;
- :class:`FunctionAdapter` ("function"): a user function ``fn(module, batch)``.

Every adapter returns a :class:`CapturedAttention`: per-layer (B, H, T, T) float32 fields.
"""

from podmonitor.capture.base import CaptureAdapter, CapturedAttention, adapter_classes, select_adapter
from podmonitor.capture.function import FunctionAdapter
from podmonitor.capture.huggingface import HuggingFaceAdapter
from podmonitor.capture.protocol import ProtocolAdapter
from podmonitor.capture.torch_mha import TorchMHAAdapter

__all__ = [
    "CaptureAdapter",
    "CapturedAttention",
    "FunctionAdapter",
    "HuggingFaceAdapter",
    "ProtocolAdapter",
    "TorchMHAAdapter",
    "adapter_classes",
    "select_adapter",
]
