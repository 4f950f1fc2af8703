"""The DataModules on the real files in ../shared/data (read in place), with the byte tokenizer."""

from __future__ import annotations

import pytest

from rlhf_lit.data import PreferenceDataModule, PromptDataModule, SFTDataModule

HH_FILES = ("preference/hh-rlhf_harmless-base_test.jsonl.gz", "preference/hh-rlhf_helpful-base_test.jsonl.gz")


@pytest.fixture(scope="module")
def hh_module(request):
    from tests.conftest import SHARED_DATA
    from tests.data.conftest import build_byte_tokenizer

    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} is not present")
    dm = PreferenceDataModule(
        train_files=[str(SHARED_DATA / f) for f in HH_FILES], val_size=200, max_train_samples_per_file=500,
        max_length=512, tokenizer=build_byte_tokenizer(),
    )
    dm.setup("fit")
    return dm


def test_hh_counts_are_plausible_and_add_up(hh_module):
    counter = hh_module.skip_counter
    skipped = counter.skipped("train")
    # Measured on these files: 4 empty chosen (harmless), 4 empty rejected and 2 identical responses
    # (helpful); with byte-level tokens, responses over 511 bytes cannot fit max_length=512.
    assert skipped["empty_chosen"] == 4 and skipped["empty_rejected"] == 4 and skipped["identical_pair"] == 2
    assert 400 < skipped["response_too_long"] < 900
    assert set(skipped) == {"empty_chosen", "empty_rejected", "identical_pair", "response_too_long"}
    assert len(hh_module.train_dataset) == 1000 and len(hh_module.val_dataset) == 400
    report = hh_module.data_report()["train"]
    assert report.startswith("train: kept 1000 of 4666 rows from hh-rlhf_harmless-base_test.jsonl.gz")
    assert "held out 400 for val" in report and report.endswith("(max_length=512)")
    assert hh_module.source_names == ["hh-rlhf_harmless-base_test", "hh-rlhf_helpful-base_test"]
    per_source = [sum(e["source"] == s for e in hh_module.val_dataset) for s in (0, 1)]
    assert per_source == [200, 200]


def test_hh_kept_pairs_differ_fit_and_end_their_prompt_at_the_assistant_marker(hh_module):
    tok = hh_module.tokenizer
    marker = tok("\n\nAssistant:", add_special_tokens=False)["input_ids"]
    for dataset in (hh_module.train_dataset, hh_module.val_dataset):
        for e in dataset:
            assert e["prompt_ids"] + e["chosen_ids"] != e["prompt_ids"] + e["rejected_ids"]
            assert len(e["prompt_ids"]) + max(len(e["chosen_ids"]), len(e["rejected_ids"])) <= 512
            tail = min(len(marker), len(e["prompt_ids"]))  # a prompt cut to fit may be shorter than the marker
            assert e["prompt_ids"][-tail:] == marker[-tail:]
            assert e["chosen_ids"][-1] == tok.eos_token_id == e["rejected_ids"][-1]
    batch = next(iter(hh_module.train_dataloader()))
    assert not (batch["chosen_input_ids"] == batch["rejected_input_ids"]).all(dim=1).any()


def test_prompt_and_sft_files(shared_data):
    from tests.data.conftest import build_byte_tokenizer

    tok = build_byte_tokenizer(pad_equals_eos=True)
    prompts = PromptDataModule(
        train_files=[str(shared_data / "prompts/oasst_prompt_lottery_en_250.jsonl"),
                     str(shared_data / "sft/gsm8k_test.jsonl"), str(shared_data / HH_FILES[0])],
        val_size=10, hh_first_turn_only=True, pad_to_length=64, batch_size=16, tokenizer=tok,
    )
    prompts.setup("fit")
    assert len(prompts.train_dataset) + len(prompts.val_dataset) == 250 + 1319 + 2312
    batch = next(iter(prompts.train_dataloader()))
    assert batch["input_ids"].shape == (16, 64) and batch["attention_mask"][:, -1].all()
    gsm8k = [e for e in prompts.train_dataset if e["source"] == 1]
    assert all(e["reference"] is not None for e in gsm8k)

    sft = SFTDataModule(train_files=[str(shared_data / "sft/gsm8k_train.jsonl"),
                                     str(shared_data / "sft/llamafactory_alpaca_en_demo.json")],
                        max_train_samples_per_file=200, val_size=20, max_length=1024, tokenizer=tok)
    sft.setup("fit")
    assert len(sft.train_dataset) == 400 and len(sft.val_dataset) == 40
    batch = next(iter(sft.train_dataloader()))
    assert ((batch["labels"] != -100).sum(1) > 0).all()
