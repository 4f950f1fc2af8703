"""Row formats -> canonical records (see ``records.py``): shared parts, SFT and prompts. No tokenizer.

The preference formats live in ``preference_formats.py``.

Each converter yields ``(row_index, record)`` for a usable example or ``(row_index, reason)`` (a
``SKIP_REASONS`` string) for a skipped one; the DataModule counts them. A field of the wrong type (a
list where text is expected) is not a skip but a :class:`DataFormatError` naming file, row and field.

Formats ("auto" picks one per file from the first row's keys):

* preference — ``hh`` (``chosen``/``rejected`` transcripts), ``explicit`` (prompt/chosen/rejected
  strings), ``messages`` (message lists), ``ranked`` (one prompt, K responses, ``ranks``: LOWER rank is
  BETTER; each untied pair gives one example, ties are counted as ``tied_ranks``).
* SFT — ``explicit`` (prompt/response), ``alpaca`` (instruction/input/output), ``messages`` (the last
  assistant message is the response), ``hh`` (the ``chosen`` transcript), ``gsm8k`` (question/answer).
* prompts — ``explicit`` (prompt field; bare-string files arrive as ``prompt``), ``messages``, ``hh``,
  ``gsm8k`` (the reference is the final number after ``####``).

With ``chat=True`` text records become chat records: a plain prompt becomes one user message, an HH
prompt is parsed into its user/assistant turns, and responses become stripped assistant messages.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rlhf_lit.data.loading import DataFormatError
from rlhf_lit.data.records import (
    as_hh_prompt,
    gsm8k_reference,
    hh_first_turn_prompt,
    parse_hh_messages,
    split_hh_transcript,
)

Message = dict[str, str]
Converted = Iterator[tuple[int, "dict[str, Any] | str"]]


@dataclass(frozen=True)
class Fields:
    """Field names in the raw rows (configurable on the DataModules)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    response: str = "response"
    responses: str = "responses"
    ranks: str = "ranks"
    messages: str = "messages"
    margin: str | None = None
    reference: str | None = None


class Row:
    """A raw row plus where it came from, for errors that name file, row and field."""

    def __init__(self, row: dict[str, Any], where: str, index: int) -> None:
        self.row, self.where, self.index = row, where, index

    def error(self, field: str, problem: str) -> DataFormatError:
        return DataFormatError(f"malformed data in {self.where}: row {self.index + 1}: field {field!r} {problem}")

    def get(self, field: str) -> Any:
        return self.row.get(field)

    def text(self, field: str) -> str | None:
        value = self.row.get(field)
        if value is not None and not isinstance(value, str):
            raise self.error(field, f"should be a string, got {type(value).__name__}")
        return value

    def messages(self, field: str, value: Any) -> list[Message]:
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        ):
            raise self.error(field, 'should be a list of {"role": str, "content": str} messages')
        return [{"role": m["role"], "content": m["content"]} for m in value]


def blank(text: str | None) -> bool:
    return text is None or not text.strip()


def user_message(text: str) -> list[Message]:
    return [{"role": "user", "content": text.strip()}]


def assistant_message(text: str) -> Message:
    return {"role": "assistant", "content": text.strip()}


def chat_prompt(prompt: str, is_hh: bool) -> list[Message]:
    return parse_hh_messages(prompt) if is_hh else user_message(prompt)


def detect_format(stage: str, first_row: dict[str, Any], fields: Fields, where: str) -> str:
    """Pick the row format of one file from its first row's keys.

    Raises:
        DataFormatError: if no format matches (the message lists the keys found).
    """
    keys = {k for k, v in first_row.items() if v is not None}
    listy = any(isinstance(first_row.get(f), (list, dict)) for f in (fields.prompt, fields.chosen))
    if stage == "preference":
        if {fields.responses, fields.ranks} <= keys:
            return "ranked"
        if {fields.chosen, fields.rejected} <= keys:
            return "messages" if listy else "explicit" if fields.prompt in keys else "hh"
    elif stage == "sft":
        for fmt, needed in (
            ("messages", {fields.messages}),
            ("alpaca", {"instruction", "output"}),
            ("gsm8k", {"question", "answer"}),
            ("explicit", {fields.prompt, fields.response}),
            ("hh", {fields.chosen}),
        ):
            if needed <= keys:
                return fmt
    else:
        for fmt, needed in (
            ("messages", {fields.messages}),
            ("explicit", {fields.prompt}),
            ("gsm8k", {"question"}),
            ("hh", {fields.chosen}),
        ):
            if needed <= keys:
                return fmt
    raise DataFormatError(
        f"cannot tell the {stage} format of {where} from its first row's keys {sorted(keys)}; "
        "set `format` and the field names explicitly"
    )


