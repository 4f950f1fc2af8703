"""Prompt row formats -> prompt records (``prompt``, optional ``reference``); see ``formats.py`` for the formats."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlhf_lit.data.formats import (
    Converted,
    Fields,
    Row,
    blank,
    chat_prompt,
    conversation,
    convert_rows,
)
from rlhf_lit.data.records import (
    as_hh_prompt,
    gsm8k_reference,
    hh_first_turn_prompt,
    split_hh_transcript,
)

__all__ = ["prompt_records"]


def prompt_records(
    rows: Iterable[dict[str, Any]],
    fmt: str,
    fields: Fields,
    chat: bool,
    source: int,
    where: str,
    hh_first_turn_only: bool = False,
) -> Converted:
    """Convert prompt rows of one file into ``{"prompt", "reference"}`` records."""

    def convert(row: Row) -> dict | str:
        meta = {
            "source": source,
            "row": row.index,
            "fields": dict(row.row) if isinstance(row.row, dict) else {},
        }
        if fmt in ("messages", "sharegpt"):
            messages = conversation(row, fields.messages if fmt == "messages" else fields.conversations)
            if messages and messages[-1]["role"] == "assistant":
                messages = messages[:-1]  # SFT-style conversations: prompt for the last reply
            if not messages or all(blank(m["content"]) for m in messages):
                return "empty_prompt"
            return {"prompt": messages, "reference": None, **meta}
        reference = None
        if fmt == "explicit":
            text = row.prompt_text(fields)
        elif fmt == "alpaca":
            text = row.text("instruction")
            if text is not None and not blank(row.text("input")):
                text = f"{text.strip()}\n\n{row.text('input').strip()}"
        elif fmt == "gsm8k":
            text = row.text("question")
            answer = row.get("answer")
            reference = gsm8k_reference(answer) if isinstance(answer, str) else None
        else:  # hh
            text = row.text(fields.chosen)
            if not blank(text):
                parts = split_hh_transcript(text)
                text = hh_first_turn_prompt(text) if hh_first_turn_only else parts[0] if parts else None
                if text is None:
                    return "no_shared_prefix"
        if text is None:
            return "missing_field"
        if fmt == "explicit" and fields.reference is not None and row.get(fields.reference) is not None:
            reference = str(row.get(fields.reference))
        if blank(text):
            return "empty_prompt"
        if chat:
            return {"prompt": chat_prompt(text, fmt == "hh"), "reference": reference, **meta}
        if fmt in ("alpaca", "gsm8k"):
            text = as_hh_prompt(text)
        return {"prompt": text, "reference": reference, **meta}

    return convert_rows(rows, where, convert)
