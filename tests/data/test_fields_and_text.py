"""Dotted / indexed field paths, the prompt template, the text-mode separator, no double chat wrapping, and
pairs that differ only in whitespace."""

from __future__ import annotations

import pytest

from rlhf_lit.data import DataFormatError, PreferenceDataModule, PromptDataModule, SFTDataModule
from rlhf_lit.data.formats import Fields, get_path, template_fields, unescape
from rlhf_lit.data.records import as_hh_prompt, looks_like_hh

EOS = "<|endoftext|>"


def build(cls, files, tok, **kwargs):
    kwargs.setdefault("val_size", 0)
    dm = cls(train_files=files, tokenizer=tok, **kwargs)
    dm.setup("fit")
    return dm


def test_get_path_reads_nested_keys_and_list_indexes():
    row = {
        "a.b": 1,
        "instances": [{"input": "x"}, {"input": "y"}],
        "m": [{"content": "first"}, {"content": "last"}],
    }
    assert get_path(row, "a.b") == 1  # a literal key with a dot wins
    assert get_path(row, "instances.0.input") == "x"
    assert get_path(row, "m.-1.content") == "last"
    assert get_path(row, "instances.5.input") is None and get_path(row, "m.x") is None
    assert template_fields("{instruction}\n\n{instances.0.input} {{literal}}") == [
        "instruction",
        "instances.0.input",
    ]


SELF_INSTRUCT = [
    {"instruction": "Sort the numbers.", "instances": [{"input": "3, 1, 2", "output": "1, 2, 3"}]},
    {"instruction": "Tell a joke.", "instances": [{"input": "", "output": "Why did the chicken..."}]},
]


def test_self_instruct_prompts_keep_the_instance_input_through_a_template(tok, write_jsonl):
    path = write_jsonl(SELF_INSTRUCT, "seed_tasks.jsonl")
    with pytest.raises(
        DataFormatError, match=r"seed_tasks.jsonl looks like self-instruct seed tasks.*prompt_template"
    ):
        build(PromptDataModule, path, tok)  # never the instruction alone, silently
    dm = build(PromptDataModule, path, tok, prompt_template="{instruction}\n\n{instances.0.input}")
    prompts = [tok.decode(e["prompt_ids"]) for e in dm.train_dataset]
    assert prompts == [
        "Sort the numbers.\n\n3, 1, 2",
        "Tell a joke.",
    ]  # the empty input leaves no blank lines
    sft = build(
        SFTDataModule,
        path,
        tok,
        prompt_template="{instruction}\n\n{instances.0.input}",
        response_field="instances.0.output",
    )
    assert [tok.decode(e["response_ids"]) for e in sft.train_dataset] == [
        " 1, 2, 3" + EOS,
        " Why did the chicken..." + EOS,
    ]


