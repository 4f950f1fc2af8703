"""Canonical records, skip counting, and the Anthropic HH transcript helpers.

Canonical records (text level, before tokenisation) are plain dicts:

* preference: ``{"prompt", "chosen", "rejected", "margin": float | None, "source": int, "row": int}``
* SFT: ``{"prompt", "response", "source", "row"}``
* prompts: ``{"prompt", "reference": str | None, "source", "row"}``

``prompt`` is a string, or for chat data a list of ``{"role", "content"}`` messages; the responses are
then single assistant messages (dicts) that the tokenisation step renders with the tokenizer's chat
template. ``source`` indexes the DataModule's ``source_names`` (one per input file); ``row`` is the
0-based row in that file, so a split can keep every pair of one row on the same side.

Leading-space convention (the same in every stage): an HH prompt ends with ``"\\n\\nAssistant:"`` and
the response keeps the leading space the data has (``" Sure, ..."``), so prompt + response is the
original transcript. Prompts we build from other formats (GSM8K, Alpaca) use the same transcript form,
``"\\n\\nHuman: {text}\\n\\nAssistant:"`` + ``" {response}"``. In chat mode contents are stripped and
the template supplies the separators.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

__all__ = [
    "ASSISTANT_MARK",
    "HUMAN_MARK",
    "SKIP_REASONS",
    "SkipCounter",
    "as_hh_prompt",
    "gsm8k_reference",
    "looks_like_hh",
    "hh_first_turn_prompt",
    "parse_hh_messages",
    "split_hh_pair",
    "split_hh_transcript",
]

HUMAN_MARK = "\n\nHuman:"
ASSISTANT_MARK = "\n\nAssistant:"

SKIP_REASONS = (
    "missing_field",  # a required field is absent or null
    "empty_prompt",  # the prompt is empty or whitespace only
    "empty_response",  # SFT: the response is empty or whitespace only (or no assistant message)
    "empty_chosen",
    "empty_rejected",
    "identical_pair",  # chosen == rejected, as text or as token ids after truncation
    "no_shared_prefix",  # HH: the transcripts share no "\n\nAssistant:"; chat: different contexts
    "response_too_long",  # response + EOS does not fit max_length with min_prompt_tokens of prompt
    "tied_ranks",  # ranked lists: a tied pair gives no preference pair
    "null_rank",  # ranked lists / message trees: a candidate without a rank (the whole list is skipped)
    "non_finite_rank",  # ranked lists / message trees: a rank is nan or inf (no consistent order: whole list)
    "non_finite_margin",  # a margin or score (margin_field) is nan or inf (a ranked list: the whole list)
    "too_few_responses",  # ranked lists / message trees: fewer than 2 candidates to compare
    "multi_turn_response",  # HH: a response holds a further "Human:" turn, so it is not one reply
    "unknown_role",  # ShareGPT / messages: a role other than user / assistant / system (e.g. a tool call)
    "filtered_by_label",  # SFT with keep_label: the row's label is not the one kept
    "no_opposite_label",  # unpaired -> pairs: no completion of the other label for the same prompt
    "no_response_boundary",  # the chat template's prompt rendering is not a prefix of the full one
)


@dataclass
class _SplitCounts:
    seen: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    held_out: int = 0
    not_sampled: int = 0
    sources: list[str] = field(default_factory=list)
    note: str = ""


class SkipCounter:
    """Counts rows kept and skipped (by reason) per split, and writes the report users read.

    A "row" is one candidate example: a ranked list of K responses counts as its K(K-1)/2 pairs.

    Args:
        max_length: shown at the end of every report, since most skips depend on it.
    """

    def __init__(self, max_length: int | None = None) -> None:
        self.max_length = max_length
        self._splits: dict[str, _SplitCounts] = {}

    def _get(self, split: str) -> _SplitCounts:
        return self._splits.setdefault(split, _SplitCounts())

    @property
    def splits(self) -> list[str]:
        """The splits counted so far, in the order they were first seen."""
        return list(self._splits)

    def add_source(self, split: str, name: str) -> None:
        """Record that ``split`` reads from ``name`` (a file name or hub id)."""
        sources = self._get(split).sources
        if name not in sources:
            sources.append(name)

    def count_seen(self, split: str, n: int = 1) -> None:
        """Count ``n`` candidate rows read for ``split``."""
        self._get(split).seen += n

    def count_skip(self, split: str, reason: str, n: int = 1) -> None:
        """Count ``n`` rows of ``split`` skipped for ``reason`` (one of ``SKIP_REASONS``).

        Raises:
            ValueError: if ``reason`` is not one of ``SKIP_REASONS``.
        """
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; expected one of {SKIP_REASONS}")
        self._get(split).skipped[reason] += n

    def count_truncated(self, split: str, n: int = 1) -> None:
        """Count ``n`` prompts of ``split`` cut from the left (kept, not skipped)."""
        self._get(split).truncated += n

    def count_held_out(self, split: str, n: int) -> None:
        """Count ``n`` kept rows of ``split`` moved to the validation split."""
        self._get(split).held_out += n

    def count_not_sampled(self, split: str, n: int) -> None:
        """Count ``n`` kept rows of ``split`` left out by a per-file sample limit."""
        self._get(split).not_sampled += n

    def set_kept(self, split: str, n: int, note: str = "") -> None:
        """Set the number of rows that ``split`` finally holds (and an optional note for the report)."""
        counts = self._get(split)
        counts.kept = n
        counts.note = note

    def kept(self, split: str) -> int:
        """Rows that ``split`` holds."""
        return self._get(split).kept

    def skipped(self, split: str) -> dict[str, int]:
        """Skipped rows of ``split`` by reason (only reasons that occurred)."""
        return dict(self._get(split).skipped)

    def truncated(self, split: str) -> int:
        """Prompts of ``split`` that were cut from the left."""
        return self._get(split).truncated

    def report(self, split: str) -> str:
        """One line, e.g. ``"train: kept 998 of 1000 rows from hh.jsonl.gz; skipped 2: empty_chosen=1,
        identical_pair=1 (max_length=8)"``."""
        c = self._get(split)
        seen = max(c.seen, c.kept)
        line = f"{split}: kept {c.kept} of {seen} rows"
        if c.sources:
            line += f" from {', '.join(c.sources)}"
        if c.note:
            line += f" ({c.note})"
        total_skipped = sum(c.skipped.values())
        if total_skipped:
            reasons = ", ".join(f"{r}={c.skipped[r]}" for r in SKIP_REASONS if c.skipped[r])
            line += f"; skipped {total_skipped}: {reasons}"
        if c.held_out:
            line += f"; held out {c.held_out} for val"
        if c.not_sampled:
            line += f"; not sampled {c.not_sampled}"
        if c.truncated:
            line += f"; left-truncated {c.truncated} prompts"
        if self.max_length is not None:
            line += f" (max_length={self.max_length})"
        return line

    def as_metrics(self, split: str) -> dict[str, float]:
        """``data/<split>/kept``, ``data/<split>/skipped_<reason>`` (reasons that occurred) and
        ``data/<split>/truncated`` (when any prompt was cut), as floats for ``log_dict``."""
        c = self._get(split)
        metrics = {f"data/{split}/kept": float(c.kept)}
        for reason in SKIP_REASONS:
            if c.skipped[reason]:
                metrics[f"data/{split}/skipped_{reason}"] = float(c.skipped[reason])
        if c.truncated:
            metrics[f"data/{split}/truncated"] = float(c.truncated)
        return metrics


