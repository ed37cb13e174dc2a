"""CapturedAttention checks, adapter selection, the protocol and function adapters."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from podmonitor.capture import (
    CaptureAdapter,
    CapturedAttention,
    FunctionAdapter,
    ProtocolAdapter,
    TorchMHAAdapter,
    select_adapter,
)


def softmax_maps(n_layers: int, b: int = 2, h: int = 3, t: int = 8, causal: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    maps = []
    for _ in range(n_layers):
        s = torch.randn(b, h, t, t, generator=g)
        if causal:
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        maps.append(s.softmax(-1))
    return maps


class ProtocolModule(nn.Module):
    """Has attention_maps, and also an MHA: the protocol must win (it comes first)."""

    attention_is_causal = True

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def attention_maps(self, batch: torch.Tensor) -> list[torch.Tensor]:
        assert not torch.is_grad_enabled()
        return softmax_maps(2, b=batch.shape[0], causal=True)


# ----------------------------------------------------------------- CapturedAttention
def test_captured_attention_converts_to_detached_float32() -> None:
    f = torch.rand(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    cap = CapturedAttention([f], ["a"], valid=torch.tensor([True, False]), causal=False)
    assert cap.fields[0].dtype == torch.float32 and not cap.fields[0].requires_grad
    assert (cap.batch_size, cap.seq_len) == (2, 5)


def test_captured_attention_allows_different_head_counts() -> None:
    cap = CapturedAttention([torch.rand(2, 4, 5, 5), torch.rand(2, 1, 5, 5)], ["a", "b"])
    assert [f.shape[1] for f in cap.fields] == [4, 1]


@pytest.mark.parametrize(
    ("fields", "names", "valid", "match"),
    [
        ([torch.rand(2, 5, 5)], ["a"], None, r"expected \(B, H, T, T\)"),
        ([torch.rand(2, 3, 4, 5)], ["a"], None, "queries .* and keys .* differ"),
        ([torch.rand(2, 3, 5, 5), torch.rand(2, 3, 6, 6)], ["a", "b"], None, "same B and T"),
        ([torch.rand(2, 3, 5, 5), torch.rand(3, 3, 5, 5)], ["a", "b"], None, "same B and T"),
        ([torch.rand(2, 3, 5, 5)], ["a", "b"], None, "1 attention fields but 2 layer names"),
        ([torch.rand(2, 3, 5, 5)] * 2, ["a", "a"], None, "unique"),
        ([], [], None, "no attention field"),
        ([torch.rand(2, 3, 5, 5)], ["a"], torch.ones(2), "bool tensor"),
        ([torch.rand(2, 3, 5, 5)], ["a"], torch.ones(3, dtype=torch.bool), "bool tensor"),
    ],
)
def test_captured_attention_shape_errors(fields, names, valid, match) -> None:
    with pytest.raises(ValueError, match=match):
        CapturedAttention(fields, names, valid=valid)


def test_captured_attention_type_errors() -> None:
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        CapturedAttention([[1.0]], ["a"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="list of"):
        CapturedAttention.from_maps(torch.rand(1, 2, 3, 3))  # a bare tensor, not a list


# ----------------------------------------------------------------- selection
def test_select_auto_prefers_protocol() -> None:
    module = ProtocolModule()
    assert TorchMHAAdapter.applies(module)  # would also apply, but comes later
    assert isinstance(select_adapter(module), ProtocolAdapter)


def test_select_auto_nothing_fits_lists_every_adapter() -> None:
    with pytest.raises(ValueError) as err:
        select_adapter(nn.Linear(3, 3))
    message = str(err.value)
    for name in ("'protocol'", "'huggingface'", "'torch_mha'", "'function'", "attention_maps", "MultiheadAttention"):
        assert name in message


def test_select_by_name() -> None:
    module = ProtocolModule()
    assert isinstance(select_adapter(module, "torch_mha"), TorchMHAAdapter)
    assert isinstance(select_adapter(module, "protocol"), ProtocolAdapter)
    with pytest.raises(ValueError, match="does not apply"):
        select_adapter(nn.Linear(3, 3), "torch_mha")
    with pytest.raises(ValueError, match="does not apply"):
        select_adapter(nn.Linear(3, 3), "huggingface")
    with pytest.raises(ValueError, match="unknown capture adapter"):
        select_adapter(module, "nope")
    with pytest.raises(ValueError, match="needs the function"):
        select_adapter(module, "function")
    with pytest.raises(TypeError, match="capture must be"):
        select_adapter(module, 3)  # type: ignore[arg-type]


def test_select_instance_class_and_function() -> None:
    module = ProtocolModule()
    adapter = TorchMHAAdapter()
    assert select_adapter(module, adapter) is adapter
    assert isinstance(select_adapter(module, TorchMHAAdapter), TorchMHAAdapter)
    with pytest.raises(ValueError, match="does not apply"):
        select_adapter(nn.Linear(2, 2), TorchMHAAdapter)
    fn_adapter = select_adapter(nn.Linear(2, 2), lambda m, b: softmax_maps(1))
    assert isinstance(fn_adapter, FunctionAdapter)


def test_capture_package_does_not_import_transformers() -> None:
    code = "import sys, podmonitor.capture; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------- protocol adapter
def test_protocol_adapter_collects_maps_and_causal_flag(assert_no_hooks) -> None:
    module = ProtocolModule()
    adapter = select_adapter(module)
    batch = torch.zeros(3, 8)
    with adapter.capturing(module):
        cap = adapter.collect(module, batch, None)
    assert cap.layer_names == ["layer_00", "layer_01"]
    assert cap.causal is True and cap.valid is None
    assert cap.zeros_above_diagonal is False  # no promise made: the stability pass checks
    assert [tuple(f.shape) for f in cap.fields] == [(3, 3, 8, 8)] * 2
    assert_no_hooks(module)


@pytest.mark.parametrize("causal, promise, expected", [(True, True, True), (True, False, False),
                                                       (None, True, False), (False, True, False)])
def test_protocol_adapter_takes_the_zeros_promise_only_with_causal_maps(causal, promise, expected) -> None:
    """``attention_zeros_above_diagonal`` (attribute or method) counts only where the module also
    says its maps are causal; CapturedAttention refuses the promise without ``causal=True``."""

    class Promising(ProtocolModule):
        attention_is_causal = causal  # type: ignore[assignment]

        def attention_zeros_above_diagonal(self) -> bool:
            return promise

    cap = ProtocolAdapter().collect(Promising(), torch.zeros(2, 8), None)
    assert cap.zeros_above_diagonal is expected
    for bad in (None, False):
        with pytest.raises(ValueError, match="zeros_above_diagonal=True needs causal=True"):
            CapturedAttention(softmax_maps(1), ["a"], causal=bad, zeros_above_diagonal=True)


def test_protocol_adapter_shape_error_names_the_method() -> None:
    class Bad(nn.Module):
        def attention_maps(self, batch):
            return [torch.rand(2, 8, 8)]  # heads averaged away

    with pytest.raises(ValueError, match=r"Bad.attention_maps\(batch\).*\(B, H, T, T\)"):
        ProtocolAdapter().collect(Bad(), None, None)


def test_protocol_adapter_on_reference_gpt_lightning_module(assert_no_hooks) -> None:
    from podmonitor.models.lightning import GPTLightningModule

    torch.manual_seed(0)
    module = GPTLightningModule(vocab_size=17, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    adapter = select_adapter(module)
    assert isinstance(adapter, ProtocolAdapter)
    x = torch.randint(0, 17, (2, 16))
    module.eval()
    with adapter.capturing(module):
        outputs = module.model(x, x)[1]
        cap = adapter.collect(module, (x, x), outputs)
    assert cap.causal is True and cap.zeros_above_diagonal is True
    assert len(cap.fields) == 2 and cap.fields[0].shape == (2, 2, 16, 16)
    for f in cap.fields:
        torch.testing.assert_close(f.sum(-1), torch.ones(2, 2, 16))
        assert torch.all(f.triu(1) == 0)
    assert_no_hooks(module)


@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_reference_gpt_keeps_its_zeros_promise(attention) -> None:
    """The reference module promises +0 at every key after its query: every such entry of its
    maps has all bits zero (not -0, not a tiny value), over several row blocks of the explicit
    path, also for EGA and for a model whose scores overflow to NaN in one sequence (its rows
    are then not finite where the query looks, so the monitor skips the sequence)."""
    from podmonitor.models import gpt
    from podmonitor.models.lightning import GPTLightningModule

    t = 2 * gpt.MASK_ROWS + 37
    torch.manual_seed(0)
    module = GPTLightningModule(vocab_size=17, block_size=t, n_layer=2, n_head=2, n_embd=16, dropout=0.0,
                                attention=attention)
    assert module.attention_zeros_above_diagonal is True
    x = torch.randint(0, 17, (2, t), generator=torch.Generator().manual_seed(1))
    cap = ProtocolAdapter().collect(module, (x, x), None)
    above = torch.ones(t, t, dtype=torch.bool).triu(1)
    for f in cap.fields:
        assert torch.count_nonzero(f.view(torch.int32)[..., above]) == 0
    with torch.no_grad():
        module.model.transformer.h[0].attn.c_attn.weight[0, 0] = float("nan")
    for f in ProtocolAdapter().collect(module, (x, x), None).fields:
        bits = f.view(torch.int32)
        rows_not_zero = (bits * above != 0).any(dim=-1)  # (B, H, T): rows with an entry above not +0
        visible_finite = torch.isfinite(f.masked_fill(above, 0.0)).all(dim=-1)
        assert not (rows_not_zero & visible_finite).any()
        assert not visible_finite.all()  # the overflow reached the maps


# ----------------------------------------------------------------- function adapter
def test_function_adapter_list_and_captured_attention() -> None:
    module = nn.Linear(2, 2)
    seen = []

    def fn(m, batch):
        seen.append((m, batch, torch.is_grad_enabled()))
        return softmax_maps(3)

    cap = FunctionAdapter(fn, causal=False).collect(module, "batch", None)
    assert seen == [(module, "batch", False)]
    assert cap.layer_names == ["layer_00", "layer_01", "layer_02"] and cap.causal is False

    own = CapturedAttention(softmax_maps(1), ["mine"], valid=torch.tensor([True, False]), causal=True)
    assert FunctionAdapter(lambda m, b: own).collect(module, None, None) is own


def test_function_adapter_errors() -> None:
    with pytest.raises(TypeError, match="callable"):
        FunctionAdapter(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capture function .*same B and T"):
        FunctionAdapter(lambda m, b: [torch.rand(1, 1, 4, 4), torch.rand(1, 1, 5, 5)]).collect(nn.Linear(1, 1), 0, 0)


def test_capture_adapter_is_abstract() -> None:
    with pytest.raises(TypeError):
        CaptureAdapter()  # type: ignore[abstract]


def test_common_causal_is_the_layers_flag_when_they_agree_and_none_when_they_differ():
    from podmonitor.capture._util import common_causal

    assert common_causal([True, True]) is True and common_causal([False]) is False
    assert common_causal([True, False, True]) is None and common_causal([]) is None
