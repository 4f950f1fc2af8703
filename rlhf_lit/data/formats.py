"""Row formats -> canonical records (see ``records.py``): the parts every format shares. No tokenizer.

The converters live in ``sft_formats.py``, ``prompt_formats.py`` and ``preference_formats.py``.

Each converter yields ``(row_index, record)`` for a usable example or ``(row_index, reason)`` (a
``SKIP_REASONS`` string) for a skipped one; the DataModule counts them. A field of the wrong type (a
list where text is expected) is not a skip but a :class:`DataFormatError` naming file, row and field.

Formats ("auto" picks one per file from the first row's keys):

* preference — ``hh`` (``chosen``/``rejected`` transcripts), ``explicit`` (prompt/chosen/rejected
  strings), ``messages`` (message lists), ``sharegpt`` (``conversations`` of ``{from, value}`` plus
  ``chosen``/``rejected`` messages), ``ranked`` (one prompt, K responses, ``ranks``: LOWER rank is BETTER;
  each untied pair gives one example, ties are counted as ``tied_ranks``), ``oasst_tree`` (Open-Assistant
  message trees -> one ranked list per prompter message), ``unpaired`` (KTO-style prompt, completion,
  boolean label).
* SFT — ``explicit`` (prompt/response, or prompt/completion), ``alpaca`` (instruction/input/output),
  ``messages`` and ``sharegpt`` (the last assistant message is the response), ``hh`` (the ``chosen``
  transcript), ``gsm8k`` (question/answer).
* prompts — ``explicit`` (prompt field; bare-string files arrive as ``prompt``), ``alpaca``
  (instruction + input), ``messages``, ``sharegpt``, ``hh``, ``gsm8k`` (the reference is the final number
  after ``####``).

Field names may be dotted / indexed paths into nested rows (``instances.0.input``, ``messages.-1.content``),
and ``prompt_template`` joins several fields into the prompt (``"{instruction}\\n\\n{instances.0.input}"``;
empty parts leave no stray blank lines at the ends). ShareGPT roles map ``human``/``user``/``prompter`` to
``user``, ``gpt``/``assistant``/``bot``/``model`` to ``assistant`` and ``system`` to ``system`` (any case);
a row with another role (tool calls) is skipped as ``unknown_role``.

Text mode (no chat template): an explicit prompt and response are joined with ``separator`` (default one
space) unless the prompt already ends, or the response already starts, with whitespace. With ``chat=True``
text records become chat records: a plain prompt becomes one user message, a prompt in the HH transcript
form (``Human: ... Assistant:``) is parsed into its turns (never wrapped again), and responses become
stripped assistant messages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rlhf_lit.data.loading import DataFormatError
from rlhf_lit.data.records import (
    looks_like_hh,
    parse_hh_messages,
)

Message = dict[str, str]
Converted = Iterator[tuple[int, "dict[str, Any] | str"]]

#: ShareGPT / Open-Assistant role names -> chat-template roles (compared lower-cased).
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Fields:
    """Field names (or dotted paths) in the raw rows and how fields become texts (set on the DataModules).

    Args:
        prompt, chosen, rejected, response, responses, ranks, messages, margin, reference: field names.
        conversations: the ShareGPT message list (``sharegpt`` format).
        completion: the completion of an unpaired row (and SFT's fallback response field).
        label: the boolean desirability label of unpaired (KTO-style) rows; None ignores labels.
        prompt_template: builds the prompt from several fields (``{path}`` placeholders) instead of ``prompt``.
        separator: put between an explicit prompt and its response in text mode (see the module docstring).
    """

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    response: str = "response"
    responses: str = "responses"
    ranks: str = "ranks"
    messages: str = "messages"
    margin: str | None = None
    reference: str | None = None
    conversations: str = "conversations"
    completion: str = "completion"
    label: str | None = "label"
    prompt_template: str | None = None
    separator: str = " "

    def __post_init__(self) -> None:
        # the escapes of a YAML double-quoted string, also where the text reached us without them read: a
        # shell passes --data.init_args.prompt_template='{a}\n\n{b}' as a backslash and an n
        for name in ("prompt_template", "separator"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, unescape(value))


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
_ESCAPE = re.compile(r"\\([ntr\\])")


def unescape(text: str) -> str:
    """``text`` with the escapes ``\\n``, ``\\t``, ``\\r`` and ``\\\\`` read as a newline, a tab, a carriage return
    and one backslash, as in a YAML double-quoted string (other backslashes are kept). Text from YAML double
    quotes holds no such escape any more (YAML read them), so it is unchanged; the same text from the command
    line, in YAML single quotes or unquoted, now means the same. Example: ``'{a}\\n\\n{b}'`` (10 characters with
    two backslashes) gives ``'{a}<newline><newline>{b}'``."""
    return _ESCAPE.sub(lambda match: _ESCAPES[match[1]], text)


class SkipRow(Exception):
    """Raised inside a row's conversion to skip it for ``reason`` (a ``SKIP_REASONS`` string)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_MISSING = object()
_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


def get_path(row: Any, path: str) -> Any:
    """The value at ``path`` in a row: the key itself, else a dotted path (``a.b``, list indexes ``a.0``,
    ``a.-1``); None where any part is missing (or out of range)."""
    if isinstance(row, dict) and path in row:
        return row[path]
    node = row
    for part in path.split("."):
        if isinstance(node, dict):
            node = node.get(part, _MISSING)
        elif isinstance(node, (list, tuple)) and re.fullmatch(r"-?\d+", part):
            index = int(part)
            node = node[index] if -len(node) <= index < len(node) else _MISSING
        else:
            node = _MISSING
        if node is _MISSING or node is None:
            return None
    return node


def template_fields(template: str) -> list[str]:
    """The field paths a prompt template reads (its ``{...}`` placeholders, in order)."""
    return _PLACEHOLDER.findall(template.replace("{{", "").replace("}}", ""))


class Row:
    """A raw row plus where it came from, for errors that name file, row and field."""

    def __init__(self, row: dict[str, Any], where: str, index: int) -> None:
        self.row, self.where, self.index = row, where, index

    def error(self, field: str, problem: str) -> DataFormatError:
        return DataFormatError(
            f"malformed data in {self.where}: row {self.index + 1}: field {field!r} {problem}"
        )

    def get(self, field: str) -> Any:
        return get_path(self.row, field)

    def text(self, field: str) -> str | None:
        value = self.get(field)
        if value is not None and not isinstance(value, str):
            raise self.error(field, f"should be a string, got {type(value).__name__}")
        return value

    def label(self, field: str) -> bool:
        """A boolean label (True = desirable); a missing one skips the row (``missing_field``)."""
        value = self.get(field)
        if value is None:
            raise SkipRow("missing_field")
        if not isinstance(value, bool):
            raise self.error(
                field, f"should be a boolean (true = desirable), got {type(value).__name__} {value!r}"
            )
        return value

    def prompt_text(self, fields: Fields) -> str | None:
        """The prompt: ``prompt_template`` filled from the row, else the ``prompt`` field."""
        if fields.prompt_template is None:
            return self.text(fields.prompt)

        def fill(match: re.Match) -> str:
            value = self.get(match[1])
            if value is not None and not isinstance(value, (str, int, float)):
                raise self.error(
                    match[1], f"should be text for the prompt template, got {type(value).__name__}"
                )
            return "" if value is None else str(value)

        escaped = fields.prompt_template.replace("{{", "\0").replace("}}", "\1")
        return _PLACEHOLDER.sub(fill, escaped).replace("\0", "{").replace("\1", "}").strip()

    def messages(self, field: str, value: Any) -> list[Message]:
        """A message list from ``{"role", "content"}`` or ShareGPT ``{"from", "value"}`` messages (a single
        message is accepted too); roles are mapped with ``ROLE_ALIASES``.

        Raises:
            DataFormatError: if it is not a list of such messages.
            SkipRow: ``unknown_role`` for a role outside ``ROLE_ALIASES`` (e.g. a tool call).
        """
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list):
            raise self.error(
                field,
                f'should be a list of {{"role": str, "content": str}} messages, got {type(value).__name__}',
            )
        out = []
        for position, message in enumerate(value, 1):
            if not isinstance(message, dict):
                raise self.error(
                    field, f"message {position} should be an object, got {type(message).__name__}"
                )
            role_key, content_key = (
                ("role", "content") if "role" in message or "content" in message else ("from", "value")
            )
            role, content = message.get(role_key), message.get(content_key)
            if not isinstance(role, str) or not (content is None or isinstance(content, str)):
                raise self.error(
                    field,
                    f'message {position} should have a string "{role_key}" and "{content_key}", got {message!r:.80}',
                )
            mapped = ROLE_ALIASES.get(role.strip().lower())
            if mapped is None:
                raise SkipRow("unknown_role")
            out.append({"role": mapped, "content": content or ""})
        return out


