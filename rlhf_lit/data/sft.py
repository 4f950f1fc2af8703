"""SFTDataModule: prompt/response demonstrations for supervised fine-tuning (loss on responses only)."""

from __future__ import annotations

from typing import Any, Literal

from rlhf_lit.data.base import LoaderArgs, RLHFDataModule, loader_args_doc
from rlhf_lit.data.collate import SFTCollator
from rlhf_lit.data.formats import Fields
from rlhf_lit.data.loading import DataFormatError, display_name
from rlhf_lit.data.records import SkipCounter
from rlhf_lit.data.sft_formats import sft_records
from rlhf_lit.data.tokenize import Tokenization

__all__ = ["SFTDataModule"]


@loader_args_doc("examples")
class SFTDataModule(RLHFDataModule):
    """Demonstrations ``(prompt, response)`` from one or more files, filtered and split.

    Row formats (``format="auto"`` picks one per file from its first row's keys):

    * ``explicit`` -- ``prompt``/``response`` strings (or ``prompt``/``completion``), joined with
      ``separator`` in text mode unless one side already has the whitespace.
    * ``alpaca`` -- ``instruction``, optional ``input``, ``output``.
    * ``messages`` -- a message list; the LAST assistant message is the response, the messages
      before it are the prompt (rendered with the tokenizer's chat template).
    * ``sharegpt`` -- the same from ``conversations`` of ``{"from": "human" | "gpt" | "system", "value"}``.
    * ``hh`` -- the ``chosen`` HH transcript: prompt up to and including the last
      ``"\\n\\nAssistant:"``, response after it (with its leading space).
    * ``gsm8k`` -- ``question``/``answer``.

    Without ``chat_template``, alpaca and gsm8k prompts are written in the HH transcript form
    (``"\\n\\nHuman: {question}\\n\\nAssistant:"`` + ``" {answer}"``), the same form the prompt and
    preference stages use, so one policy sees one format in every stage.

    Labelled files (KTO-style desirable / undesirable completions, a boolean ``label_field`` column) are
    refused unless ``keep_label`` says which rows to train on: SFT never trains on the undesirable side
    silently. Rows with the other label are skipped as ``filtered_by_label``.

    Each batch (see :class:`~rlhf_lit.data.collate.SFTCollator`) holds ``input_ids``,
    ``attention_mask`` (right-padded) and ``labels`` with -100 on prompt and padding and the response
    EOS kept, even when pad == EOS (docs/pitfalls.md: SFT labels), plus ``prompt_len``.

    Args:
        {LOADER_ARGS}
        format: the row format; "auto" detects it per file.
        prompt_field: field holding the prompt (explicit format); a dotted / indexed path such as
            ``instances.0.input`` reads nested rows (every ``*_field`` accepts one).
        response_field: field holding the response (explicit format; ``completion_field`` if absent).
        completion_field: field holding the completion of prompt/completion rows.
        messages_field: field holding the message list (messages format).
        conversations_field: field holding the ShareGPT message list (sharegpt format).
        prompt_template: build the prompt from several fields instead of ``prompt_field``, e.g.
            ``"{instruction}\\n\\n{input}"`` (placeholders are field paths; empty ends are stripped).
        separator: text mode: put between an explicit prompt and response that have no whitespace between
            them (default one space; ``""`` glues them).
        label_field: boolean column of KTO-style rows (true = desirable); null ignores any label column.
        keep_label: train only on rows whose label equals this (``true``: the desirable completions); null
            refuses a file that has the label column.
        chat_template: render text data as a chat with the tokenizer's chat template (plain prompts
            become one user message; HH transcripts are parsed into turns).
        max_length: the longest prompt + response in tokens.
        max_prompt_length: cut prompts to at most this many tokens first (from the left).
        min_prompt_tokens: skip an example (``response_too_long``) whose response + EOS leaves fewer
            prompt tokens than this.
        append_eos: append the tokenizer's EOS to every response that does not end with it.
    """

    stage = "sft"
    formats = ("explicit", "alpaca", "messages", "sharegpt", "hh", "gsm8k")

    def __init__(
        self,
        train_files: list[str] | str,
        val_files: list[str] | str | None = None,
        val_size: int | float = 0.05,
        max_train_samples_per_file: int | None = None,
        format: Literal["auto", "explicit", "alpaca", "messages", "sharegpt", "hh", "gsm8k"] = "auto",
        prompt_field: str = "prompt",
        response_field: str = "response",
        completion_field: str = "completion",
        messages_field: str = "messages",
        conversations_field: str = "conversations",
        prompt_template: str | None = None,
        separator: str = " ",
        label_field: str | None = "label",
        keep_label: bool | None = None,
        chat_template: bool = False,
        max_length: int = 512,
        max_prompt_length: int | None = None,
        min_prompt_tokens: int = 1,
        append_eos: bool = True,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        pad_to_multiple_of: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        fields = Fields(
            prompt=prompt_field,
            response=response_field,
            completion=completion_field,
            messages=messages_field,
            conversations=conversations_field,
            label=label_field,
            prompt_template=prompt_template,
            separator=separator,
        )
        self.keep_label = keep_label
        super().__init__(
            LoaderArgs.pick(locals()),
            format=format,
            fields=fields,
            chat_template=chat_template,
            max_length=max_length,
            max_prompt_length=max_prompt_length,
            min_prompt_tokens=min_prompt_tokens,
            append_eos=append_eos,
            tokenizer=tokenizer,
        )

    def _convert(self, rows: Any, fmt: str, source: int, where: str):
        keep = self.keep_label if self.fields.label else None
        return sft_records(rows, fmt, self.fields, self.chat_template, source, where, keep)

    def _check_file(self, rows: Any, fmt: str, path: str) -> None:
        super()._check_file(rows, fmt, path)
        columns = set(rows.column_names)
        label = self.fields.label
        if label and label.split(".")[0] in columns and self.keep_label is None:
            raise DataFormatError(
                f"{display_name(path)} has a {label!r} column (KTO-style desirable / undesirable completions); "
                "SFT would train on both: set keep_label: true to train on the label-true rows only, or "
                "label_field: null to ignore the column"
            )
        if self.keep_label is not None and label and label.split(".")[0] not in columns:
            raise DataFormatError(
                f"{display_name(path)}: keep_label is set but the file has no {label!r} column"
            )
        if (
            fmt == "explicit"
            and not {self.fields.response.split(".")[0], self.fields.completion.split(".")[0]} & columns
        ):
            raise DataFormatError(
                f"{display_name(path)}: format 'explicit' needs a {self.fields.response!r} (or "
                f"{self.fields.completion!r}) field, but the file's columns are {sorted(columns)}; set "
                "response_field"
            )

    def _tokenize(
        self, tok: Tokenization, records: list[dict], counter: SkipCounter, split: str
    ) -> list[dict]:
        return tok.sft(records, counter, split)

    def _collator(self) -> SFTCollator:
        return SFTCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)