def split_hh_pair(chosen: str, rejected: str) -> tuple[str, str, str] | None:
    """Split two HH transcripts into ``(prompt, chosen_response, rejected_response)``.

    The prompt is the longest shared prefix that ends with (and includes) a ``"\\n\\nAssistant:"``;
    responses are the rest, with their leading space. Returns None if no such prefix exists.
    """
    limit = min(len(chosen), len(rejected))
    shared = 0
    while shared < limit and chosen[shared] == rejected[shared]:
        shared += 1
    start = chosen.rfind(ASSISTANT_MARK, 0, shared)
    if start < 0:
        return None
    end = start + len(ASSISTANT_MARK)
    return chosen[:end], chosen[end:], rejected[end:]


def split_hh_transcript(text: str) -> tuple[str, str] | None:
    """Split one HH transcript at its LAST ``"\\n\\nAssistant:"`` into ``(prompt, response)``."""
    start = text.rfind(ASSISTANT_MARK)
    if start < 0:
        return None
    end = start + len(ASSISTANT_MARK)
    return text[:end], text[end:]


def hh_first_turn_prompt(text: str) -> str | None:
    """The transcript up to and including its FIRST ``"\\n\\nAssistant:"`` (the first human turn)."""
    start = text.find(ASSISTANT_MARK)
    return None if start < 0 else text[: start + len(ASSISTANT_MARK)]


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def parse_hh_messages(text: str) -> list[dict[str, str]]:
    """Parse an HH transcript into ``user``/``assistant`` messages (contents stripped).

    A trailing empty assistant turn (a prompt ending in ``"\\n\\nAssistant:"``) is dropped; text before
    the first marker, if any, becomes a user message.
    """
    pieces = _HH_TURN.split(text)
    messages = [{"role": "user", "content": pieces[0].strip()}] if pieces[0].strip() else []
    for role, content in zip(pieces[1::2], pieces[2::2]):
        messages.append({"role": "user" if role == "Human" else "assistant", "content": content.strip()})
    if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


_HH_START = re.compile(r"\s*Human:")


def looks_like_hh(text: str) -> bool:
    """True for text already in the HH transcript form: it opens with ``Human:`` (after whitespace) and holds
    an ``"\\n\\nAssistant:"`` turn. Such prompts are parsed into turns, never wrapped a second time."""
    return bool(_HH_START.match(text)) and ASSISTANT_MARK in text


def as_hh_prompt(text: str) -> str:
    """Wrap a plain request in the HH transcript form: ``"\\n\\nHuman: {text}\\n\\nAssistant:"`` (text already
    in that form is returned as it is)."""
    if looks_like_hh(text):
        return text
    return f"{HUMAN_MARK} {text.strip()}{ASSISTANT_MARK}"


def gsm8k_reference(answer: str) -> str | None:
    """The final answer after ``"####"`` in a GSM8K solution, without thousands separators."""
    if "####" not in answer:
        return None
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return final or None
