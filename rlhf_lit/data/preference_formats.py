"""Preference row formats -> canonical records: pairs (``hh``, ``explicit``, ``messages``, ``sharegpt``,
``ranked``, ``oasst_tree``) and unpaired completions (``unpaired``).

See ``formats.py`` for the conventions: converters yield ``(row_index, record)`` or
``(row_index, skip_reason)``, and a field of the wrong type raises :class:`DataFormatError`.

* Ranked rows: LOWER rank is BETTER; each untied pair of a row is one example, each tie is counted as
  ``tied_ranks``; a row with a null rank is skipped (``null_rank``), one with fewer than 2 responses too
  (``too_few_responses``), one with a nan or inf rank too (``non_finite_rank``: nan has no order). A ranked
  row's ``margin_field`` may be a number (every pair) or a list of K scores (the margin of a pair is the absolute difference of its two scores). With ``weight_ranked_pairs``
  every pair of a row of K responses carries ``weight = 1 / C(K, 2)``, so each prompt weighs the same in
  the loss however many responses it ranks (Ouyang et al. 2022, section 3.5 and eq. 1); other rows weigh 1.
* Open-Assistant message trees (``oasst_tree``, the shape of its ``*.trees.jsonl`` exports: ``prompt`` is a
  message ``{"text", "role": "prompter" | "assistant", "rank", "replies": [...]}``): every prompter message
  with assistant replies is one ranked list (its thread as the prompt, the replies' ``rank`` as ranks; 0 =
  best), with the same skips. All lists of one tree share the tree's row, so a split keeps them together.
* HH rows whose responses hold a further ``"\\n\\nHuman:"`` turn are skipped (``multi_turn_response``).
* A margin or score that is nan or inf (JSON ``NaN`` / ``Infinity``) skips its row (``non_finite_margin``).
* Pairs whose two sides are equal after whitespace normalisation are skipped (``identical_pair``).
* Unpaired rows (KTO-style: ``prompt`` + ``completion`` + boolean ``label``, or a ``messages`` list ending in
  the completion + ``label``) become ``{"prompt", "response", "label"}`` records, carried as such for an
  unpaired objective; with ``pair_unpaired`` every desirable completion of a prompt is paired with every
  undesirable one of the same prompt (exact prompt match), and rows with no opposite are skipped
  (``no_opposite_label``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from itertools import combinations
from math import comb
from typing import Any

from rlhf_lit.data.formats import (
    Converted,
    Fields,
    Message,
    Row,
    SkipRow,
    assistant_message,
    blank,
    chat_prompt,
    convert_rows,
    join_response,
    normalized,
)
from rlhf_lit.data.records import HUMAN_MARK, split_hh_pair

__all__ = ["preference_records"]


def _text_pair_reason(prompt: str, chosen: str, rejected: str) -> str | None:
    if blank(prompt):
        return "empty_prompt"
    if blank(chosen):
        return "empty_chosen"
    if blank(rejected):
        return "empty_rejected"
    return "identical_pair" if normalized(chosen) == normalized(rejected) else None


def _side(row: Row, field: str, value: Any) -> tuple[list[Message], Message]:
    """A chat response given as a string, a message, or a conversation ending in it."""
    if isinstance(value, str):
        return [], assistant_message(value)
    messages = row.messages(field, value)
    if not messages:
        raise row.error(field, "is an empty message list")
    return messages[:-1], messages[-1]


def _chat_pair(row: Row, fields: Fields, base: list[Message]) -> tuple[list[Message], Message, Message] | str:
    chosen_ctx, chosen = _side(row, fields.chosen, row.get(fields.chosen))
    rejected_ctx, rejected = _side(row, fields.rejected, row.get(fields.rejected))
    contexts = [ctx[len(base) :] if ctx[: len(base)] == base else ctx for ctx in (chosen_ctx, rejected_ctx)]
    if contexts[0] != contexts[1]:
        return "no_shared_prefix"
    prompt = base + contexts[0]
    if not prompt or all(blank(m["content"]) for m in prompt):
        return "empty_prompt"
    for name, msg in (("chosen", chosen), ("rejected", rejected)):
        if msg["role"] != "assistant" or blank(msg["content"]):
            return f"empty_{name}"
    if normalized(chosen["content"]) == normalized(rejected["content"]):
        return "identical_pair"
    return prompt, chosen, rejected


def _prompt_messages(row: Row, field: str, value: Any) -> list[Message]:
    if value is None:
        return []
    return chat_prompt(value) if isinstance(value, str) else row.messages(field, value)


def _margin(row: Row, fields: Fields, value: Any = None) -> float | None:
    if fields.margin is None:
        return None
    value = row.get(fields.margin) if value is None else value
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise row.error(fields.margin, f"should be a number, got {type(value).__name__}")
    if value is not None and not math.isfinite(value):  # JSON's NaN / Infinity: never trained on
        raise SkipRow("non_finite_margin")
    return None if value is None else float(value)


def preference_records(
    rows: Iterable[dict[str, Any]],
    fmt: str,
    fields: Fields,
    chat: bool,
    source: int,
    where: str,
    pair_unpaired: bool = False,
    weight_ranked_pairs: bool = False,
) -> Converted:
    """Convert preference rows of one file (``fmt`` already resolved from "auto").

    Args:
        rows: the file's rows.
        fmt: the row format (see the module docstring).
        fields: field names and text options.
        chat: render text data as chat messages.
        source: index of the file among the DataModule's sources.
        where: the file's name, for error messages.
        pair_unpaired: ``unpaired`` rows: build pairs by matching prompts instead of unpaired records.
        weight_ranked_pairs: give each pair of a ranked row of K responses ``weight = 1 / C(K, 2)``.
    """
    weight = 1.0 if weight_ranked_pairs else None
    if fmt == "unpaired":
        return _unpaired(rows, fields, chat, source, where, pair_unpaired, weight)

    def convert(row: Row):
        if fmt == "ranked":
            return _ranked(
                row,
                fields,
                chat,
                source,
                row.get(fields.prompt),
                row.get(fields.responses),
                row.get(fields.ranks),
                weight_ranked_pairs,
            )
        if fmt == "oasst_tree":
            return _oasst_tree(row, fields, chat, source, weight_ranked_pairs)
        meta = {"margin": _margin(row, fields), "source": source, "row": row.index}
        if weight is not None:
            meta["weight"] = weight
        if fmt in ("messages", "sharegpt"):
            needed = (fields.chosen, fields.rejected) + ((fields.conversations,) if fmt == "sharegpt" else ())
            if any(row.get(f) is None for f in needed):
                return "missing_field"
            base_field = fields.conversations if fmt == "sharegpt" else fields.prompt
            result = _chat_pair(row, fields, _prompt_messages(row, base_field, row.get(base_field)))
            if isinstance(result, str):
                return result
            return {"prompt": result[0], "chosen": result[1], "rejected": result[2], **meta}
        chosen, rejected = row.text(fields.chosen), row.text(fields.rejected)
        prompt = row.prompt_text(fields) if fmt == "explicit" else ""
        if chosen is None or rejected is None or prompt is None:
            return "missing_field"
        if fmt == "hh":
            if blank(chosen) or blank(rejected):
                return "empty_chosen" if blank(chosen) else "empty_rejected"
            parts = split_hh_pair(chosen, rejected)
            if parts is None:
                return "no_shared_prefix"
            prompt, chosen, rejected = parts
            if HUMAN_MARK in chosen or HUMAN_MARK in rejected:
                return "multi_turn_response"
        reason = _text_pair_reason(prompt, chosen, rejected)
        if reason:
            return reason
        if chat:
            record = {"prompt": chat_prompt(prompt, fmt == "hh"), "chosen": assistant_message(chosen)}
            return dict(record, rejected=assistant_message(rejected), **meta)
        if fmt == "explicit":
            chosen = join_response(prompt, chosen, fields.separator)
            rejected = join_response(prompt, rejected, fields.separator)
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **meta}

    return convert_rows(rows, where, convert)


def _ranked(
    row: Row, fields: Fields, chat: bool, source: int, prompt: Any, responses: Any, ranks: Any, weighted: bool
) -> list:
    """The pairs (or skip reasons) of one ranked list; ``prompt`` a string or messages."""
    if prompt is None or responses is None or ranks is None:
        return ["missing_field"]
    if not isinstance(responses, list) or not isinstance(ranks, list) or len(responses) != len(ranks):
        raise row.error(fields.ranks, f"and {fields.responses!r} should be lists of the same length")
    if len(responses) < 2:
        return ["too_few_responses"]
    if any(r is None for r in ranks):
        return ["null_rank"]
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in ranks):
        raise row.error(fields.ranks, "should hold numbers (lower rank = better)")
    if not all(math.isfinite(r) for r in ranks):
        # a nan rank compares false with every other, so "better than" would not be an order (a nan ranked
        # list yields a preference cycle); the whole list is skipped, as for a null rank
        return ["non_finite_rank"]
    scores = row.get(fields.margin) if fields.margin else None
    if isinstance(scores, list) and (
        len(scores) != len(responses)
        or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)
    ):
        raise row.error(fields.margin, "should be a number or a list of one number per response")
    if isinstance(scores, list) and not all(math.isfinite(s) for s in scores):
        return ["non_finite_margin"]
    if isinstance(scores, (int, float)) and not isinstance(scores, bool) and not math.isfinite(scores):
        return ["non_finite_margin"]
    use_chat = chat or not isinstance(prompt, str) or not all(isinstance(r, str) for r in responses)
    base = _prompt_messages(row, fields.prompt, prompt) if use_chat else None
    weight = 1.0 / comb(len(responses), 2) if weighted else None
    out: list = []
    for i, j in combinations(range(len(responses)), 2):
        if ranks[i] == ranks[j]:
            out.append("tied_ranks")
            continue
        better, worse = (i, j) if ranks[i] < ranks[j] else (j, i)
        margin = abs(scores[i] - scores[j]) if isinstance(scores, list) else _margin(row, fields, scores)
        if use_chat:
            pair = {fields.chosen: responses[better], fields.rejected: responses[worse]}
            result = _chat_pair(Row(pair, row.where, row.index), fields, base)
            if isinstance(result, str):
                out.append(result)
                continue
            prompt_out, chosen, rejected = result
        else:
            reason = _text_pair_reason(prompt, responses[better], responses[worse])
            if reason:
                out.append(reason)
                continue
            prompt_out = prompt
            chosen = join_response(prompt, responses[better], fields.separator)
            rejected = join_response(prompt, responses[worse], fields.separator)
        record = {
            "prompt": prompt_out,
            "chosen": chosen,
            "rejected": rejected,
            "margin": None if margin is None else float(margin),
            "source": source,
            "row": row.index,
        }
        if weight is not None:
            record["weight"] = weight
        out.append(record)
    return out


def _oasst_tree(row: Row, fields: Fields, chat: bool, source: int, weighted: bool) -> list:
    """Every prompter message of an Open-Assistant tree with its assistant replies -> one ranked list."""
    root = row.get(fields.prompt)
    if root is None:
        return ["missing_field"]
    if not isinstance(root, dict):
        raise row.error(
            fields.prompt,
            f"should be a message tree (an object with 'text' and 'replies'), got {type(root).__name__}",
        )
    out: list = []
    stack: list[tuple[dict, list[Message]]] = [(root, [])]
    while stack:
        node, thread = stack.pop()
        text, role = node.get("text"), node.get("role")
        if not isinstance(text, str) or role not in ("prompter", "assistant"):
            raise row.error(
                fields.prompt,
                f"holds a message without a string 'text' and a role prompter/assistant: {str(node)[:80]}",
            )
        here = thread + [{"role": "user" if role == "prompter" else "assistant", "content": text}]
        replies = node.get("replies") or []
        if not isinstance(replies, list):
            raise row.error(fields.prompt, "holds 'replies' that is not a list")
        if role == "prompter":
            answers = [r for r in replies if isinstance(r, dict) and r.get("role") == "assistant"]
            prompt: Any = here if chat else _hh_transcript(here)
            responses = [r.get("text") for r in answers]
            if not all(isinstance(t, str) for t in responses):
                raise row.error(fields.prompt, "holds an assistant reply without a string 'text'")
            if not chat:
                responses = [" " + t.strip() for t in responses]
            out += _ranked(
                row, fields, chat, source, prompt, responses, [r.get("rank") for r in answers], weighted
            )
        stack += [(reply, here) for reply in reversed(replies) if isinstance(reply, dict)]
    return out


def _hh_transcript(messages: list[Message]) -> str:
    """A thread in the HH transcript form, ending with the assistant's turn to speak."""
    turns = "".join(
        f"\n\n{'Human' if m['role'] == 'user' else 'Assistant'}: {m['content'].strip()}" for m in messages
    )
    return turns + "\n\nAssistant:"


