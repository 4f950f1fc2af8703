"""PreferenceDataModule: every format, every skip reason with its count, pitfall: degenerate pairs cases, masks, config parsing."""

from __future__ import annotations

import logging

import pytest
import torch

from rlhf_lit.data import DataFormatError, PreferenceDataModule, PromptDataModule, SFTDataModule
from tests.data.conftest import byte_ids

HH = {
    "chosen": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: Knock knock.",
    "rejected": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant: No.",
}


def build(files, tok, **kwargs) -> PreferenceDataModule:
    kwargs.setdefault("val_size", 0)
    dm = PreferenceDataModule(train_files=files, tokenizer=tok, **kwargs)
    dm.setup("fit")
    return dm


def decoded(tok, example) -> tuple[str, str, str]:
    return tuple(tok.decode(example[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))


def test_hh_format_splits_at_the_last_shared_assistant_marker(tok, write_jsonl):
    dm = build(write_jsonl([HH]), tok)
    prompt, chosen, rejected = decoded(tok, dm.train_dataset[0])
    assert prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: joke?\n\nAssistant:"
    assert chosen == " Knock knock.<|endoftext|>" and rejected == " No.<|endoftext|>"
    assert dm.source_names == ["data"]


def test_explicit_format_with_margin_field(tok, write_jsonl):
    rows = [{"q": "2+2=", "good": " 4", "bad": " 5", "m": 2.5}, {"q": "1+1=", "good": " 2", "bad": " 3", "m": None}]
    dm = build(write_jsonl(rows), tok, prompt_field="q", chosen_field="good", rejected_field="bad",
               margin_field="m", shuffle=False)
    batch = next(iter(dm.train_dataloader()))
    torch.testing.assert_close(batch["margin"], torch.tensor([2.5, 0.0]))
    assert batch["chosen_response_len"].tolist() == [3, 3]  # " 4" + EOS
    assert dm.train_dataset[0]["prompt_ids"] == byte_ids("2+2=")


def test_messages_format_both_shapes_render_with_the_chat_template(tok, write_jsonl):
    user = {"role": "user", "content": "hi"}
    conversations = [{"chosen": [user, {"role": "assistant", "content": "hello"}],
                      "rejected": [user, {"role": "assistant", "content": "go away"}]}]
    prompt_plus_strings = [{"prompt": [user], "chosen": "hello", "rejected": [{"role": "assistant", "content": "go away"}]}]
    for rows in (conversations, prompt_plus_strings):
        prompt, chosen, rejected = decoded(tok, build(write_jsonl(rows), tok).train_dataset[0])
        assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert chosen == "hello<|im_end|>\n<|endoftext|>"
        assert rejected == "go away<|im_end|>\n<|endoftext|>"


def test_ranked_format_gives_every_untied_pair_lower_rank_wins(tok, write_jsonl):
    rows = [{"prompt": "Q:", "responses": [" a", " b", " c", " d"], "ranks": [1, 2, 2, 3]}]
    dm = build(write_jsonl(rows), tok)
    pairs = {decoded(tok, e)[1:] for e in dm.train_dataset}
    eos = "<|endoftext|>"
    expected = {(" a", " b"), (" a", " c"), (" a", " d"), (" b", " d"), (" c", " d")}
    assert pairs == {(c + eos, r + eos) for c, r in expected}
    assert dm.skip_counter.skipped("train") == {"tied_ranks": 1}
    assert "kept 5 of 6 rows" in dm.skip_counter.report("train")


def test_every_skip_reason_is_counted_across_files(tok, write_jsonl, caplog):
    explicit = write_jsonl([
        {"prompt": "Q1", "chosen": " yes", "rejected": " no"},  # kept
        {"prompt": "Q2", "chosen": "   ", "rejected": " no"},  # empty_chosen
        {"prompt": "Q3", "chosen": " yes"},  # missing_field (no rejected)
        {"prompt": "Q4", "chosen": " same", "rejected": " same<|endoftext|>"},  # identical ids after EOS
        {"prompt": "  ", "chosen": " yes", "rejected": " no"},  # empty_prompt
        {"prompt": "Q6", "chosen": " yes", "rejected": ""},  # empty_rejected
        {"prompt": "Q7", "chosen": " x" * 20, "rejected": " no"},  # response_too_long (41 > 24 - 1)
    ], "explicit.jsonl")
    ranked = write_jsonl([{"prompt": "R", "responses": [" a", " b", " c"], "ranks": [1, 1, 2]}], "ranked.jsonl")
    hh = write_jsonl([HH, {"chosen": "The sky is blue.", "rejected": "Grass is green."}], "hh.jsonl")
    with caplog.at_level(logging.INFO, logger="rlhf_lit.data"):
        dm = build([explicit, ranked, hh], tok, max_length=24)
    assert dm.skip_counter.skipped("train") == {
        "empty_chosen": 1, "missing_field": 1, "identical_pair": 1, "empty_prompt": 1,
        "empty_rejected": 1, "response_too_long": 1, "tied_ranks": 1, "no_shared_prefix": 1,
    }
    assert len(dm.train_dataset) == 1 + 2 + 1
    assert dm.source_names == ["explicit", "ranked", "hh"]
    assert sorted({e["source"] for e in dm.train_dataset}) == [0, 1, 2]
    report = dm.data_report()["train"]
    assert report.startswith("train: kept 4 of 12 rows from explicit.jsonl, ranked.jsonl, hh.jsonl; skipped 8:")
    assert "identical_pair=1" in report and report.endswith("(max_length=24)")
    assert report in caplog.text
    metrics = dm.data_metrics()
    assert metrics["data/train/kept"] == 4.0 and metrics["data/train/skipped_tied_ranks"] == 1.0


def test_b02_empty_rejected_and_identical_pairs_never_reach_a_batch(tok, write_jsonl):
    dm = build(write_jsonl([{"chosen": "The sky is blue.", "rejected": ""}, HH]), tok)
    assert dm.skip_counter.skipped("train") == {"empty_rejected": 1}
    for batch in dm.train_dataloader():
        same = (batch["chosen_input_ids"] == batch["rejected_input_ids"]).all(dim=1)
        assert not same.any()


def test_b02_prompt_that_fills_max_length_is_cut_from_the_left(tok, write_jsonl):
    prompt = "p" * 30 + "END"
    dm = build(write_jsonl([{"prompt": prompt, "chosen": " A", "rejected": " B"}]), tok, max_length=len(prompt))
    example = dm.train_dataset[0]
    assert len(example["prompt_ids"]) + 3 == len(prompt)  # the longer response " A"+EOS fits whole
    assert tok.decode(example["prompt_ids"]).endswith("pEND")  # the oldest tokens went
    assert dm.skip_counter.truncated("train") == 1
    rows = [{"prompt": prompt, "chosen": " A", "rejected": " B"}, {"prompt": "q", "chosen": " A", "rejected": " B"}]
    tiny = build(write_jsonl(rows, "t.jsonl"), tok, max_length=4, min_prompt_tokens=2)
    assert tiny.skip_counter.skipped("train") == {"response_too_long": 1}  # 3 response tokens leave 1 < 2
    assert len(tiny.train_dataset) == 1  # the 1-token prompt needs only itself
    with pytest.raises(DataFormatError, match="no training examples.*response_too_long=1"):
        build(write_jsonl(rows[:1], "u.jsonl"), tok, max_length=4, min_prompt_tokens=2)


def test_masks_from_lengths_when_pad_equals_eos(tok_pad_eos, write_jsonl):
    dm = build(write_jsonl([HH, dict(HH, chosen=HH["chosen"] + " Who's there?")]), tok_pad_eos, shuffle=False)
    batch = next(iter(dm.train_dataloader()))
    for side in ("chosen", "rejected"):
        ids, mask = batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"]
        lengths = batch["prompt_len"] + batch[f"{side}_response_len"]
        assert mask.sum(1).tolist() == lengths.tolist()
        last = lengths - 1
        assert ids[torch.arange(2), last].tolist() == [0, 0]  # the EOS (== pad) is real: mask 1
        assert mask[torch.arange(2), last].tolist() == [1, 1]
    assert batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape


def test_hh_with_chat_template_renders_turns(tok, write_jsonl):
    prompt, chosen, _ = decoded(tok, build(write_jsonl([HH]), tok, chat_template=True).train_dataset[0])
    assert prompt == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
                      "<|im_start|>user\njoke?<|im_end|>\n<|im_start|>assistant\n")
    assert chosen == "Knock knock.<|im_end|>\n<|endoftext|>"


