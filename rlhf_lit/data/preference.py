"""PreferenceDataModule: human preference pairs for the reward model (Bradley-Terry) stage."""

from __future__ import annotations

from typing import Any, Literal

from rlhf_lit.data.base import RLHFDataModule
from rlhf_lit.data.collate import PreferenceCollator
from rlhf_lit.data.formats import Fields
from rlhf_lit.data.preference_formats import preference_records
from rlhf_lit.data.records import SkipCounter
from rlhf_lit.data.tokenize import Tokenization

__all__ = ["PreferenceDataModule"]


class PreferenceDataModule(RLHFDataModule):
    """Preference pairs ``(prompt, chosen, rejected)`` from one or more files, filtered and split.

    Row formats (``format="auto"`` picks one per file from its first row's keys):

    * ``hh`` -- Anthropic HH-RLHF: ``chosen``/``rejected`` full transcripts. The prompt is the longest
      shared prefix ending with ``"\\n\\nAssistant:"``; the responses keep their leading space.
    * ``explicit`` -- ``prompt``/``chosen``/``rejected`` strings, used as given (put any separator in
      the data).
    * ``messages`` -- ``chosen``/``rejected`` message lists sharing every message but the last
      (assistant) one; or ``prompt`` (string or messages) plus string / one-message responses.
      Rendered with the tokenizer's chat template.
    * ``ranked`` -- ``prompt``, ``responses`` (K strings) and ``ranks`` (K numbers, LOWER rank is
      BETTER, 1 = best): every untied pair is an example; a tie gives none (``tied_ranks``).

    Each batch (see :class:`~rlhf_lit.data.collate.PreferenceCollator`) holds ``chosen_input_ids``,
    ``chosen_attention_mask``, ``rejected_input_ids``, ``rejected_attention_mask`` right-padded to one
    common length T, ``chosen_labels`` (-100 on prompt and padding), ``margin``, ``source`` (index into
    :attr:`source_names`), ``chosen_response_len``, ``rejected_response_len`` and ``prompt_len``.

    Prompts are cut from the LEFT so the longer response fits ``max_length`` whole; pairs that are
    token-identical afterwards, empty sides and the other skip reasons are counted, logged to the
    ``rlhf_lit.data`` logger, and available as :meth:`data_metrics` (PITFALLS B02).

    Args:
        train_files: training files (``.json``, ``.jsonl``, ``.gz``, ``.parquet``, ``.csv``) or hub
            ids (``"Anthropic/hh-rlhf"``, ``":test"`` picks a split); one string is accepted too.
        val_files: validation files; when given, ``val_size`` is ignored.
        val_size: held out of EACH train file after filtering: a fraction (< 1) or a row count.
        max_train_samples_per_file: keep at most this many training rows per file (a fixed, seeded
            subset); None keeps all.
        train_part: ``[i, n]``: train on part ``i`` (0-based) of ``n`` disjoint, equal parts of each file's
            training rows (its seeded order cut in n), with the same validation rows for every part, e.g.
            ``[0, 2]`` and ``[1, 2]`` for two reward models on disjoint halves; None: all.
        format: the row format; "auto" detects it per file.
        prompt_field: field holding the prompt (explicit, messages and ranked formats).
        chosen_field: field holding the preferred response (or transcript, for hh).
        rejected_field: field holding the dispreferred response (or transcript, for hh).
        responses_field: field holding the K responses of a ranked row.
        ranks_field: field holding the K ranks of a ranked row (lower = better).
        margin_field: optional field with a per-pair margin (a number; for ranked rows a number or a
            list of K scores, the margin being their absolute difference). Missing margins are 0.0.
        chat_template: render text data as a chat with the tokenizer's chat template: HH transcripts
            are parsed into user/assistant turns, plain prompts become one user message (this is the
            switch for chat models such as SmolLM2; message data is always rendered).
        max_length: the longest prompt + response in tokens.
        max_prompt_length: cut prompts to at most this many tokens first (from the left).
        min_prompt_tokens: skip a pair (``response_too_long``) whose longer response + EOS leaves fewer
            prompt tokens than this.
        append_eos: append the tokenizer's EOS to every response that does not end with it.
        batch_size: pairs per training batch.
        val_batch_size: pairs per validation batch (default: ``batch_size``).
        num_workers: DataLoader worker processes.
        shuffle: shuffle the training pairs (seeded with ``seed``).
        seed: seeds the split, the per-file subset and the shuffle.
        pad_to_multiple_of: round the padded length T up to a multiple of this.
        tokenizer: the tokenizer object (linked from the model by the CLI, not set in YAML).
    """

    stage = "preference"
    formats = ("hh", "explicit", "messages", "ranked")

    def __init__(
        self,
        train_files: list[str] | str,
        val_files: list[str] | str | None = None,
        val_size: int | float = 0.05,
        max_train_samples_per_file: int | None = None,
        train_part: tuple[int, int] | None = None,
        format: Literal["auto", "hh", "explicit", "messages", "ranked"] = "auto",
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        responses_field: str = "responses",
        ranks_field: str = "ranks",
        margin_field: str | None = None,
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
        fields = Fields(prompt=prompt_field, chosen=chosen_field, rejected=rejected_field,
                        responses=responses_field, ranks=ranks_field, margin=margin_field)
        super().__init__(
            train_files=train_files, val_files=val_files, val_size=val_size,
            max_train_samples_per_file=max_train_samples_per_file, format=format, fields=fields,
            chat_template=chat_template, max_length=max_length, max_prompt_length=max_prompt_length,
            min_prompt_tokens=min_prompt_tokens, append_eos=append_eos, batch_size=batch_size,
            val_batch_size=val_batch_size, num_workers=num_workers, shuffle=shuffle, seed=seed,
            pad_to_multiple_of=pad_to_multiple_of, tokenizer=tokenizer, train_part=train_part,
        )

    def _convert(self, rows: Any, fmt: str, source: int, where: str):
        return preference_records(rows, fmt, self.fields, self.chat_template, source, where)

    def _tokenize(self, tok: Tokenization, records: list[dict], counter: SkipCounter, split: str) -> list[dict]:
        return tok.preference(records, counter, split)

    def _collator(self) -> PreferenceCollator:
        return PreferenceCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)
