"""``train_part``: disjoint parts of each file's training rows, with the same validation rows for every part."""

from __future__ import annotations

import json

import pytest

from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.data.base import split_examples
from rlhf_lit.models.tokenizer import build_byte_tokenizer


def test_split_examples_parts_are_disjoint_cover_the_training_rows_and_share_validation():
    examples = [{"row": r} for r in range(23)]
    train, val = split_examples(examples, 5, None, seed=0, name="f")
    parts = [split_examples(examples, 5, None, seed=0, name="f", train_part=(i, 3)) for i in range(3)]
    rows = [{e["row"] for e in p[0]} for p in parts]
    assert all(p[1] == val for p in parts)  # the same 5 validation rows
    assert [len(r) for r in rows] == [
        6,
        6,
        6,
    ]  # 18 training rows cut in 3: rows 0-5, 6-11, 12-17 of the order
    assert rows[0] | rows[1] | rows[2] == {e["row"] for e in train}
    assert not rows[0] & rows[1] and not rows[1] & rows[2] and not rows[0] & rows[2]
    assert not rows[0] & {e["row"] for e in val}


def test_halves_through_the_data_module(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"q{i}", "chosen": f" yes {i}", "rejected": " no"}) + "\n"
            for i in range(30)
        )
    )
    tok = build_byte_tokenizer()

    def setup(part):
        data = PreferenceDataModule(
            train_files=str(path), format="explicit", val_size=6, train_part=part, tokenizer=tok
        )
        data.setup("fit")
        return {e["row"] for e in data.train_dataset.examples}, {e["row"] for e in data.val_dataset.examples}

    (a, val_a), (b, val_b), (whole, val) = setup([0, 2]), setup([1, 2]), setup(None)
    assert val_a == val_b == val and len(a) == len(b) == 12
    assert a | b == whole and not a & b


@pytest.mark.parametrize("part", [[2, 2], [-1, 2], [0, 0], [0, 1, 2]])
def test_a_bad_part_is_refused(part):
    with pytest.raises(ValueError, match="train_part"):
        PreferenceDataModule(train_files="x.jsonl", train_part=part, tokenizer=build_byte_tokenizer())