def test_wrong_field_type_is_one_error_naming_file_row_and_field(tok, write_jsonl):
    path = write_jsonl([{"prompt": "a", "chosen": 1, "rejected": 2}, {"prompt": "b", "chosen": 3, "rejected": 4}])
    with pytest.raises(DataFormatError, match=r"data\.jsonl: row 1: field 'chosen' should be a string, got int"):
        build(path, tok)


def test_unknown_keys_and_missing_tokenizer_give_clear_errors(tok, write_jsonl):
    with pytest.raises(DataFormatError, match=r"cannot tell the preference format.*\['text'\]"):
        build(write_jsonl([{"text": "x"}]), tok)
    dm = PreferenceDataModule(train_files=write_jsonl([HH], "ok.jsonl"))
    with pytest.raises(ValueError, match="no tokenizer"):
        dm.setup("fit")


def test_split_is_deterministic_disjoint_and_per_file(tok, write_jsonl):
    rows = [{"prompt": f"Q{i}", "chosen": " yes", "rejected": " no"} for i in range(40)]
    files = [write_jsonl(rows, "a.jsonl"), write_jsonl(rows, "b.jsonl")]

    def split(seed, **kwargs):
        dm = build(files, tok, val_size=5, seed=seed, **kwargs)
        as_keys = lambda ds: sorted((e["source"], e["row"]) for e in ds)  # noqa: E731
        return as_keys(dm.train_dataset), as_keys(dm.val_dataset)

    train, val = split(0)
    assert len(val) == 10 and len(train) == 70 and not set(train) & set(val)
    assert sum(src == 0 for src, _ in val) == 5  # 5 per file
    assert split(0) == (train, val)
    assert split(1)[1] != val
    sub_train, sub_val = split(0, max_train_samples_per_file=8)
    assert sub_val == val and len(sub_train) == 16 and set(sub_train) <= set(train)
    fraction = build(files, tok, val_size=0.25)
    assert len(fraction.val_dataset) == 20


