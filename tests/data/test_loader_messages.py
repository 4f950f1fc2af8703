"""One clear line for files that cannot be read as the rows they should hold."""

from __future__ import annotations

import gzip

import pytest

from rlhf_lit.data import DataFormatError, PreferenceDataModule, SFTDataModule
from rlhf_lit.data.loading import DataFileNotFoundError, load_rows
from rlhf_lit.errors import UserError


def _one_line(err: BaseException) -> str:
    message = str(err)
    assert "\n" not in message and isinstance(err, UserError)
    return message


@pytest.mark.parametrize("content", ["", "\n\n  \n"], ids=["empty", "blank_lines"])
@pytest.mark.parametrize("name", ["data.jsonl", "data.csv", "data.jsonl.gz"])
def test_an_empty_file_says_so(tmp_path, name, content):
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as handle:
            handle.write(content)
    else:
        path.write_text(content)
    with pytest.raises(DataFormatError) as info:
        load_rows(str(path))
    assert _one_line(info.value) == f"{path} is empty (no rows, only blank lines or nothing)"


def test_blank_lines_between_rows_are_ignored(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('\n{"prompt": "a"}\n\n\n{"prompt": "b"}\n\n')
    assert load_rows(str(path))["prompt"] == ["a", "b"]


def test_an_empty_json_list_or_a_header_only_csv_has_no_rows(tmp_path):
    (tmp_path / "rows.json").write_text("[]")
    (tmp_path / "rows.csv").write_text("prompt,chosen,rejected\n")
    for name in ("rows.json", "rows.csv"):
        with pytest.raises(DataFormatError, match="holds no rows"):
            load_rows(str(tmp_path / name))


def test_content_that_does_not_match_the_extension(tmp_path):
    jsonl_as_csv = tmp_path / "pairs.csv"
    jsonl_as_csv.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    with pytest.raises(DataFormatError) as info:
        load_rows(str(jsonl_as_csv))
    assert "holds JSON" in _one_line(info.value) and "rename it to .jsonl" in str(info.value)
    csv_as_jsonl = tmp_path / "pairs.jsonl"
    csv_as_jsonl.write_text("prompt,chosen,rejected\na,b,c\n")
    with pytest.raises(DataFormatError, match="is not JSON.*looks like CSV: rename it to .csv"):
        load_rows(str(csv_as_jsonl))
    text_as_parquet = tmp_path / "pairs.parquet"
    text_as_parquet.write_text('{"prompt": "a"}\n')
    with pytest.raises(DataFormatError, match="is not a Parquet file"):
        load_rows(str(text_as_parquet))


def test_wrong_columns_list_what_the_format_needs_and_what_the_file_has(tmp_path, tok):
    path = tmp_path / "pairs.csv"
    path.write_text("question,good,bad\nQ,yes,no\n")
    dm = PreferenceDataModule(train_files=str(path), format="explicit", val_size=0, tokenizer=tok)
    with pytest.raises(DataFormatError) as info:
        dm.setup("fit")
    message = _one_line(info.value)
    assert "pairs.csv: format 'explicit' needs the field(s) prompt, chosen, rejected" in message
    assert "['bad', 'good', 'question']" in message and "*_field options" in message
    auto = PreferenceDataModule(train_files=str(path), val_size=0, tokenizer=tok)
    with pytest.raises(
        DataFormatError,
        match=r"cannot tell the preference format.*\['bad', 'good', 'question'\]"
        r".*explicit: prompt\+chosen\+rejected.*set `format`",
    ):
        auto.setup("fit")
    fixed = PreferenceDataModule(
        train_files=str(path),
        format="explicit",
        prompt_field="question",
        chosen_field="good",
        rejected_field="bad",
        val_size=0,
        tokenizer=tok,
    )
    fixed.setup("fit")
    assert len(fixed.train_dataset) == 1


def test_a_type_error_in_the_first_row_blames_the_first_row(write_jsonl):
    path = write_jsonl(
        [
            {"prompt": ["a"], "response": "x"},
            {"prompt": "b", "response": "y"},
            {"prompt": "c", "response": "z"},
        ]
    )
    with pytest.raises(DataFormatError) as info:
        load_rows(path)
    assert "line 1: field 'prompt' is a list, but it is a string in 2 of 3 rows (e.g. line 2)" in _one_line(
        info.value
    )


def test_a_field_of_the_wrong_type_in_a_consistent_file_names_row_and_field(tok, write_jsonl):
    path = write_jsonl([{"prompt": ["a"], "response": "x"}, {"prompt": ["b"], "response": "y"}])
    dm = SFTDataModule(train_files=path, val_size=0, tokenizer=tok)
    with pytest.raises(
        DataFormatError, match=r"data\.jsonl: row 1: field 'prompt' should be a string, got list"
    ):
        dm.setup("fit")


def test_missing_file_and_folder_errors_are_user_errors(tmp_path):
    with pytest.raises(DataFileNotFoundError) as info:
        load_rows(str(tmp_path / "nope.jsonl"))
    assert isinstance(info.value, FileNotFoundError) and "data file not found" in _one_line(info.value)
    with pytest.raises(DataFormatError, match="is a folder, not a data file"):
        load_rows(str(tmp_path))