def convert_rows(rows: Iterable[dict[str, Any]], where: str, convert: Callable[[Row], Any]) -> Converted:
    """Run ``convert`` on every row; it returns a record, a skip reason, or a list of them (one row, many
    examples); a :class:`SkipRow` raised inside skips the row."""
    for index, raw in enumerate(rows):
        row = Row(raw, where, index)
        try:
            result = convert(row)
        except SkipRow as skip:
            yield index, skip.reason
            continue
        for item in result if isinstance(result, list) else [result]:
            yield index, item


def blank(text: str | None) -> bool:
    return text is None or not text.strip()


def normalized(text: str) -> str:
    """Whitespace-normalised text: pairs equal after this are identical (``identical_pair``)."""
    return " ".join(text.split())


def user_message(text: str) -> list[Message]:
    return [{"role": "user", "content": text.strip()}]


def assistant_message(text: str) -> Message:
    return {"role": "assistant", "content": text.strip()}


def chat_prompt(prompt: str, is_hh: bool = False) -> list[Message]:
    """A text prompt as chat messages: HH transcripts (or prompts in that form) are parsed into their turns."""
    return parse_hh_messages(prompt) if is_hh or looks_like_hh(prompt) else user_message(prompt)


def join_response(prompt: str, response: str, separator: str) -> str:
    """The response as it follows the prompt in text mode: ``separator`` first, unless the prompt ends or the
    response starts with whitespace already (so HH-style data keeps its own leading space)."""
    if not prompt or not response or prompt[-1].isspace() or response[0].isspace():
        return response
    return separator + response