def test_val_files_replace_val_size_and_ranked_rows_stay_together(tok, write_jsonl):
    ranked = [{"prompt": f"Q{i}", "responses": [" a", " b", " c"], "ranks": [1, 2, 3]} for i in range(10)]
    dm = build(write_jsonl(ranked, "r.jsonl"), tok, val_size=0.3)
    train_rows = {e["row"] for e in dm.train_dataset}
    val_rows = {e["row"] for e in dm.val_dataset}
    assert len(val_rows) == 3 and not train_rows & val_rows and len(dm.val_dataset) == 9
    with_val = build(write_jsonl(ranked, "r2.jsonl"), tok, val_files=[write_jsonl([HH], "v.jsonl")], val_size=0.3)
    assert len(with_val.train_dataset) == 30 and len(with_val.val_dataset) == 1
    assert with_val.source_names == ["r2", "v"] and with_val.val_dataset[0]["source"] == 1
    assert "val: kept 1 of 1 rows from v.jsonl" in with_val.data_report()["val"]
    assert build(write_jsonl(ranked, "r3.jsonl"), tok).val_dataloader() == []


@pytest.mark.parametrize("module", [PreferenceDataModule, SFTDataModule, PromptDataModule])
def test_init_arguments_parse_from_yaml_like_config(module):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(module, "data")
    cfg = parser.parse_object({"data": {"train_files": "x.jsonl", "val_size": 200, "max_train_samples_per_file": 500}})
    assert cfg.data.val_size == 200 and isinstance(cfg.data.val_size, int)
    cfg = parser.parse_object({"data": {"train_files": ["x.jsonl", "y.jsonl"], "val_size": 0.1, "format": "auto"}})
    assert cfg.data.val_size == 0.1 and cfg.data.train_files == ["x.jsonl", "y.jsonl"]
    assert cfg.data.tokenizer is None and cfg.data.seed == 0
    with pytest.raises(ValueError, match="format"):
        module(train_files="x.jsonl", format="pairs")
    with pytest.raises(ValueError, match="val_size"):
        module(train_files="x.jsonl", val_size=2.5)
