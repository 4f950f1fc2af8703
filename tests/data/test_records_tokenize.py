"""SkipCounter, the HH helpers, left truncation (docs/pitfalls.md: degenerate pairs) and the tokenisation rules."""

from __future__ import annotations

import pytest

from rlhf_lit.data import SkipCounter
from rlhf_lit.data.records import (
    gsm8k_reference,
    hh_first_turn_prompt,
    parse_hh_messages,
    split_hh_pair,
    split_hh_transcript,
)
from rlhf_lit.data.tokenize import Tokenization, fit_prompt, left_truncate
from tests.data.conftest import byte_ids

HH_CHOSEN = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: Knock knock."
HH_REJECTED = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: No."


def test_skip_counter_report_and_metrics():
    counter = SkipCounter(max_length=8)
    counter.add_source("train", "hh.jsonl.gz")
    counter.count_seen("train", 1000)
    counter.count_skip("train", "identical_pair")
    counter.count_skip("train", "empty_chosen")
    counter.set_kept("train", 998)
    assert counter.report("train") == (
        "train: kept 998 of 1000 rows from hh.jsonl.gz; skipped 2: empty_chosen=1, identical_pair=1 (max_length=8)"
    )
    assert counter.as_metrics("train") == {
        "data/train/kept": 998.0,
        "data/train/skipped_empty_chosen": 1.0,
        "data/train/skipped_identical_pair": 1.0,
    }
    with pytest.raises(ValueError, match="unknown skip reason"):
        counter.count_skip("train", "too_long")


def test_split_hh_pair_takes_the_last_shared_assistant_marker():
    prompt, chosen, rejected = split_hh_pair(HH_CHOSEN, HH_REJECTED)
    assert prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant:"
    assert (chosen, rejected) == (" Knock knock.", " No.")  # leading space kept, as in the data
    assert prompt + chosen == HH_CHOSEN
    assert split_hh_pair("The sky is blue.", "The sky is green.") is None


def test_split_hh_pair_when_transcripts_diverge_inside_a_marker_word():
    # They share "\n\nHuman: hi\n\nAssistant: A" only; the prompt stops at the last FULL shared marker.
    prompt, chosen, rejected = split_hh_pair("\n\nHuman: hi\n\nAssistant: Apple", "\n\nHuman: hi\n\nAssistant: Apricot")
    assert prompt == "\n\nHuman: hi\n\nAssistant:" and chosen == " Apple" and rejected == " Apricot"


def test_hh_transcript_helpers():
    assert split_hh_transcript(HH_CHOSEN) == (HH_CHOSEN[: -len(" Knock knock.")], " Knock knock.")
    assert hh_first_turn_prompt(HH_CHOSEN) == "\n\nHuman: hi\n\nAssistant:"
    assert parse_hh_messages("\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant:") == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "joke?"},
    ]
    assert gsm8k_reference("3 + 4 = 7\n#### 1,007") == "1007"
    assert gsm8k_reference("no final answer") is None


def test_b02_left_truncation_keeps_the_differing_tokens():
    prompt, chosen, rejected = [11, 12, 13, 14, 15, 16], [21, 22, 23], [21, 22, 24]
    cut = fit_prompt(prompt, (len(chosen), len(rejected)), max_length=8)
    assert cut == [12, 13, 14, 15, 16]  # right truncation would give two copies of [11..16, 21, 22]
    assert cut + chosen == [12, 13, 14, 15, 16, 21, 22, 23]
    assert cut + rejected == [12, 13, 14, 15, 16, 21, 22, 24]


def test_fit_prompt_limits():
    assert fit_prompt([1, 2, 3], (7,), max_length=8) == [3]
    assert fit_prompt([1, 2, 3], (8,), max_length=8) is None  # no room for min_prompt_tokens=1
    assert fit_prompt([1, 2, 3], (5,), max_length=8, min_prompt_tokens=3) == [1, 2, 3]
    assert fit_prompt([1, 2, 3, 4], (5,), max_length=8, min_prompt_tokens=4) is None
    assert fit_prompt([1, 2, 3, 4], (2,), max_length=8, max_prompt_length=2) == [3, 4]
    assert fit_prompt([9, 1, 2, 3], (5,), max_length=8, keep_first=True) == [9, 2, 3]
    assert left_truncate([9, 1, 2, 3, 4], 1, keep_first=True) == [9]
    assert left_truncate([1, 2], 0) == []


def test_prompt_and_response_are_encoded_separately_with_eos(tok, tok_pad_eos):
    rules = Tokenization(tok, max_length=64)
    assert not rules.adds_bos
    assert rules.encode_prompts(["Q:"], [False]) == [byte_ids("Q:")]
    assert rules.encode_responses([" A", " B<|endoftext|>"]) == [byte_ids(" A") + [0], byte_ids(" B") + [0]]
    assert Tokenization(tok, max_length=64, append_eos=False).encode_responses([" A"]) == [byte_ids(" A")]


def test_bos_is_added_to_plain_prompts_only_once(tok_bos):
    rules = Tokenization(tok_bos, max_length=64)
    assert rules.adds_bos
    prompts = rules.encode_prompts(["Q:", "<|endoftext|>Q:", "<|im_start|>user\n"], [False, False, True])
    assert prompts == [[0] + byte_ids("Q:"), [0] + byte_ids("Q:"), [2] + byte_ids("user\n")]
    assert rules.encode_responses([" A"]) == [byte_ids(" A") + [0]]  # no BOS on responses


def test_chat_rendering_gives_the_exact_response_boundary(tok):
    rules = Tokenization(tok, max_length=64)
    messages = [{"role": "user", "content": "hi"}]
    prompt, response, rendered = rules.render(messages, {"role": "assistant", "content": "yo"})
    assert rendered and prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert response == "yo<|im_end|>\n"


def test_chat_template_without_prefix_property_is_detected(tok):
    import copy

    odd = copy.deepcopy(tok)
    # A template that renders the generation prompt differently from the assistant turn.
    odd.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[gen]{% endif %}"
    )
    _, response, _ = Tokenization(odd, max_length=64).render([{"role": "user", "content": "hi"}], {"role": "assistant", "content": "yo"})
    assert response is None


def test_tokenization_rejects_bad_settings(tok):
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenization(None)
    with pytest.raises(ValueError, match="min_prompt_tokens"):
        Tokenization(tok, max_length=4, min_prompt_tokens=4)
    with pytest.raises(ValueError, match="max_prompt_length"):
        Tokenization(tok, max_length=8, max_prompt_length=0)