def detect_format(stage: str, first_row: dict[str, Any], fields: Fields, where: str) -> str:
    """Pick the row format of one file from its first row's keys.

    Raises:
        DataFormatError: if no format matches (the message lists the keys found and what each format needs).
    """
    keys = {k for k, v in first_row.items() if v is not None}
    has = lambda *names: all(get_path(first_row, n) is not None for n in names)  # noqa: E731
    listy = any(isinstance(get_path(first_row, f), (list, dict)) for f in (fields.prompt, fields.chosen))
    templated = fields.prompt_template is not None and all(
        f.split(".")[0] in first_row for f in template_fields(fields.prompt_template)
    )
    if stage != "preference" and not templated and "instruction" in keys and "instances" in keys:
        raise DataFormatError(
            f"{where} looks like self-instruct seed tasks (instruction + instances[]): reading only `instruction` "
            'would drop the instance input; set prompt_template: "{instruction}\\n\\n{instances.0.input}"'
            + (" and response_field: instances.0.output" if stage == "sft" else "")
        )
    if templated and stage == "prompt":
        return "explicit"  # the template builds the prompt: the explicit format with a template
    if templated and stage == "sft" and (has(fields.response) or has(fields.completion)):
        return "explicit"
    if templated and stage == "preference" and has(fields.chosen, fields.rejected) and not listy:
        return "explicit"
    if stage == "preference":
        if isinstance(first_row.get(fields.prompt), dict) and "replies" in first_row[fields.prompt]:
            return "oasst_tree"
        if has(fields.responses, fields.ranks):
            return "ranked"
        if has(fields.conversations, fields.chosen, fields.rejected):
            return "sharegpt"
        if fields.label and has(fields.label) and (has(fields.completion) or has(fields.messages)):
            return "unpaired"
        if has(fields.chosen, fields.rejected):
            return "messages" if listy else "explicit" if has(fields.prompt) else "hh"
    elif stage == "sft":
        for fmt, needed in (
            ("messages", (fields.messages,)),
            ("sharegpt", (fields.conversations,)),
            ("alpaca", ("instruction", "output")),
            ("gsm8k", ("question", "answer")),
            ("explicit", (fields.prompt, fields.response)),
            ("explicit", (fields.prompt, fields.completion)),
            ("hh", (fields.chosen,)),
        ):
            if has(*needed):
                return fmt
    else:
        for fmt, needed in (
            ("messages", (fields.messages,)),
            ("sharegpt", (fields.conversations,)),
            ("explicit", (fields.prompt,)),
            ("alpaca", ("instruction",)),
            ("gsm8k", ("question",)),
            ("hh", (fields.chosen,)),
        ):
            if has(*needed):
                return fmt
    expected = {
        "preference": "hh: chosen+rejected transcripts; explicit: prompt+chosen+rejected; messages or sharegpt: "
        "message lists; ranked: prompt+responses+ranks; unpaired: prompt+completion+label",
        "sft": "explicit: prompt+response; alpaca: instruction+output; messages / sharegpt: message lists; "
        "gsm8k: question+answer; hh: chosen",
        "prompt": "explicit: prompt; alpaca: instruction; messages / sharegpt: message lists; gsm8k: question; "
        "hh: chosen",
    }[stage]
    raise DataFormatError(
        f"cannot tell the {stage} format of {where} from its first row's keys {sorted(keys)} ({expected}); "
        "set `format` and the *_field options"
    )


