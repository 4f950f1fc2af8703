"""Loading a frozen adapter (PPO's reward adapter) must not switch the shared base to eval mode.

peft's ``load_adapter`` calls ``eval()`` on the whole model for a non-trainable adapter; in eval mode
transformers skips gradient checkpointing, so the policy's training forwards would keep every activation
(found with the QLoRA PPO preset: Lightning warned of 3759 modules in eval mode at the start of training).
"""

from __future__ import annotations

from rlhf_lit.models import AdaptedLM, BackboneConfig, LoraSettings, load_backbone
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from tests.conftest import TINY_GPT2


def test_add_saved_adapter_keeps_train_mode(tmp_path):
    tok = build_byte_tokenizer()
    lora = LoraSettings(r=4, target_modules=["c_attn"])
    donor = AdaptedLM(load_backbone(BackboneConfig(tiny=TINY_GPT2), tok), {"reward": lora})
    donor.model.save_pretrained(tmp_path, selected_adapters=["reward"])
    lm = AdaptedLM(
        load_backbone(BackboneConfig(tiny=TINY_GPT2, gradient_checkpointing=True), tok),
        {"actor": lora, "critic": lora},
    )
    lm.train()
    lm.add_saved_adapter(str(tmp_path / "reward"), "reward")
    assert all(m.training for m in lm.modules())
    assert lm.active_adapter == "actor"
    assert not any(p.requires_grad for p in lm.adapter_parameters("reward"))
    assert all(p.requires_grad for p in lm.adapter_parameters("critic"))
