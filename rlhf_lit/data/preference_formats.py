"""Preference row formats -> canonical pair records (``hh``, ``explicit``, ``messages``, ``ranked``).

See ``formats.py`` for the conventions: converters yield ``(row_index, record)`` or
``(row_index, skip_reason)``, and a field of the wrong type raises :class:`DataFormatError`.
Ranked rows: LOWER rank is BETTER; each untied pair of a row is one example, each tie is counted as
``tied_ranks``. A ranked row's ``margin_field`` may be a number (every pair) or a list of K scores
(the margin of a pair is the absolute difference of its two scores).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import combinations
from typing import Any

from rlhf_lit.data.formats import (
    Converted,
    Fields,
    Message,
    Row,
    assistant_message,
    blank,
    chat_prompt,
    user_message,
)
from rlhf_lit.data.records import split_hh_pair

__all__ = ["preference_records"]

def _text_pair_reason(prompt: str, chosen: str, rejected: str) -> str | None:
    if blank(prompt):
        return "empty_prompt"
    if blank(chosen):
        return "empty_chosen"
    if blank(rejected):
        return "empty_rejected"
    return "identical_pair" if chosen == rejected else None


def _side(row: Row, field: str, value: Any) -> tuple[list[Message], Message]:
    """A chat response given as a string, a message, or a conversation ending in it."""
    if isinstance(value, str):
        return [], assistant_message(value)
    messages = row.messages(field, value)
    if not messages:
        raise row.error(field, "is an empty message list")
    return messages[:-1], messages[-1]


def _chat_pair(row: Row, fields: Fields, prompt_value: Any) -> tuple[list[Message], Message, Message] | str:
    base = [] if prompt_value is None else (
        user_message(prompt_value) if isinstance(prompt_value, str) else row.messages(fields.prompt, prompt_value)
    )
    chosen_ctx, chosen = _side(row, fields.chosen, row.get(fields.chosen))
    rejected_ctx, rejected = _side(row, fields.rejected, row.get(fields.rejected))
    contexts = [ctx[len(base):] if ctx[: len(base)] == base else ctx for ctx in (chosen_ctx, rejected_ctx)]
    if contexts[0] != contexts[1]:
        return "no_shared_prefix"
    prompt = base + contexts[0]
    if not prompt or all(blank(m["content"]) for m in prompt):
        return "empty_prompt"
    for name, msg in (("chosen", chosen), ("rejected", rejected)):
        if msg["role"] != "assistant" or blank(msg["content"]):
            return f"empty_{name}"
    return "identical_pair" if chosen["content"] == rejected["content"] else (prompt, chosen, rejected)


def _margin(row: Row, fields: Fields, value: Any = None) -> float | None:
    if fields.margin is None:
        return None
    value = row.get(fields.margin) if value is None else value
    if value is not None and not isinstance(value, (int, float)):
        raise row.error(fields.margin, f"should be a number, got {type(value).__name__}")
    return None if value is None else float(value)


def preference_records(
    rows: Iterable[dict[str, Any]], fmt: str, fields: Fields, chat: bool, source: int, where: str
) -> Converted:
    """Convert preference rows of one file (``fmt`` already resolved from "auto")."""
    for index, raw in enumerate(rows):
        row = Row(raw, where, index)
        if fmt == "ranked":
            yield from _ranked(row, fields, chat, source)
            continue
        needed = (fields.chosen, fields.rejected) + ((fields.prompt,) if fmt == "explicit" else ())
        if any(row.get(f) is None for f in needed):
            yield index, "missing_field"
            continue
        meta = {"margin": _margin(row, fields), "source": source, "row": index}
        if fmt == "messages":
            result = _chat_pair(row, fields, row.get(fields.prompt))
            if isinstance(result, str):
                yield index, result
            else:
                yield index, {"prompt": result[0], "chosen": result[1], "rejected": result[2], **meta}
            continue
        chosen, rejected = row.text(fields.chosen), row.text(fields.rejected)
        if fmt == "hh":
            if blank(chosen) or blank(rejected):
                yield index, "empty_chosen" if blank(chosen) else "empty_rejected"
                continue
            parts = split_hh_pair(chosen, rejected)
            if parts is None:
                yield index, "no_shared_prefix"
                continue
            prompt, chosen, rejected = parts
        else:
            prompt = row.text(fields.prompt)
        reason = _text_pair_reason(prompt, chosen, rejected)
        if reason:
            yield index, reason
        elif chat:
            record = {"prompt": chat_prompt(prompt, fmt == "hh"), "chosen": assistant_message(chosen)}
            yield index, dict(record, rejected=assistant_message(rejected), **meta)
        else:
            yield index, {"prompt": prompt, "chosen": chosen, "rejected": rejected, **meta}


def _ranked(row: Row, fields: Fields, chat: bool, source: int) -> Converted:
    prompt, responses, ranks = row.get(fields.prompt), row.get(fields.responses), row.get(fields.ranks)
    if prompt is None or responses is None or ranks is None:
        yield row.index, "missing_field"
        return
    if not isinstance(responses, list) or not isinstance(ranks, list) or len(responses) != len(ranks):
        raise row.error(fields.ranks, f"and {fields.responses!r} should be lists of the same length")
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in ranks):
        raise row.error(fields.ranks, "should hold numbers (lower rank = better)")
    scores = row.get(fields.margin) if fields.margin else None
    if isinstance(scores, list) and (
        len(scores) != len(responses) or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)
    ):
        raise row.error(fields.margin, "should be a number or a list of one number per response")
    for i, j in combinations(range(len(responses)), 2):
        if ranks[i] == ranks[j]:
            yield row.index, "tied_ranks"
            continue
        better, worse = (i, j) if ranks[i] < ranks[j] else (j, i)
        margin = abs(scores[i] - scores[j]) if isinstance(scores, list) else _margin(row, fields, scores)
        pair = {fields.prompt: prompt, fields.chosen: responses[better], fields.rejected: responses[worse]}
        use_chat = chat or not isinstance(prompt, str) or not all(isinstance(r, str) for r in responses)
        if use_chat:
            result = _chat_pair(Row(pair, row.where, row.index), fields, prompt)
            if isinstance(result, str):
                yield row.index, result
                continue
            prompt_out, chosen, rejected = result
        else:
            reason = _text_pair_reason(prompt, responses[better], responses[worse])
            if reason:
                yield row.index, reason
                continue
            prompt_out, chosen, rejected = prompt, responses[better], responses[worse]
        margin = None if margin is None else float(margin)
        yield row.index, {"prompt": prompt_out, "chosen": chosen, "rejected": rejected,
                          "margin": margin, "source": source, "row": row.index}
