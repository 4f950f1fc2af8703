"""SFTDataModule: formats, skip reasons, and pitfall: SFT labels labels through the whole module with pad == eos."""

from __future__ import annotations

import json

import pytest

from rlhf_lit.data import SFTDataModule
from tests.data.conftest import byte_ids

HH_CHOSEN = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: Knock knock."


def build(files, tok, **kwargs) -> SFTDataModule:
    kwargs.setdefault("val_size", 0)
    dm = SFTDataModule(train_files=files, tokenizer=tok, **kwargs)
    dm.setup("fit")
    return dm


def texts(tok, dm) -> list[tuple[str, str]]:
    return [(tok.decode(e["prompt_ids"]), tok.decode(e["response_ids"])) for e in dm.train_dataset]


def test_explicit_format_uses_texts_as_given(tok, write_jsonl):
    dm = build(write_jsonl([{"prompt": "Q: 2+2?\nA:", "response": " 4"}]), tok)
    assert texts(tok, dm) == [("Q: 2+2?\nA:", " 4<|endoftext|>")]


def test_alpaca_and_gsm8k_use_the_hh_transcript_form(tok, write_jsonl, tmp_path):
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([
        {"instruction": "Add.", "input": "2 and 2", "output": "4"},
        {"instruction": "Greet.", "input": "", "output": "Hello!"},
    ]))
    gsm8k = write_jsonl([{"question": "What is 3+4?", "answer": "3+4=7\n#### 7"}], "gsm8k.jsonl")
    dm = build([str(alpaca), gsm8k], tok)
    assert texts(tok, dm) == [
        ("\n\nHuman: Add.\n\n2 and 2\n\nAssistant:", " 4<|endoftext|>"),
        ("\n\nHuman: Greet.\n\nAssistant:", " Hello!<|endoftext|>"),
        ("\n\nHuman: What is 3+4?\n\nAssistant:", " 3+4=7\n#### 7<|endoftext|>"),
    ]
    chat = build(gsm8k, tok, chat_template=True)
    assert texts(tok, chat) == [("<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n",
                                 "3+4=7\n#### 7<|im_end|>\n<|endoftext|>")]


def test_messages_last_assistant_is_the_response(tok, write_jsonl):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    (prompt, response), = texts(tok, build(write_jsonl([{"messages": messages}]), tok))
    assert prompt.endswith("<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert response == "ciao<|im_end|>\n<|endoftext|>"


def test_hh_uses_the_chosen_transcript(tok, write_jsonl):
    dm = build(write_jsonl([{"chosen": HH_CHOSEN, "rejected": "ignored"}]), tok)
    assert texts(tok, dm) == [(HH_CHOSEN[: -len(" Knock knock.")], " Knock knock.<|endoftext|>")]


def test_skip_reasons_are_counted(tok, write_jsonl):
    path = write_jsonl([
        {"prompt": "Q", "response": " ok"},
        {"prompt": "Q", "response": "  "},  # empty_response
        {"prompt": "", "response": " ok"},  # empty_prompt
        {"prompt": "Q"},  # missing_field
        {"prompt": "Q", "response": " " + "y" * 30},  # response_too_long
    ])
    dm = build(path, tok, max_length=16)
    assert dm.skip_counter.skipped("train") == {
        "empty_response": 1, "empty_prompt": 1, "missing_field": 1, "response_too_long": 1,
    }
    hh = build(write_jsonl([{"chosen": HH_CHOSEN}, {"chosen": "no markers here"}], "hh.jsonl"), tok)
    assert hh.skip_counter.skipped("train") == {"no_shared_prefix": 1}
    msgs = build(write_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                              {"messages": [{"role": "user", "content": "only a question"}]}], "m.jsonl"), tok)
    assert msgs.skip_counter.skipped("train") == {"empty_response": 1}


def test_b16_labels_keep_the_response_eos_when_pad_equals_eos(tok_pad_eos, write_jsonl):
    rows = [{"prompt": "Q:", "response": " hi there"}, {"prompt": "Q:", "response": " hi"}]
    dm = build(write_jsonl(rows), tok_pad_eos, shuffle=False)
    batch = next(iter(dm.train_dataloader()))
    prompt, long_response, short_response = byte_ids("Q:"), byte_ids(" hi there") + [0], byte_ids(" hi") + [0]
    width = len(prompt) + len(long_response)
    pad = width - len(prompt) - len(short_response)
    assert batch["input_ids"].tolist() == [prompt + long_response, prompt + short_response + [0] * pad]
    assert batch["labels"].tolist() == [
        [-100] * len(prompt) + long_response,
        [-100] * len(prompt) + short_response + [-100] * pad,
    ]
    assert batch["attention_mask"].tolist() == [[1] * width, [1] * (width - pad) + [0] * pad]
    assert (batch["labels"] != -100).sum(1).tolist() == [len(long_response), len(short_response)]


def test_prompt_cut_keeps_bos_and_whole_response(tok_bos, write_jsonl):
    dm = build(write_jsonl([{"prompt": "abcdefghij", "response": " xyz"}]), tok_bos, max_length=10)
    example = dm.train_dataset[0]
    assert example["prompt_ids"][0] == 0 and len(example["prompt_ids"]) == 5  # BOS + "ghij"
    assert tok_bos.decode(example["prompt_ids"][1:]) == "ghij"
    assert example["response_ids"] == byte_ids(" xyz") + [0]


def test_val_split_and_loaders(tok, write_jsonl):
    rows = [{"prompt": f"Q{i}", "response": " ok"} for i in range(20)]
    dm = build(write_jsonl(rows), tok, val_size=4, batch_size=3, val_batch_size=2)
    assert len(dm.train_dataset) == 16 and len(dm.val_dataset) == 4
    assert [len(b["input_ids"]) for b in dm.val_dataloader()] == [2, 2]
    assert sum(len(b["input_ids"]) for b in dm.train_dataloader()) == 16
    with pytest.raises(ValueError, match="nothing is left to train on"):
        build(write_jsonl(rows[:3], "small.jsonl"), tok, val_size=3)
