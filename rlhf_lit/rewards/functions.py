"""Built-in reward functions: verifiable rewards computed from the response text, no model.

Every function has the reward-function signature of ``reward_model`` list entries (``rlhf_lit.rewards``):
``fn(prompts, responses, fields, **kwargs) -> list[float]``, one float per response:

* ``prompts``: the B prompts as the data gave them (a string, or a list of ``{"role", "content"}`` messages);
* ``responses``: the B responses as text (the policy's tokenizer, special tokens dropped);
* ``fields``: the B prompt rows' fields (the data file's row as read, plus ``reference``: for ``gsm8k`` files
  the final number of ``answer``, or the ``reference_field`` of explicit files);
* ``kwargs``: the entry's ``kwargs`` from the config.

A row's ``constraints`` field (a dict with the keyword arguments of :func:`instruction_constraints`)
overrides the config's for that row, so a data file can give each prompt its own constraint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ends_with",
    "excludes_keyword",
    "gsm8k_answer_match",
    "includes_keyword",
    "instruction_constraints",
    "parse_number",
    "valid_json",
    "word_count_in_range",
]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(text: str | None) -> float | None:
    """The number a GSM8K answer string states (``"1,234"``, ``"$5.00"``, ``"-3"``), or None."""
    if text is None:
        return None
    match = _NUMBER.search(str(text).replace("$", ""))
    if match is None:
        return None
    try:
        return float(match.group(0).replace(",", ""))
    except ValueError:
        return None


def _final_answer(response: str, strict: bool) -> float | None:
    """The number after the last ``####`` of a response; without one (and not ``strict``) its last number."""
    if "####" in response:
        return parse_number(response.rsplit("####", 1)[1])
    if strict:
        return None
    numbers = _NUMBER.findall(response.replace("$", ""))
    return parse_number(numbers[-1]) if numbers else None


def gsm8k_answer_match(
    prompts: Sequence[Any], responses: Sequence[str], fields: Sequence[dict], strict: bool = True
) -> list[float]:
    """1.0 where the response's final answer equals the row's reference number, else 0.0 (Cobbe et al. 2021,
    GSM8K: the answer follows ``####``).

    Args:
        strict: only an answer after ``####`` counts (the format GSM8K teaches); False also takes the
            response's last number.

    The reference is ``fields[i]["reference"]`` (``gsm8k`` prompt files set it), else the number after ``####``
    of ``fields[i]["answer"]``. A row without either scores 0.0. Numbers compare as floats (``1,000`` =
    ``1000.0``).
    """
    scores = []
    for response, row in zip(responses, fields):
        reference = parse_number(row.get("reference"))
        if reference is None and isinstance(row.get("answer"), str) and "####" in row["answer"]:
            reference = parse_number(row["answer"].rsplit("####", 1)[1])
        answer = _final_answer(response, strict)
        scores.append(float(reference is not None and answer is not None and abs(answer - reference) < 1e-6))
    return scores


def _words(text: str) -> int:
    return len(text.split())


def _has(text: str, keyword: str, case_sensitive: bool) -> bool:
    return keyword in text if case_sensitive else keyword.lower() in text.lower()


def _is_json(text: str) -> bool:
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, flags=re.DOTALL)
    try:
        json.loads(fence.group(1) if fence else body)
    except ValueError:
        return False
    return True


def _checks(
    response: str,
    min_words: int | None = None,
    max_words: int | None = None,
    must_contain: Sequence[str] = (),
    must_not_contain: Sequence[str] = (),
    ends_with: str | None = None,
    json: bool = False,
    case_sensitive: bool = False,
) -> list[bool]:
    """One bool per constraint that is set, True where the response meets it."""
    out = []
    if min_words is not None:
        out.append(_words(response) >= min_words)
    if max_words is not None:
        out.append(_words(response) <= max_words)
    out += [_has(response, k, case_sensitive) for k in must_contain]
    out += [not _has(response, k, case_sensitive) for k in must_not_contain]
    if ends_with is not None:
        tail = response.rstrip()
        out.append(tail.endswith(ends_with) if case_sensitive else tail.lower().endswith(ends_with.lower()))
    if json:
        out.append(_is_json(response))
    return out


def instruction_constraints(
    prompts: Sequence[Any],
    responses: Sequence[str],
    fields: Sequence[dict],
    all_or_nothing: bool = False,
    **constraints: Any,
) -> list[float]:
    """The fraction of the verifiable instruction constraints a response meets (IFEval-style checks, Zhou et
    al. 2023, "Instruction-Following Evaluation for Large Language Models"), or 1 / 0 with ``all_or_nothing``.

    Constraints (keyword arguments, or a row's ``constraints`` field, which replaces them for that row):
    ``min_words`` / ``max_words`` (whitespace-separated words, bounds inclusive), ``must_contain`` /
    ``must_not_contain`` (lists of keywords; each one is a constraint), ``ends_with`` (the response, trailing
    whitespace stripped, ends with this string), ``json: true`` (the response, or the body of one fenced
    code block, parses as JSON), ``case_sensitive`` (default False, for keywords and ``ends_with``).

    Returns:
        One float in [0, 1] per response; a row with no constraint at all scores 1.0.

    Raises:
        ValueError: for an unknown constraint name (naming it and the row).
    """
    scores = []
    for i, (response, row) in enumerate(zip(responses, fields)):
        settings = row.get("constraints") if isinstance(row.get("constraints"), dict) else constraints
        try:
            checks = _checks(response, **settings)
        except TypeError as err:
            raise ValueError(
                f"instruction_constraints: row {i}: unknown constraint in {sorted(settings)} ({err}); known: "
                "min_words, max_words, must_contain, must_not_contain, ends_with, json, case_sensitive"
            ) from None
        if not checks:
            scores.append(1.0)
        elif all_or_nothing:
            scores.append(float(all(checks)))
        else:
            scores.append(sum(checks) / len(checks))
    return scores


def word_count_in_range(prompts, responses, fields, min_words: int = 0, max_words: int | None = None):
    """1.0 where ``min_words <= words <= max_words`` (whitespace-separated), else 0.0."""
    return [float(all(_checks(r, min_words=min_words, max_words=max_words))) for r in responses]


def includes_keyword(prompts, responses, fields, keyword: str, case_sensitive: bool = False):
    """1.0 where the response contains ``keyword``, else 0.0."""
    return [float(_has(r, keyword, case_sensitive)) for r in responses]


def excludes_keyword(prompts, responses, fields, keyword: str, case_sensitive: bool = False):
    """1.0 where the response does not contain ``keyword``, else 0.0."""
    return [float(not _has(r, keyword, case_sensitive)) for r in responses]


def ends_with(prompts, responses, fields, suffix: str, case_sensitive: bool = False):
    """1.0 where the response (trailing whitespace stripped) ends with ``suffix``, else 0.0."""
    return [float(all(_checks(r, ends_with=suffix, case_sensitive=case_sensitive))) for r in responses]


def valid_json(prompts, responses, fields):
    """1.0 where the response (or the body of one fenced code block) parses as JSON, else 0.0."""
    return [float(_is_json(r)) for r in responses]
