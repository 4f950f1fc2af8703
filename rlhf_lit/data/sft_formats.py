"""SFT row formats -> demonstration records (``prompt``, ``response``); see ``formats.py`` for the formats."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlhf_lit.data.formats import (
    Converted,
    Fields,
    Row,
    assistant_message,
    blank,
    chat_prompt,
    conversation,
    convert_rows,
    join_response,
)
from rlhf_lit.data.records import (
    HUMAN_MARK,
    as_hh_prompt,
    split_hh_transcript,
)

__all__ = ["sft_records"]


def sft_records(
    rows: Iterable[dict[str, Any]],
    fmt: str,
    fields: Fields,
    chat: bool,
    source: int,
    where: str,
    keep_label: bool | None = None,
) -> Converted:
    """Convert SFT rows of one file into ``{"prompt", "response"}`` records.

    ``keep_label``: keep only rows whose ``fields.label`` equals it (the others are skipped as
    ``filtered_by_label``); None reads no label.
    """

    def convert(row: Row) -> dict | str:
        if keep_label is not None and fields.label and row.label(fields.label) != keep_label:
            return "filtered_by_label"
        meta = {"source": source, "row": row.index}
        if fmt in ("messages", "sharegpt"):
            messages = conversation(row, fields.messages if fmt == "messages" else fields.conversations)
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None or blank(messages[last]["content"]):
                return "empty_response"
            if not messages[:last] or all(blank(m["content"]) for m in messages[:last]):
                return "empty_prompt"
            return {"prompt": messages[:last], "response": messages[last], **meta}
        is_hh = fmt == "hh"
        if fmt == "explicit":
            response_field = fields.response if row.get(fields.response) is not None else fields.completion
            prompt, response = row.prompt_text(fields), row.text(response_field)
            if prompt is None or response is None:
                return "missing_field"
        elif fmt == "alpaca":
            prompt, response = row.text("instruction"), row.text("output")
            if prompt is None or response is None:
                return "missing_field"
            if not blank(row.text("input")):
                prompt = f"{prompt.strip()}\n\n{row.text('input').strip()}"
        elif fmt == "gsm8k":
            prompt, response = row.text("question"), row.text("answer")
            if prompt is None or response is None:
                return "missing_field"
        else:  # hh
            transcript = row.text(fields.chosen)
            if transcript is None:
                return "missing_field"
            if blank(transcript):
                return "empty_response"
            parts = split_hh_transcript(transcript)
            if parts is None:
                return "no_shared_prefix"
            prompt, response = parts
            if HUMAN_MARK in response:  # the transcript ends with a human turn: no single response
                return "multi_turn_response"
        if blank(prompt):
            return "empty_prompt"
        if blank(response):
            return "empty_response"
        if chat:
            return {"prompt": chat_prompt(prompt, is_hh), "response": assistant_message(response), **meta}
        if fmt in ("alpaca", "gsm8k"):
            prompt, response = as_hh_prompt(prompt), " " + response.strip()
        elif fmt == "explicit":
            response = join_response(prompt, response, fields.separator)
        return {"prompt": prompt, "response": response, **meta}

    return convert_rows(rows, where, convert)
