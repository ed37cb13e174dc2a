"""HuggingFaceAdapter on tiny randomly initialised GPT-2 and BERT models (no download)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from podmonitor.capture import HuggingFaceAdapter, select_adapter  # noqa: E402
from podmonitor.capture.huggingface import config_causal  # noqa: E402

VOCAB, T = 50, 12


class HFModule(nn.Module):
    """A LightningModule stand-in whose validation step calls the wrapped model on a dict batch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def validation_step(self, batch: dict, batch_idx: int) -> Any:
        return self.model(**batch)


def gpt2(**config: Any) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64, **config)
    return transformers.GPT2LMHeadModel(cfg).eval()


def bert(**config: Any) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        **config,
    )
    return transformers.BertModel(cfg).eval()


def eager_reference(model: nn.Module, factory) -> nn.Module:
    """The same weights in a model built with eager attention from the start."""
    ref = factory(attn_implementation="eager")
    ref.load_state_dict(model.state_dict())
    assert ref.config._attn_implementation == "eager"
    return ref.eval()


def config_state(model: nn.Module) -> list[dict]:
    return [dict(vars(m.config)) for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]


def capture(module: HFModule, batch: dict, adapter: HuggingFaceAdapter | None = None):
    adapter = adapter or select_adapter(module)
    assert isinstance(adapter, HuggingFaceAdapter)
    with torch.no_grad():
        adapter.start(module)
        try:
            outputs = module.validation_step(batch, 0)
            captured = adapter.collect(module, batch, outputs)
        finally:
            adapter.stop()
    return captured, outputs


def batch_of(b: int = 3, pad_row: int | None = None) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (b, T), generator=g)
    mask = torch.ones_like(ids)
    if pad_row is not None:
        mask[pad_row, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_huggingface_gpt2_matches_eager_reference(assert_no_hooks) -> None:
    model = gpt2()
    module = HFModule(model)
    batch = batch_of()
    before = config_state(model)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        plain_logits = model(**batch).logits
        reference = eager_reference(model, gpt2)(**batch, output_attentions=True)

    captured, outputs = capture(module, batch)

    assert captured.layer_names == ["layer_00", "layer_01"]
    assert captured.causal is True
    assert captured.valid.tolist() == [True, True, True]
    for field, ref in zip(captured.fields, reference.attentions, strict=True):
        assert field.shape == (3, 2, T, T) and field.dtype == torch.float32
        torch.testing.assert_close(field, ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(field.sum(-1), torch.ones(3, 2, T))
        assert torch.all(field.triu(1) == 0)
    # the validation step got the output it asked for, with the same numbers
    assert outputs.attentions is None and "attentions" not in outputs
    torch.testing.assert_close(outputs.logits, plain_logits, atol=1e-5, rtol=1e-5)
    # everything restored: sdpa again, configs identical, no hooks
    assert model.config._attn_implementation == "sdpa"
    assert config_state(model) == before
    assert_no_hooks(module)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, plain_logits, atol=0, rtol=0)


def test_huggingface_tuple_outputs_stay_tuples() -> None:
    model = gpt2()
    module = HFModule(model)
    batch = {**batch_of(), "labels": batch_of()["input_ids"], "return_dict": False}
    with torch.no_grad():
        plain = model(**batch)
    captured, outputs = capture(module, batch)
    assert isinstance(outputs, tuple) and len(outputs) == len(plain)
    torch.testing.assert_close(outputs[0], plain[0], atol=1e-5, rtol=1e-5)  # loss
    torch.testing.assert_close(outputs[1], plain[1], atol=1e-5, rtol=1e-5)  # logits
    assert len(captured.fields) == 2


def test_huggingface_attentions_kept_when_the_caller_asks_for_them() -> None:
    model = gpt2()
    module = HFModule(model)
    batch = {**batch_of(), "output_attentions": True}
    captured, outputs = capture(module, batch)
    torch.testing.assert_close(outputs.attentions[0], captured.fields[0])


def test_huggingface_bert_padding_marks_invalid(assert_no_hooks) -> None:
    model = bert()
    module = HFModule(model)
    batch = batch_of(pad_row=1)
    before = config_state(model)
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        reference = eager_reference(model, bert)(**batch, output_attentions=True)

    captured, outputs = capture(module, batch)

    assert captured.valid.tolist() == [True, False, True]
    assert captured.causal is False
    for field, ref in zip(captured.fields, reference.attentions, strict=True):
        torch.testing.assert_close(field, ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(field.sum(-1), torch.ones(3, 2, T))
        assert torch.all(field[1, :, :, -4:] == 0)  # padded keys get no weight
        assert torch.any(field[0].triu(1) > 0)  # bidirectional
    torch.testing.assert_close(outputs.last_hidden_state, plain, atol=1e-5, rtol=1e-5)
    assert config_state(model) == before
    assert_no_hooks(module)


def test_huggingface_valid_from_batch_mask_when_model_gets_none() -> None:
    class NoMaskModule(HFModule):
        def validation_step(self, batch: dict, batch_idx: int) -> Any:
            return self.model(batch["input_ids"])  # positional, no attention_mask

    captured, _ = capture(NoMaskModule(bert()), batch_of(pad_row=2))
    assert captured.valid.tolist() == [True, True, False]


def test_huggingface_no_hooks_after_exception_in_forward(assert_no_hooks) -> None:
    model = gpt2()
    module = HFModule(model)
    before = config_state(model)
    bad = {"input_ids": torch.full((2, T), VOCAB + 5)}  # out of vocabulary: the embedding raises
    adapter = select_adapter(module)
    with pytest.raises(IndexError), torch.no_grad(), adapter.capturing(module):
        assert model.config._attn_implementation == "eager"
        module.validation_step(bad, 0)
    assert model.config._attn_implementation == "sdpa"
    assert config_state(model) == before
    assert_no_hooks(module)


def test_huggingface_step_without_model_call_is_a_clear_error(assert_no_hooks) -> None:
    class Lazy(HFModule):
        def validation_step(self, batch: dict, batch_idx: int) -> Any:
            return None

    module = Lazy(gpt2())
    with pytest.raises(RuntimeError, match="was not called during Lazy.validation_step"):
        capture(module, batch_of())
    assert_no_hooks(module)


def test_huggingface_model_lookup() -> None:
    model = gpt2()
    assert HuggingFaceAdapter.applies(model)
    assert isinstance(select_adapter(model), HuggingFaceAdapter)  # the module is the model
    nested = nn.Sequential(nn.Identity(), nn.ModuleDict({"inner": HFModule(model)}))
    assert isinstance(select_adapter(nested, "huggingface"), HuggingFaceAdapter)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = gpt2(), bert()

        def validation_step(self, batch: dict, batch_idx: int) -> Any:
            return self.b(**batch)

    two = Two()
    with pytest.raises(ValueError, match="several Hugging Face models"):
        capture(two, batch_of(), HuggingFaceAdapter())
    captured, _ = capture(two, batch_of(), HuggingFaceAdapter(model="b"))
    assert captured.causal is False


def test_huggingface_config_causal() -> None:
    assert config_causal(gpt2()) is True
    assert config_causal(gpt2().transformer) is True  # base GPT2Model: no LM head, still causal
    assert config_causal(bert()) is False
    assert config_causal(bert(is_decoder=True)) is True