def _unpaired(
    rows: Iterable[dict[str, Any]],
    fields: Fields,
    chat: bool,
    source: int,
    where: str,
    pair: bool,
    weight: float | None,
) -> Converted:
    """Unpaired (KTO-style) rows as ``{"prompt", "response", "label"}`` records, or, with ``pair``, as pairs
    of a desirable and an undesirable completion of the same prompt."""

    def convert(row: Row) -> dict | str:
        if not fields.label:
            raise row.error("label_field", "is null, but unpaired rows need a label field")
        label = row.label(fields.label)
        if row.get(fields.completion) is None and isinstance(row.get(fields.messages), list):
            messages = row.messages(fields.messages, row.get(fields.messages))
            if not messages or messages[-1]["role"] != "assistant":
                return "empty_response"
            prompt: Any = messages[:-1]
            completion: Any = messages[-1]
        else:
            value = row.get(fields.prompt) if fields.prompt_template is None else row.prompt_text(fields)
            completion = row.get(fields.completion)
            if value is None or completion is None:
                return "missing_field"
            prompt = value if isinstance(value, str) else row.messages(fields.prompt, value)
            if not isinstance(completion, str):
                completion = _side(row, fields.completion, completion)[1]
        if blank(prompt) if isinstance(prompt, str) else all(blank(m["content"]) for m in prompt):
            return "empty_prompt"
        if blank(completion if isinstance(completion, str) else completion["content"]):
            return "empty_response"
        if chat or not isinstance(prompt, str) or not isinstance(completion, str):
            prompt = chat_prompt(prompt) if isinstance(prompt, str) else prompt
            completion = assistant_message(
                completion if isinstance(completion, str) else completion["content"]
            )
        else:
            completion = join_response(prompt, completion, fields.separator)
        return {
            "prompt": prompt,
            "response": completion,
            "label": label,
            "margin": None,
            "source": source,
            "row": row.index,
        }

    converted = convert_rows(rows, where, convert)
    if not pair:
        yield from converted
        return
    yield from _paired_by_prompt(converted, source, weight)


