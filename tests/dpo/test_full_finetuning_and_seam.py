"""Full fine-tuning (no LoRA): the reference is a frozen copy or the cache, never the moving weights. And the
seam: DPO's chosen sequence is, token for token, the sequence the SFT stage trains on for the same row."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_lit.data import PreferenceDataModule, SFTDataModule
from rlhf_lit.errors import ConfigError
from rlhf_lit.models import BackboneConfig
from rlhf_lit.modules.dpo import sequences
from tests.conftest import TINY_GPT2
from tests.dpo.helpers import make_data, make_module, make_trainer, write_pairs

FULL = BackboneConfig(tiny=TINY_GPT2, tokenizer="byte")


@pytest.mark.parametrize("reference", ["copy", "cache"])
def test_full_finetuning_trains_every_weight_against_a_fixed_reference(tmp_path, reference):
    kw = {"reference_copy": True} if reference == "copy" else {"reference_cache": str(tmp_path / "cache")}
    module = make_module(FULL, optimizer={"lr": 1e-3}, **kw)
    data = make_data(module, write_pairs(tmp_path / "pairs.jsonl"), shuffle=False)
    data.setup("fit")
    ids, mask, prompt_len, response_len = sequences(next(iter(data.train_dataloader())))
    reference_before = module.run_reference(ids, mask, prompt_len, response_len)
    before = {n: p.detach().clone() for n, p in module.lm.named_parameters()}

    make_trainer(tmp_path, max_steps=2).fit(module, datamodule=data)

    assert all(not torch.equal(p, before[n]) for n, p in module.lm.named_parameters() if "wte" in n)
    policy = module.policy_logps(ids, mask, prompt_len, response_len).detach()
    assert not torch.equal(policy, reference_before)
    reference_after = module.reference.logps(ids, mask, prompt_len, response_len)
    assert torch.equal(reference_after, reference_before)  # the reference did not move with the weights
    if reference == "copy":
        assert not any(p.requires_grad for p in module.reference_lm.parameters())


def test_full_finetuning_without_a_reference_source_is_refused():
    with pytest.raises(ConfigError, match="full fine-tuning"):
        make_module(FULL)
    make_module(FULL, loss_type="simpo")  # reference-free: nothing to refuse


def test_the_chosen_sequence_is_the_sft_sequence_of_the_same_row(tmp_path):
    module = make_module()
    row = {"prompt": "Q: what is 2+2?\nA:", "chosen": " 4, because 2+2=4.", "rejected": " 5"}
    pairs, demos = tmp_path / "pairs.jsonl", tmp_path / "sft.jsonl"
    pairs.write_text(json.dumps(row) + "\n")
    demos.write_text(json.dumps({"prompt": row["prompt"], "response": row["chosen"]}) + "\n")
    common = dict(val_size=0, batch_size=1, max_length=64, tokenizer=module.tokenizer, shuffle=False)
    pref = PreferenceDataModule(train_files=[str(pairs)], format="explicit", **common)
    sft = SFTDataModule(train_files=[str(demos)], format="explicit", **common)
    pref.setup("fit")
    sft.setup("fit")
    dpo_batch, sft_batch = next(iter(pref.train_dataloader())), next(iter(sft.train_dataloader()))
    n = int(sft_batch["attention_mask"].sum())
    assert int(dpo_batch["chosen_attention_mask"].sum()) == n
    assert torch.equal(dpo_batch["chosen_input_ids"][0, :n], sft_batch["input_ids"][0, :n])
    assert torch.equal(dpo_batch["chosen_labels"][0, :n], sft_batch["labels"][0, :n])
    assert int(dpo_batch["prompt_len"][0]) == int(sft_batch["prompt_len"][0])