def required_fields(stage: str, fmt: str, fields: Fields) -> list[str]:
    """Top-level columns every row of a format needs (a file without one is a format mistake, not a skip)."""
    prompt = template_fields(fields.prompt_template) if fields.prompt_template else [fields.prompt]
    table = {
        ("preference", "hh"): [fields.chosen, fields.rejected],
        ("preference", "explicit"): [*prompt, fields.chosen, fields.rejected],
        ("preference", "messages"): [fields.chosen, fields.rejected],
        ("preference", "sharegpt"): [fields.conversations, fields.chosen, fields.rejected],
        ("preference", "ranked"): [fields.prompt, fields.responses, fields.ranks],
        ("preference", "oasst_tree"): [fields.prompt],
        ("preference", "unpaired"): [fields.label] if fields.label else [],
        ("sft", "explicit"): prompt,
        ("sft", "alpaca"): ["instruction", "output"],
        ("sft", "messages"): [fields.messages],
        ("sft", "sharegpt"): [fields.conversations],
        ("sft", "hh"): [fields.chosen],
        ("sft", "gsm8k"): ["question", "answer"],
        ("prompt", "explicit"): prompt,
        ("prompt", "alpaca"): ["instruction"],
        ("prompt", "messages"): [fields.messages],
        ("prompt", "sharegpt"): [fields.conversations],
        ("prompt", "hh"): [fields.chosen],
        ("prompt", "gsm8k"): ["question"],
    }
    return [f.split(".")[0] for f in table.get((stage, fmt), [])]


def conversation(row: Row, field: str) -> list[Message]:
    value = row.get(field)
    if value is None:
        raise SkipRow("missing_field")
    return row.messages(field, value)
