"""load_rows: file types, bare strings, the registered-source hook, and one clear error per bad file."""

from __future__ import annotations

import gzip
import json

import datasets
import pytest

from rlhf_lit.data import DataFormatError, load_rows, register_source
from rlhf_lit.data.loading import display_name, source_name

ROWS = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "d", "chosen": "e", "rejected": "f"}]


def test_jsonl_json_gz_csv_parquet_load_the_same_rows(tmp_path, write_jsonl):
    paths = [write_jsonl(ROWS, "x.jsonl")]
    (tmp_path / "x.json").write_text(json.dumps(ROWS))
    with gzip.open(tmp_path / "x.jsonl.gz", "wt") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in ROWS))
    datasets.Dataset.from_list(ROWS).to_csv(tmp_path / "x.csv", index=False)
    datasets.Dataset.from_list(ROWS).to_parquet(tmp_path / "x.parquet")
    paths += [str(tmp_path / f"x.{ext}") for ext in ("json", "jsonl.gz", "csv", "parquet")]
    for path in paths:
        assert load_rows(path).to_list() == ROWS, path


def test_relative_path_is_resolved_against_the_cwd(tmp_path, write_jsonl, monkeypatch):
    write_jsonl(ROWS, "rel.jsonl")
    monkeypatch.chdir(tmp_path)
    assert len(load_rows("rel.jsonl")) == 2
    assert len(load_rows("./rel.jsonl")) == 2


def test_bare_json_strings_become_prompt_rows(write_jsonl):
    path = write_jsonl(["Can you tell me about GLaDOS?", "why?"], "oasst.jsonl")
    assert load_rows(path).to_list() == [{"prompt": "Can you tell me about GLaDOS?"}, {"prompt": "why?"}]


def test_invalid_json_on_line_3_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b"}\n{"prompt": "c", "chosen": "d"}\n{"prompt": "e", "chosen"\n')
    with pytest.raises(DataFormatError) as info:
        load_rows(str(path))
    message = str(info.value)
    assert str(path) in message and "line 3" in message and "invalid JSON" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one error, no chain


def test_field_with_wrong_type_names_file_line_and_field(write_jsonl):
    path = write_jsonl([{"prompt": "a", "chosen": "b"}, {"prompt": "c", "chosen": "d"}, {"prompt": "e", "chosen": ["x"]}])
    with pytest.raises(DataFormatError) as info:
        load_rows(path)
    message = str(info.value)
    assert path in message and "line 3" in message and "'chosen'" in message
    assert "a list" in message and "a string in 2 of 3 rows (e.g. line 1)" in message


def test_json_array_with_wrong_type_names_row(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": 5}]))
    with pytest.raises(DataFormatError, match=r"row 2: field 'prompt' is a number"):
        load_rows(str(path))


def test_bare_strings_mixed_with_objects_is_an_error(write_jsonl):
    path = write_jsonl(["a prompt", {"prompt": "b"}], "mixed.jsonl")
    with pytest.raises(DataFormatError, match="line 2: expected a JSON string"):
        load_rows(path)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="missing/data.parquet"):
        load_rows("missing/data.parquet")


def test_unsupported_extension(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("hello\n")
    with pytest.raises(DataFormatError, match="unsupported file type"):
        load_rows(str(path))


def test_registered_source_hook():
    register_source("unit", lambda name, split: datasets.Dataset.from_list([{"prompt": f"{name}/{split}"}]))
    assert load_rows("unit:abc", split="val").to_list() == [{"prompt": "abc/val"}]
    assert source_name("unit:abc") == "unit_abc"


def test_source_and_display_names():
    assert source_name("../shared/data/preference/hh-rlhf_helpful-base_test.jsonl.gz") == "hh-rlhf_helpful-base_test"
    assert display_name("../shared/data/sft/gsm8k_test.jsonl") == "gsm8k_test.jsonl"
    assert source_name("Anthropic/hh-rlhf") == "Anthropic/hh-rlhf"


def test_demo_scheme_reads_the_synthetic_demo_task():
    demo_task = pytest.importorskip("rlhf_lit.data.demo_task")
    if not hasattr(demo_task, "rows_from_spec"):
        pytest.skip("demo_task has no rows_from_spec")
    rows = load_rows("demo:preference?n=5&seed=1&split=val")
    assert len(rows) == 5 and {"prompt", "chosen", "rejected"} <= set(rows.column_names)
    assert source_name("demo:preference?n=5&seed=1&split=val") == "demo_preference_val"  # scheme, kind and split: a metric-friendly name
