"""Files shaped like public datasets load by config alone (format "auto"), with the right counts and skips.

Shapes: LLaMA-Factory's ShareGPT DPO demo (``conversations`` of ``{from, value}`` + ``chosen``/``rejected``
messages), KTO-style unpaired rows (TRL's prompt/completion/label and LLaMA-Factory's messages + label), an
Open-Assistant ``*.trees.jsonl`` message tree, and HH-RLHF rows one of which has an extra ``Human:`` turn.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_lit.data import DataFormatError, PreferenceDataModule, PromptDataModule, SFTDataModule

EOS = "<|endoftext|>"


def build(cls, files, tok, **kwargs):
    kwargs.setdefault("val_size", 0)
    dm = cls(train_files=files, tokenizer=tok, **kwargs)
    dm.setup("fit")
    return dm


def decoded(tok, example, keys=("prompt_ids", "chosen_ids", "rejected_ids")):
    return tuple(tok.decode(example[k]) for k in keys)


SHAREGPT_DPO = [
    {
        "conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi there"}],
        "chosen": {"from": "gpt", "value": "Hello!"},
        "rejected": {"from": "gpt", "value": "Go away."},
    },
    {
        "conversations": [{"from": "human", "value": "2+2?"}],
        "chosen": {"from": "gpt", "value": "4"},
        "rejected": {"from": "gpt", "value": "  4 "},
    },  # equal after whitespace normalisation
    {
        "conversations": [{"from": "function_call", "value": "{}"}],
        "chosen": {"from": "gpt", "value": "a"},
        "rejected": {"from": "gpt", "value": "b"},
    },  # a tool turn: unknown_role
]


def test_sharegpt_dpo_rows_map_roles_and_skip_identical_and_tool_rows(tok, tmp_path):
    path = tmp_path / "dpo_en_demo.json"
    path.write_text(json.dumps(SHAREGPT_DPO))
    dm = build(PreferenceDataModule, str(path), tok)
    assert len(dm.train_dataset) == 1
    assert dm.skip_counter.skipped("train") == {"identical_pair": 1, "unknown_role": 1}
    prompt, chosen, rejected = decoded(tok, dm.train_dataset[0])
    assert prompt == (
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chosen == "Hello!<|im_end|>\n" + EOS and rejected == "Go away.<|im_end|>\n" + EOS


def test_sharegpt_for_sft_and_prompts(tok, write_jsonl):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "yo"},
                {"from": "human", "value": "bye"},
                {"from": "GPT", "value": "ciao"},
            ]
        }
    ]
    path = write_jsonl(rows, "sharegpt.jsonl")
    sft = build(SFTDataModule, path, tok)
    prompt, response = decoded(tok, sft.train_dataset[0], ("prompt_ids", "response_ids"))
    assert prompt.endswith("<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n")
    assert response == "ciao<|im_end|>\n" + EOS
    prompts = build(PromptDataModule, path, tok)
    assert tok.decode(prompts.train_dataset[0]["prompt_ids"]) == prompt  # the last reply is dropped


TRL_KTO = [
    {"prompt": "Q1", "completion": " good one", "label": True},
    {"prompt": "Q1", "completion": " bad one", "label": False},
    {"prompt": "Q1", "completion": " worse one", "label": False},
    {"prompt": "Q2", "completion": " lonely", "label": True},  # no undesirable completion for Q2
    {"prompt": "Q3", "completion": " no label", "label": None},  # missing_field
]


def test_unpaired_rows_are_carried_unpaired_with_their_labels(tok, write_jsonl):
    dm = build(PreferenceDataModule, write_jsonl(TRL_KTO, "kto.jsonl"), tok, shuffle=False)
    assert dm.unpaired and len(dm.train_dataset) == 4
    assert dm.skip_counter.skipped("train") == {"missing_field": 1}
    batch = next(iter(dm.train_dataloader()))
    assert batch["label"].tolist() == [True, False, False, True]
    prompt_len = batch["prompt_len"][0]
    # the completion (plus EOS) is the only supervised part; the prompt and padding are -100
    assert (
        tok.decode(batch["input_ids"][0, prompt_len:][batch["labels"][0, prompt_len:] != -100])
        == " good one" + EOS
    )
    assert (batch["labels"][:, :2] == -100).all()


def test_unpaired_rows_pair_by_prompt_only_when_asked(tok, write_jsonl):
    dm = build(PreferenceDataModule, write_jsonl(TRL_KTO, "kto.jsonl"), tok, pair_unpaired=True)
    assert not dm.unpaired
    pairs = sorted(decoded(tok, e) for e in dm.train_dataset)
    assert pairs == [
        ("Q1", " good one" + EOS, " bad one" + EOS),
        ("Q1", " good one" + EOS, " worse one" + EOS),
    ]
    assert dm.skip_counter.skipped("train") == {"missing_field": 1, "no_opposite_label": 1}
    assert {e["row"] for e in dm.train_dataset} == {0}  # one prompt's pairs share a row: same side of a split


def test_llamafactory_kto_messages_rows(tok, write_jsonl):
    user = {"role": "user", "content": "hi"}
    rows = [
        {"messages": [user, {"role": "assistant", "content": "hello"}], "label": True},
        {"messages": [user, {"role": "assistant", "content": "go away"}], "label": False},
    ]
    dm = build(PreferenceDataModule, write_jsonl(rows, "kto_en_demo.jsonl"), tok, pair_unpaired=True)
    assert decoded(tok, dm.train_dataset[0]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "hello<|im_end|>\n" + EOS,
        "go away<|im_end|>\n" + EOS,
    )


def test_sft_refuses_a_labelled_file_unless_told_which_label_to_keep(tok, write_jsonl):
    path = write_jsonl(TRL_KTO, "kto.jsonl")
    with pytest.raises(DataFormatError, match=r"kto\.jsonl has a 'label' column.*keep_label: true"):
        build(SFTDataModule, path, tok)
    kept = build(SFTDataModule, path, tok, keep_label=True)
    responses = sorted(decoded(tok, e, ("response_ids",))[0] for e in kept.train_dataset)
    assert responses == [" good one" + EOS, " lonely" + EOS]  # never the label: false answers
    assert kept.skip_counter.skipped("train") == {"filtered_by_label": 2, "missing_field": 1}
    ignored = build(SFTDataModule, path, tok, label_field=None)
    assert len(ignored.train_dataset) == 5


def test_a_non_boolean_label_names_file_row_and_field(tok, write_jsonl):
    path = write_jsonl([{"prompt": "Q", "completion": " a", "label": "yes"}], "kto.jsonl")
    with pytest.raises(DataFormatError, match=r"kto\.jsonl: row 1: field 'label' should be a boolean"):
        build(PreferenceDataModule, path, tok)


def _message(text, role, rank=None, replies=()):
    return {
        "message_id": text,
        "text": text,
        "role": role,
        "lang": "en",
        "rank": rank,
        "replies": list(replies),
    }


OASST_TREES = [
    {
        "message_tree_id": "t1",
        "tree_state": "ready_for_export",
        "prompt": _message(
            "P1",
            "prompter",
            replies=[
                _message(
                    "A1",
                    "assistant",
                    0,
                    [
                        _message(
                            "P2",
                            "prompter",
                            replies=[_message("B1", "assistant", 0), _message("B2", "assistant", None)],
                        ),
                        _message("P4", "prompter"),  # a follow-up nobody answered: too_few_responses
                    ],
                ),
                _message(
                    "A2",
                    "assistant",
                    1,
                    [_message("P3", "prompter", replies=[_message("C1", "assistant", 0)])],
                ),
                _message("A3", "assistant", 2),
            ],
        ),
    },
    {
        "message_tree_id": "t2",
        "tree_state": "ready_for_export",
        "prompt": _message(
            "Q", "prompter", replies=[_message("X", "assistant", 0), _message("Y", "assistant", 0)]
        ),
    },  # tied
]


def test_open_assistant_message_trees_become_ranked_lists_with_skips_counted(tok, write_jsonl):
    path = write_jsonl(OASST_TREES, "oasst.trees.jsonl")
    dm = build(PreferenceDataModule, path, tok)
    pairs = sorted(decoded(tok, e)[1:] for e in dm.train_dataset)
    assert pairs == sorted(
        [(" A1" + EOS, " A2" + EOS), (" A1" + EOS, " A3" + EOS), (" A2" + EOS, " A3" + EOS)]
    )
    assert tok.decode(dm.train_dataset[0]["prompt_ids"]) == "\n\nHuman: P1\n\nAssistant:"
    assert dm.skip_counter.skipped("train") == {"null_rank": 1, "too_few_responses": 2, "tied_ranks": 1}
    assert "kept 3 of 7 rows" in dm.data_report()["train"]
    chat = build(PreferenceDataModule, path, tok, chat_template=True)
    assert (
        tok.decode(chat.train_dataset[0]["prompt_ids"])
        == "<|im_start|>user\nP1<|im_end|>\n<|im_start|>assistant\n"
    )


def test_ranked_rows_with_a_null_rank_or_one_response_are_skipped_not_fatal(tok, write_jsonl):
    rows = [
        {"prompt": "Q:", "responses": [" a", " b"], "ranks": [1, None]},
        {"prompt": "Q:", "responses": [" a"], "ranks": [1]},
        {"prompt": "Q:", "responses": [" a", " b"], "ranks": [2, 1]},
    ]
    dm = build(PreferenceDataModule, write_jsonl(rows), tok)
    assert decoded(tok, dm.train_dataset[0])[1:] == (" b" + EOS, " a" + EOS)
    assert dm.skip_counter.skipped("train") == {"null_rank": 1, "too_few_responses": 1}


HH_ROWS = [
    {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go away"},
    {
        "chosen": "\n\nHuman: hi\n\nAssistant: hello",
        "rejected": "\n\nHuman: hi\n\nAssistant: go away\n\nHuman: that was rude",
    },  # an extra human turn
]


def test_hh_rows_whose_response_holds_another_turn_are_skipped_and_counted(tok, write_jsonl):
    path = write_jsonl(HH_ROWS, "hh.jsonl")
    dm = build(PreferenceDataModule, path, tok)
    assert len(dm.train_dataset) == 1
    assert dm.skip_counter.skipped("train") == {"multi_turn_response": 1}
    assert dm.data_metrics()["data/train/skipped_multi_turn_response"] == 1.0


def test_an_sft_hh_transcript_that_ends_with_a_human_turn_is_skipped(tok, write_jsonl):
    rows = [{"chosen": HH_ROWS[0]["chosen"]}, {"chosen": "\n\nHuman: hi\n\nAssistant: yo\n\nHuman: and?"}]
    dm = build(SFTDataModule, write_jsonl(rows, "hh.jsonl"), tok)
    assert len(dm.train_dataset) == 1 and dm.skip_counter.skipped("train") == {"multi_turn_response": 1}


def test_weight_ranked_pairs_gives_each_prompt_total_weight_one(tok, write_jsonl):
    rows = [
        {"prompt": "R:", "responses": [" a", " b", " c"], "ranks": [1, 2, 3]},  # C(3, 2) = 3 pairs
        {"prompt": "S:", "responses": [" a", " b", " c", " d"], "ranks": [1, 2, 3, 3]},
    ]  # C(4, 2) = 6, 1 tie
    dm = build(
        PreferenceDataModule, write_jsonl(rows), tok, weight_ranked_pairs=True, shuffle=False, batch_size=16
    )
    batch = next(iter(dm.train_dataloader()))
    expected = [1 / 3] * 3 + [1 / 6] * 5  # the tied pair of row 2 gives no pair, so row 2 weighs 5/6
    torch.testing.assert_close(batch["pair_weight"], torch.tensor(expected))
    plain = build(PreferenceDataModule, write_jsonl(rows, "plain.jsonl"), tok)
    assert "pair_weight" not in next(iter(plain.train_dataloader()))