def _paired_by_prompt(converted: Converted, source: int, weight: float | None) -> Converted:
    """Unpaired records grouped by prompt, each desirable completion paired with each undesirable one; a
    prompt without both labels gives ``no_opposite_label`` for each of its rows."""
    groups: dict[str, list[tuple[int, dict]]] = {}
    for index, item in converted:
        if isinstance(item, str):
            yield index, item
        else:
            groups.setdefault(json.dumps(item["prompt"], sort_keys=True), []).append((index, item))
    for members in groups.values():
        good = [m for m in members if m[1]["label"]]
        bad = [m for m in members if not m[1]["label"]]
        if not good or not bad:
            for index, _ in members:
                yield index, "no_opposite_label"
            continue
        first = members[0][0]  # every pair of one prompt lands on the same side of the split
        for (_, g), (_, b) in ((g, b) for g in good for b in bad):
            chosen, rejected = g["response"], b["response"]
            if isinstance(chosen, str):
                reason = _text_pair_reason(g["prompt"], chosen, rejected)
            else:
                reason = (
                    "identical_pair"
                    if normalized(chosen["content"]) == normalized(rejected["content"])
                    else None
                )
            if reason:
                yield first, reason
                continue
            record = {
                "prompt": g["prompt"],
                "chosen": chosen,
                "rejected": rejected,
                "margin": None,
                "source": source,
                "row": first,
            }
            if weight is not None:
                record["weight"] = weight
            yield first, record