def test_dotted_field_paths_for_preference_rows(tok, write_jsonl):
    rows = [{"q": {"text": "2+2="}, "answers": {"good": "4", "bad": "5"}}]
    dm = build(
        PreferenceDataModule,
        write_jsonl(rows),
        tok,
        format="explicit",
        prompt_field="q.text",
        chosen_field="answers.good",
        rejected_field="answers.bad",
    )
    assert tuple(
        tok.decode(dm.train_dataset[0][k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")
    ) == ("2+2=", " 4" + EOS, " 5" + EOS)


def test_text_mode_puts_the_separator_only_where_no_whitespace_is(tok, write_jsonl):
    rows = [
        {"prompt": "Question?", "response": "Answer."},  # glued before: "Question?Answer."
        {"prompt": "Q:", "response": " A"},  # the data's own leading space is kept, not doubled
        {"prompt": "Q:\n", "response": "A"},
    ]
    dm = build(SFTDataModule, write_jsonl(rows), tok, shuffle=False)
    assert [tok.decode(e["response_ids"]) for e in dm.train_dataset] == [
        " Answer." + EOS,
        " A" + EOS,
        "A" + EOS,
    ]
    newline = build(SFTDataModule, write_jsonl(rows[:1], "nl.jsonl"), tok, separator="\n")
    assert tok.decode(newline.train_dataset[0]["response_ids"]) == "\nAnswer." + EOS
    glued = build(SFTDataModule, write_jsonl(rows[:1], "glued.jsonl"), tok, separator="")
    assert tok.decode(glued.train_dataset[0]["response_ids"]) == "Answer." + EOS


def test_an_hh_style_explicit_prompt_is_not_wrapped_twice_by_the_chat_template(tok, write_jsonl):
    prompt = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: a joke?\n\nAssistant:"
    assert looks_like_hh(prompt) and not looks_like_hh("What does Human: mean?")
    assert as_hh_prompt(prompt) == prompt  # text mode: already in the transcript form
    rows = [{"prompt": prompt, "chosen": " Knock knock.", "rejected": " No."}]
    dm = build(PreferenceDataModule, write_jsonl(rows), tok, chat_template=True)
    rendered = tok.decode(dm.train_dataset[0]["prompt_ids"])
    assert rendered == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\na joke?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "Human:" not in rendered
    sft = build(
        SFTDataModule,
        write_jsonl([{"prompt": prompt, "response": " Knock."}], "s.jsonl"),
        tok,
        chat_template=True,
    )
    assert tok.decode(sft.train_dataset[0]["prompt_ids"]) == rendered


def test_pairs_equal_after_whitespace_normalisation_are_identical(tok, write_jsonl):
    rows = [
        {"prompt": "Q", "chosen": " the  answer\n", "rejected": " the answer"},
        {"prompt": "Q", "chosen": " yes", "rejected": " no"},
    ]
    dm = build(PreferenceDataModule, write_jsonl(rows), tok)
    assert len(dm.train_dataset) == 1 and dm.skip_counter.skipped("train") == {"identical_pair": 1}
    ranked = [{"prompt": "R", "responses": [" a b", "a  b ", " c"], "ranks": [1, 2, 3]}]
    dm = build(PreferenceDataModule, write_jsonl(ranked, "r.jsonl"), tok)
    assert len(dm.train_dataset) == 2 and dm.skip_counter.skipped("train") == {"identical_pair": 1}


def test_prompt_completion_rows_train_sft_and_alpaca_prompts(tok, write_jsonl):
    sft = build(SFTDataModule, write_jsonl([{"prompt": "The sky is", "completion": " blue."}]), tok)
    assert tok.decode(sft.train_dataset[0]["response_ids"]) == " blue." + EOS
    alpaca = write_jsonl([{"instruction": "Add.", "input": "2 and 2", "output": "4"}], "alpaca.jsonl")
    prompts = build(PromptDataModule, alpaca, tok)
    assert tok.decode(prompts.train_dataset[0]["prompt_ids"]) == "\n\nHuman: Add.\n\n2 and 2\n\nAssistant:"


def test_the_real_self_instruct_seed_tasks_through_the_template(tok, shared_data):
    import json

    path = shared_data / "sft" / "self_instruct_seed_tasks.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    dm = build(
        PromptDataModule,
        str(path),
        tok,
        prompt_template="{instruction}\n\n{instances.0.input}",
        shuffle=False,
    )
    assert len(dm.train_dataset) == len(rows) == 175
    with_input = [i for i, r in enumerate(rows) if r["instances"][0]["input"].strip()]
    assert with_input  # the file does have instance inputs; each one reaches its prompt
    for i in with_input:
        assert tok.decode(dm.train_dataset[i]["prompt_ids"]).endswith(
            rows[i]["instances"][0]["input"].strip()
        )


def test_escapes_are_read_as_yaml_double_quotes_read_them():
    # '{a}\\n\\n{b}': 10 characters, 2 of them backslashes (how a shell passes '{a}\n\n{b}')
    assert unescape("{a}\\n\\n{b}") == "{a}\n\n{b}"
    assert unescape("a\\tb\\rc") == "a\tb\rc"
    assert unescape("C:\\\\d \\d") == "C:\\d \\d"  # an escaped backslash is one; another escape is kept
    assert unescape("{a}\n\n{b}") == "{a}\n\n{b}"  # from YAML double quotes: nothing left to read
    fields = Fields(prompt_template="{instruction}\\n\\n{instances.0.input}", separator="\\n")
    assert (fields.prompt_template, fields.separator) == ("{instruction}\n\n{instances.0.input}", "\n")


def test_a_template_typed_with_backslash_n_builds_the_same_prompts(tok, shared_data):
    """The template as a shell passes it (backslash, n) and as YAML double quotes give it (newlines): the
    same 175 prompts, none holding a backslash-n (before, 118 of them did)."""
    path = str(shared_data / "sft" / "self_instruct_seed_tasks.jsonl")
    typed, quoted = (
        build(PromptDataModule, path, tok, prompt_template=template, shuffle=False)
        for template in ("{instruction}\\n\\n{instances.0.input}", "{instruction}\n\n{instances.0.input}")
    )
    prompts = [tok.decode(example["prompt_ids"]) for example in typed.train_dataset]
    assert len(prompts) == 175 and not [p for p in prompts if "\\n" in p]
    assert [e["prompt_ids"] for e in typed.train_dataset] == [e["prompt_ids"] for e in quoted.train_dataset]
