"""The built-in reward functions and the weighted mixture's checks, on hand-written responses."""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.errors import NonFiniteError
from rlhf_lit.rewards import (
    MixedReward,
    RewardSourceConfig,
    ends_with,
    excludes_keyword,
    gsm8k_answer_match,
    includes_keyword,
    instruction_constraints,
    load_function,
    parse_number,
    valid_json,
    word_count_in_range,
)


def test_parse_number():
    assert (
        parse_number("1,234") == 1234.0
        and parse_number(" $5.50 ") == 5.5
        and parse_number("-3 apples") == -3.0
    )
    assert parse_number("none") is None and parse_number(None) is None


def test_gsm8k_answer_match():
    responses = ["3 + 4 = 7\n#### 7", "The answer is 7", "#### 1,000", "#### 8", "#### 7"]
    fields = [
        {"reference": "7"},
        {"reference": "7"},
        {"answer": "10 * 100 = 1000\n#### 1000"},
        {"reference": "7"},
        {},
    ]
    # strict: only '#### N' counts; the last row has no reference -> 0
    assert gsm8k_answer_match([None] * 5, responses, fields) == [1.0, 0.0, 1.0, 0.0, 0.0]
    # not strict: the last number of the response counts when there is no '####'
    assert gsm8k_answer_match([None] * 2, responses[:2], fields[:2], strict=False) == [1.0, 1.0]


def test_instruction_constraints_fraction_and_all_or_nothing():
    responses = ["Hello there, world.", "sorry, I cannot", "one two three four five six"]
    kwargs = dict(max_words=5, must_contain=["world"], must_not_contain=["sorry"], ends_with=".")
    # row 0: 3 words <= 5, has 'world', no 'sorry', ends with '.' -> 4/4
    # row 1: 3 words ok, no 'world', has 'sorry', no '.' -> 1/4
    # row 2: 6 words > 5, no 'world', no 'sorry' ok, no '.' -> 1/4
    assert instruction_constraints([None] * 3, responses, [{}] * 3, **kwargs) == [1.0, 0.25, 0.25]
    assert instruction_constraints([None] * 3, responses, [{}] * 3, all_or_nothing=True, **kwargs) == [
        1.0,
        0.0,
        0.0,
    ]
    # a row's own constraints replace the config's; no constraint at all scores 1
    fields = [{"constraints": {"min_words": 4}}, {}, {}]
    assert instruction_constraints([None] * 3, responses, fields, **kwargs)[0] == 0.0
    assert instruction_constraints([None], ["anything"], [{}]) == [1.0]
    with pytest.raises(ValueError, match="row 0: unknown constraint"):
        instruction_constraints([None], ["x"], [{}], max_word=3)


def test_single_constraints():
    responses = ['{"a": [1, 2]}', '```json\n{"b": 1}\n```', "not json. ", "Keyword here"]
    assert valid_json(None, responses, None) == [1.0, 1.0, 0.0, 0.0]
    assert ends_with(None, responses, None, suffix=".") == [0.0, 0.0, 1.0, 0.0]
    assert includes_keyword(None, responses, None, keyword="keyword") == [0.0, 0.0, 0.0, 1.0]
    assert includes_keyword(None, responses, None, keyword="keyword", case_sensitive=True) == [0.0] * 4
    assert excludes_keyword(None, responses, None, keyword="json") == [1.0, 0.0, 0.0, 1.0]
    assert word_count_in_range(None, ["a b c", "a"], None, min_words=2, max_words=3) == [1.0, 0.0]


def test_load_function_names_the_problem():
    assert load_function("rlhf_lit.rewards:valid_json") is valid_json
    for spec, match in (
        ("valid_json", "expected 'module:function'"),
        ("no_such_mod:f", "cannot import"),
        ("rlhf_lit.rewards:nope", "has no callable 'nope'"),
    ):
        with pytest.raises(ValueError, match=match):
            load_function(spec)
    with pytest.raises(ValueError, match="exactly one of 'function'"):
        RewardSourceConfig(name="x")


class _Tok:
    """Decodes ids as characters (chr(id)); enough for the mixture's text."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(i)) for i in ids)


def _ids(texts):
    width = max(map(len, texts))
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.bool)
    for i, t in enumerate(texts):
        ids[i, : len(t)] = torch.tensor([ord(c) for c in t])
        mask[i, : len(t)] = True
    return ids, mask


def bad_length(prompts, responses, fields):
    return [1.0]


def bad_value(prompts, responses, fields):
    return [1.0, float("nan")]


def echo_reference(prompts, responses, fields):
    return [float(f["reference"]) for f in fields]


def test_mixture_weights_sources_and_keeps_each_score():
    entries = [
        RewardSourceConfig(
            name="dot", function="rlhf_lit.rewards:ends_with", kwargs={"suffix": "."}, weight=2.0
        ),
        RewardSourceConfig(function="tests.unit.test_reward_functions:echo_reference", weight=-0.5),
    ]
    mix = MixedReward(entries, _Tok(), build_model=None)
    ids, mask = _ids(["ok.", "no"])
    scores = mix.score(
        ids[:, :0], mask[:, :0], ids, mask, None, ["p", "q"], [{"reference": "4"}, {"reference": "2"}]
    )
    # row 0: 2 * 1 - 0.5 * 4 = 0; row 1: 2 * 0 - 0.5 * 2 = -1
    torch.testing.assert_close(scores, torch.tensor([0.0, -1.0]))
    assert set(mix.last_components) == {"dot", "echo_reference"}
    torch.testing.assert_close(mix.last_components["dot"], torch.tensor([1.0, 0.0]))


def test_mixture_errors_name_the_function():
    ids, mask = _ids(["a", "b"])
    for fn, err, match in (
        ("bad_length", ValueError, r"bad_length' returned 1 scores for 2 responses"),
        ("bad_value", NonFiniteError, r"bad_value' returned nan for response 1"),
    ):
        mix = MixedReward(
            [RewardSourceConfig(function=f"tests.unit.test_reward_functions:{fn}")], _Tok(), None
        )
        with pytest.raises(err, match=match):
            mix.score(ids[:, :0], mask[:, :0], ids, mask)
    with pytest.raises(ValueError, match="two entries are named 'x'"):
        MixedReward([RewardSourceConfig(name="x", function="rlhf_lit.rewards:valid_json")] * 2, _Tok(), None)
