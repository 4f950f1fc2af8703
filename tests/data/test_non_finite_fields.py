"""Non-finite numbers in data fields (JSON ``NaN`` / ``Infinity``): ranks, scores and margins are skipped and
counted per reason, labels refused with file/row/field -- never trained on."""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.data import DataFormatError, PreferenceDataModule
from tests.data.conftest import byte_ids

NAN, INF = float("nan"), float("inf")


def build(files, tok, **kwargs) -> PreferenceDataModule:
    kwargs.setdefault("val_size", 0)
    dm = PreferenceDataModule(train_files=files, tokenizer=tok, shuffle=False, **kwargs)
    dm.setup("fit")
    return dm


def test_a_nan_rank_skips_the_whole_ranked_list(tok, write_jsonl):
    # with NaN for " c", "a<c", "c<b" and "b<a" comparisons would all be False and the pairs built from
    # them a cycle: a > b (1 < 2), and c neither better nor worse than anything
    rows = [
        {"prompt": "Q:", "responses": [" a", " b", " c"], "ranks": [1, 2, NAN]},
        {"prompt": "Q:", "responses": [" a", " b"], "ranks": [1, INF]},
        {"prompt": "R:", "responses": [" x", " y"], "ranks": [2, 1]},
    ]
    dm = build(write_jsonl(rows), tok)
    assert len(dm.train_dataset) == 1  # only the finite list's one pair
    assert dm.train_dataset[0]["prompt_ids"] == byte_ids("R:")
    assert dm.skip_counter.skipped("train") == {"non_finite_rank": 2}
    assert "non_finite_rank=2" in dm.skip_counter.report("train")


def test_nan_or_inf_margins_and_scores_are_skipped(tok, write_jsonl):
    rows = [
        {"q": "1=", "good": " 1", "bad": " 2", "m": NAN},
        {"q": "2=", "good": " 2", "bad": " 3", "m": -INF},
        {"q": "3=", "good": " 3", "bad": " 4", "m": 1.5},
    ]
    dm = build(
        write_jsonl(rows), tok, prompt_field="q", chosen_field="good", rejected_field="bad", margin_field="m"
    )
    batch = next(iter(dm.train_dataloader()))
    torch.testing.assert_close(batch["margin"], torch.tensor([1.5]))  # only the finite row
    assert dm.skip_counter.skipped("train") == {"non_finite_margin": 2}
    ranked = [
        {"prompt": "Q:", "responses": [" a", " b"], "ranks": [1, 2], "scores": [0.5, NAN]},
        {"prompt": "R:", "responses": [" a", " b"], "ranks": [1, 2], "scores": [3.0, 1.0]},
    ]
    dm = build(write_jsonl(ranked, name="ranked.jsonl"), tok, format="ranked", margin_field="scores")
    assert dm.skip_counter.skipped("train") == {"non_finite_margin": 1}
    assert len(dm.train_dataset) == 1 and dm.train_dataset[0]["prompt_ids"] == byte_ids("R:")


def test_a_nan_kto_label_is_refused_with_file_row_and_field(tok, write_jsonl):
    rows = [
        {"prompt": "Q:", "completion": " a", "label": True},
        {"prompt": "Q:", "completion": " b", "label": NAN},
    ]
    path = write_jsonl(rows, name="kto.jsonl")
    with pytest.raises(DataFormatError) as err:
        build(path, tok, format="unpaired", pair_unpaired=True)
    message = str(err.value)
    # a NaN label is a number among booleans (the folder's name holds "nan": not a word to look for)
    assert "kto.jsonl: line 2: field 'label' is a number, but it is a boolean" in message
