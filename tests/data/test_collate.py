"""Collation: pitfall: SFT labels labels, masks from lengths with pad == eos (pitfall: score token), left padding for prompts."""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.data.collate import PreferenceCollator, PromptCollator, SFTCollator


def test_b16_sft_labels_keep_eos_when_pad_equals_eos():
    # Toy vocab {<pad>:0, <s>:1, </s>:2, <|user|>:3, <|assistant|>:4, hi:5, hello:6, there:7}, pad = eos = 2.
    examples = [
        {"prompt_ids": [1, 3, 5, 4], "response_ids": [6, 7, 2]},
        {"prompt_ids": [1, 3, 5, 4], "response_ids": [6, 2]},
    ]
    batch = SFTCollator(pad_token_id=2)(examples)
    assert batch["input_ids"].tolist() == [[1, 3, 5, 4, 6, 7, 2], [1, 3, 5, 4, 6, 2, 2]]
    assert batch["labels"].tolist() == [[-100, -100, -100, -100, 6, 7, 2], [-100, -100, -100, -100, 6, 2, -100]]
    assert batch["attention_mask"].tolist() == [[1] * 7, [1] * 6 + [0]]  # the real EOS keeps mask 1
    assert batch["prompt_len"].tolist() == [4, 4]


def test_sft_collator_refuses_an_example_with_no_response():
    with pytest.raises(ValueError, match="no response tokens"):
        SFTCollator(pad_token_id=0)([{"prompt_ids": [1, 2], "response_ids": []}])


def test_preference_collator_pads_both_sides_to_one_length_with_masks_from_lengths():
    pad = eos = 2
    examples = [
        {"prompt_ids": [5, 6, eos], "chosen_ids": [7, 8, eos], "rejected_ids": [9, eos], "margin": 1.5, "source": 1},
        {"prompt_ids": [5], "chosen_ids": [7, eos], "rejected_ids": [8, 9, 9, 9, eos], "margin": None, "source": 0},
    ]
    batch = PreferenceCollator(pad_token_id=pad)(examples)
    assert batch["chosen_input_ids"].tolist() == [[5, 6, 2, 7, 8, 2], [5, 7, 2, 2, 2, 2]]
    assert batch["rejected_input_ids"].tolist() == [[5, 6, 2, 9, 2, 2], [5, 8, 9, 9, 9, 2]]
    assert batch["chosen_attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch["rejected_attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert batch["chosen_labels"].tolist() == [[-100, -100, -100, 7, 8, 2], [-100, 7, 2, -100, -100, -100]]
    torch.testing.assert_close(batch["margin"], torch.tensor([1.5, 0.0]))
    assert batch["source"].tolist() == [1, 0]
    assert batch["chosen_response_len"].tolist() == [3, 2]
    assert batch["rejected_response_len"].tolist() == [2, 5]
    assert batch["prompt_len"].tolist() == [3, 1]
    assert batch["source"].dtype == torch.long and batch["margin"].dtype == torch.float32


def test_pad_to_multiple_of():
    examples = [{"prompt_ids": [5], "chosen_ids": [7, 0], "rejected_ids": [8, 0]}]
    assert PreferenceCollator(pad_token_id=1, pad_to_multiple_of=8)(examples)["chosen_input_ids"].shape == (1, 8)


def test_prompt_collator_left_pads():
    examples = [
        {"prompt_ids": [5, 6, 7], "prompt_index": 4, "reference": "7", "prompt_text": "abc"},
        {"prompt_ids": [0, 8], "prompt_index": 9, "reference": None, "prompt_text": "d"},
    ]
    batch = PromptCollator(pad_token_id=0)(examples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]  # the real id 0 keeps mask 1
    assert batch["prompt_index"].tolist() == [4, 9]
    assert batch["reference"] == ["7", None] and batch["prompt_text"] == ["abc", "d"]
    fixed = PromptCollator(pad_token_id=0, pad_to_length=6)(examples)
    assert fixed["input_ids"].tolist() == [[0, 0, 0, 5, 6, 7], [0, 0, 0, 0, 0, 8]]
    assert fixed["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
    assert PromptCollator(pad_token_id=0, pad_to_multiple_of=4)(examples)["input_ids"].shape == (2, 4)