# ----------------------------------------------------------------------------------------------- SFT
def sft_records(
    rows: Iterable[dict[str, Any]], fmt: str, fields: Fields, chat: bool, source: int, where: str
) -> Converted:
    """Convert SFT rows of one file into ``{"prompt", "response"}`` records."""
    for index, raw in enumerate(rows):
        row = Row(raw, where, index)
        meta = {"source": source, "row": index}
        if fmt == "messages":
            value = row.get(fields.messages)
            if value is None:
                yield index, "missing_field"
                continue
            messages = row.messages(fields.messages, value)
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None or blank(messages[last]["content"]):
                yield index, "empty_response"
            elif not messages[:last] or all(blank(m["content"]) for m in messages[:last]):
                yield index, "empty_prompt"
            else:
                yield index, {"prompt": messages[:last], "response": messages[last], **meta}
            continue
        needed = {
            "explicit": (fields.prompt, fields.response),
            "alpaca": ("instruction", "output"),
            "gsm8k": ("question", "answer"),
            "hh": (fields.chosen,),
        }[fmt]
        if any(row.get(f) is None for f in needed):
            yield index, "missing_field"
            continue
        texts = [row.text(f) for f in needed]
        is_hh = fmt == "hh"
        if is_hh:
            if blank(texts[0]):
                yield index, "empty_response"
                continue
            parts = split_hh_transcript(texts[0])
            if parts is None:
                yield index, "no_shared_prefix"
                continue
            prompt, response = parts
        else:
            prompt, response = texts
            if fmt == "alpaca" and not blank(row.text("input")):
                prompt = f"{prompt.strip()}\n\n{row.text('input').strip()}"
            if fmt != "explicit" and not chat and not blank(prompt):
                prompt, response = as_hh_prompt(prompt), " " + response.strip()
        if blank(prompt):
            yield index, "empty_prompt"
        elif blank(response):
            yield index, "empty_response"
        elif chat:
            yield index, {"prompt": chat_prompt(prompt, is_hh), "response": assistant_message(response), **meta}
        else:
            yield index, {"prompt": prompt, "response": response, **meta}


# ------------------------------------------------------------------------------------------- prompts
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
    for index, raw in enumerate(rows):
        row = Row(raw, where, index)
        meta = {"source": source, "row": index}
        field = {"explicit": fields.prompt, "messages": fields.messages, "gsm8k": "question", "hh": fields.chosen}[fmt]
        if row.get(field) is None:
            yield index, "missing_field"
            continue
        reference = None
        if fmt == "messages":
            messages = row.messages(field, row.get(field))
            if messages and messages[-1]["role"] == "assistant":
                messages = messages[:-1]  # SFT-style conversations: prompt for the last reply
            if not messages or all(blank(m["content"]) for m in messages):
                yield index, "empty_prompt"
            else:
                yield index, {"prompt": messages, "reference": None, **meta}
            continue
        text = row.text(field)
        if fmt == "hh" and not blank(text):
            parts = split_hh_transcript(text)
            text = hh_first_turn_prompt(text) if hh_first_turn_only else parts[0] if parts else None
            if text is None:
                yield index, "no_shared_prefix"
                continue
        elif fmt == "gsm8k":
            answer = row.get("answer")
            reference = gsm8k_reference(answer) if isinstance(answer, str) else None
            text = text if chat or blank(text) else as_hh_prompt(text)
        elif fields.reference is not None and row.get(fields.reference) is not None:
            reference = str(row.get(fields.reference))
        if blank(text):
            yield index, "empty_prompt"
        elif chat:
            yield index, {"prompt": chat_prompt(text, fmt == "hh"), "reference": reference, **meta}
        else:
            yield index, {"prompt": text, "reference": reference, **meta}
