"""Head masks: the reference GPT against an independent construction, reversibility, permanence, HF."""

from __future__ import annotations

import copy

import pytest
import torch

from podmonitor.models.gpt import GPT, GPTConfig
from podmonitor.pruning import HeadMasker


def tiny_gpt(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=11, block_size=12, n_layer=2, n_head=4, n_embd=16, dropout=0.0)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).double().eval()


def zero_head_by_hand(model: GPT, layer: int, head: int) -> GPT:
    """Independent reference: a copy whose c_proj ignores the head's slice of its input."""
    ref = copy.deepcopy(model)
    attn = ref.transformer.h[layer].attn
    hs = attn.n_embd // attn.n_head
    with torch.no_grad():
        attn.c_proj.weight[:, head * hs:(head + 1) * hs] = 0.0
    return ref


@pytest.mark.parametrize("attention", ["softmax", "ega"])
def test_mask_equals_removing_the_head_in_both_paths(attention):
    model = tiny_gpt(attention=attention)
    x = torch.randint(0, 11, (2, 12))
    ref_logits, _ = zero_head_by_hand(model, 1, 2)(x)
    HeadMasker(model).apply({1: [2]})
    fused, _ = model(x)
    explicit, _, atts = model(x, return_attention=True)
    torch.testing.assert_close(fused, ref_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(explicit, ref_logits, rtol=1e-10, atol=1e-10)
    assert atts[1].shape == (2, 4, 12, 12)  # the probabilities are still computed and returned


def test_restore_is_exact_after_training_with_weight_decay():
    model = tiny_gpt().train()
    x = torch.randint(0, 11, (4, 12))
    before = copy.deepcopy(model.state_dict())
    masker = HeadMasker(model)
    masker.apply({0: [1], 1: [0, 3]})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(x, x)[1].backward()
        opt.step()
    attn = model.transformer.h[0].attn
    assert not torch.equal(attn.c_attn.weight[16 * 2 + 4:16 * 2 + 8], before["transformer.h.0.attn.c_attn.weight"][
        16 * 2 + 4:16 * 2 + 8])  # weight decay moved the masked head's value rows
    masker.restore()
    after = model.state_dict()
    hs = 4
    for layer, h in ((0, 1), (1, 0), (1, 3)):
        key = f"transformer.h.{layer}.attn."
        for part in range(3):
            rows = slice(part * 16 + h * hs, part * 16 + (h + 1) * hs)
            torch.testing.assert_close(after[key + "c_attn.weight"][rows], before[key + "c_attn.weight"][rows])
        torch.testing.assert_close(after[key + "c_proj.weight"][:, h * hs:(h + 1) * hs],
                                   before[key + "c_proj.weight"][:, h * hs:(h + 1) * hs])
        assert torch.equal(after[key + "head_mask"], torch.ones(4, dtype=torch.float64))
    # an unpruned head kept its training
    key = "transformer.h.0.attn.c_attn.weight"
    assert not torch.equal(after[key][:4], before[key][:4])


def test_make_permanent_zeroes_the_head_and_ends_reversibility():
    model = tiny_gpt()
    x = torch.randint(0, 11, (2, 12))
    masker = HeadMasker(model)
    masker.apply({0: [3]})
    masked, _ = model(x)
    masker.make_permanent()
    model.transformer.h[0].attn.clear_head_mask()  # the head's output is zero even without the mask
    torch.testing.assert_close(model(x)[0], masked, rtol=1e-10, atol=1e-10)
    with pytest.raises(RuntimeError, match="permanent"):
        masker.restore()
    with pytest.raises(RuntimeError, match="permanent"):
        masker.apply({1: [0]})


def test_masker_rejects_bad_heads_and_state_round_trips():
    model = tiny_gpt()
    masker = HeadMasker(model)
    with pytest.raises(ValueError, match="without a head"):
        masker.apply({0: [0, 1, 2, 3]})
    with pytest.raises(ValueError, match="out of range"):
        masker.apply({5: [0]})
    masker.apply({1: [2]})
    state = masker.state_dict()
    fresh = tiny_gpt()
    other = HeadMasker(fresh)
    other.load_state_dict(state)
    assert torch.equal(fresh.transformer.h[1].attn.head_mask, torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64))
    other.restore()
    assert torch.equal(fresh.transformer.h[1].attn.head_mask, torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="no podmonitor reference attention"):
        HeadMasker(torch.nn.Linear(2, 2))


def test_old_checkpoint_without_head_mask_loads():
    model = tiny_gpt()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("head_mask")}
    fresh = tiny_gpt(seed=5)
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh.transformer.h[0].attn.head_mask, torch.ones(4, dtype=torch.float64))
    x = torch.randint(0, 11, (1, 12))
    torch.testing.assert_close(fresh(x)[0], model(x)[0])


def test_huggingface_gpt2_mask_equals_its_own_head_mask_and_prune_heads():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=16, vocab_size=20, n_positions=16,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.config._attn_implementation = "eager"
    x = torch.randint(0, 20, (2, 10))
    head_mask = torch.ones(2, 4)
    head_mask[1, 2] = 0.0
    with torch.no_grad():
        plain = model(x).logits
        ref = model(x, head_mask=head_mask).logits  # transformers' own head mask (independent path)
    masker = HeadMasker(model)
    masker.apply({1: [2]})
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref, rtol=1e-5, atol=1e-5)
    masker.restore()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, plain)
    masker.apply({1: [2]})
    masker.make_permanent()
    assert model.transformer.h[1].attn.num_heads == 3 and model.config.pruned_heads == {1: [2]}
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref, rtol=1e-5, atol=1e-5)
