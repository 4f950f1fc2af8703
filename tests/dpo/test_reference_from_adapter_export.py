"""DPO seeded from an adapter-only SFT export: the reference is the SFT policy (base + frozen SFT adapter),
never the bare base. The SFT policy is computed independently with peft (``PeftModel.from_pretrained``)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from peft import PeftModel

from rlhf_lit.models import BackboneConfig, LoraSettings, load_backbone, save_causal_lm
from rlhf_lit.modules import SFTModule
from rlhf_lit.modules.dpo import sequences
from tests.conftest import TINY_GPT2
from tests.dpo.helpers import LORA, make_data, make_module, plain_response_logps, write_pairs

SFT_LORA = LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc", "c_proj"])


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory) -> str:
    """An adapter-only SFT export whose adapter moves the policy clearly away from the base."""
    path = str(tmp_path_factory.mktemp("sft") / "export")
    sft = SFTModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=copy.deepcopy(SFT_LORA)), export_mode="adapter"
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sft.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2, generator=generator)
    save_causal_lm(
        sft.lm, sft.tokenizer, path, sft.backbone_cfg, "adapter", meta={"kind": "policy", "stage": "sft"}
    )
    assert not os.path.exists(os.path.join(path, "config.json"))  # adapter only
    return path


def test_the_reference_is_the_sft_policy_not_the_bare_base(sft_export, tmp_path):
    module = make_module(BackboneConfig(name_or_path=sft_export, lora=copy.deepcopy(LORA)))
    assert module.lm.base_adapters == ["base_0"]
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(".default." in n for n in trainable)  # the SFT adapter is frozen

    data = make_data(module, write_pairs(tmp_path / "pairs.jsonl"), shuffle=False)
    data.setup("fit")
    ids, mask, prompt_len, response_len = sequences(next(iter(data.train_dataloader())))
    reference = module.run_reference(ids, mask, prompt_len, response_len)

    base = load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    sft = PeftModel.from_pretrained(base, os.path.join(sft_export, "adapter"))
    expected = plain_response_logps(sft, ids, mask, prompt_len, response_len)
    torch.testing.assert_close(reference, expected, rtol=1e-5, atol=1e-4)
    bare = plain_response_logps(
        load_backbone(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")), ids, mask, prompt_len, response_len
    )
    assert (bare - expected).abs().max() > 0.05  # the test can tell the two apart
    # and the fresh DPO adapter starts exactly at the reference: loss log 2
    loss, _ = module._loss(next(iter(data.train_dataloader())), "train")
    assert loss.item() == pytest.approx(0.6931471805599453, abs=1e-6)
