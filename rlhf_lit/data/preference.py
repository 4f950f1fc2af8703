"""PreferenceDataModule: human preference pairs for the reward model (Bradley-Terry) stage."""

from __future__ import annotations

from typing import Any, Literal

from rlhf_lit.data.base import ExampleDataset, LoaderArgs, RLHFDataModule, loader_args_doc
from rlhf_lit.data.collate import PreferenceCollator, UnpairedCollator
from rlhf_lit.data.formats import Fields
from rlhf_lit.data.loading import DataFormatError, display_name
from rlhf_lit.data.preference_formats import preference_records
from rlhf_lit.data.records import SkipCounter
from rlhf_lit.data.tokenize import Tokenization

__all__ = ["PreferenceDataModule"]


@loader_args_doc("pairs", padded="length T", train_files=' such as ``"Anthropic/hh-rlhf"``')
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
    * ``sharegpt`` -- ``conversations`` of ``{"from": "human" | "gpt" | "system", "value"}`` messages (the
      prompt) plus ``chosen`` / ``rejected`` messages, as in LLaMA-Factory's DPO data.
    * ``ranked`` -- ``prompt``, ``responses`` (K strings) and ``ranks`` (K numbers, LOWER rank is
      BETTER, 1 = best): every untied pair is an example; a tie gives none (``tied_ranks``); a row with a
      null rank or fewer than 2 responses is skipped (``null_rank``, ``too_few_responses``).
    * ``oasst_tree`` -- Open-Assistant message trees (``prompt`` is the root message with ``replies``):
      every prompter message with assistant replies becomes a ranked list of those replies.
    * ``unpaired`` -- KTO-style ``prompt`` + ``completion`` + boolean ``label`` (or ``messages`` ending in the
      completion + ``label``): carried as unpaired completions (batches of
      :class:`~rlhf_lit.data.collate.UnpairedCollator`, for an unpaired objective), or, with
      ``pair_unpaired``, paired: each desirable completion of a prompt with each undesirable one.

    Each batch (see :class:`~rlhf_lit.data.collate.PreferenceCollator`) holds ``chosen_input_ids``,
    ``chosen_attention_mask``, ``rejected_input_ids``, ``rejected_attention_mask`` right-padded to one
    common length T, ``chosen_labels`` (-100 on prompt and padding), ``margin``, ``source`` (index into
    :attr:`source_names`), ``chosen_response_len``, ``rejected_response_len`` and ``prompt_len``.

    Prompts are cut from the LEFT so the longer response fits ``max_length`` whole; pairs that are
    token-identical afterwards, empty sides and the other skip reasons are counted, logged to the
    ``rlhf_lit.data`` logger, and available as :meth:`data_metrics` (docs/pitfalls.md: degenerate pairs).

    Args:
        {LOADER_ARGS}
        train_part: ``[i, n]``: train on part ``i`` (0-based) of ``n`` disjoint, equal parts of each file's
            training rows (its seeded order cut in n), with the same validation rows for every part, e.g.
            ``[0, 2]`` and ``[1, 2]`` for two reward models on disjoint halves; None: all.
        format: the row format; "auto" detects it per file.
        prompt_field: field holding the prompt (explicit, messages, ranked and unpaired formats); a dotted /
            indexed path such as ``instances.0.input`` reads nested rows (every ``*_field`` accepts one).
        chosen_field: field holding the preferred response (or transcript, for hh).
        rejected_field: field holding the dispreferred response (or transcript, for hh).
        responses_field: field holding the K responses of a ranked row.
        ranks_field: field holding the K ranks of a ranked row (lower = better).
        margin_field: optional field with a per-pair margin (a number; for ranked rows a number or a
            list of K scores, the margin being their absolute difference). Missing margins are 0.0.
        conversations_field: field holding the ShareGPT prompt messages (sharegpt format).
        messages_field: field holding the message list of unpaired rows in messages form.
        completion_field: field holding an unpaired row's completion.
        label_field: field holding an unpaired row's boolean label (true = desirable).
        pair_unpaired: build pairs from unpaired rows (desirable x undesirable completions of the same
            prompt) for a pairwise reward model; otherwise unpaired rows stay unpaired.
        weight_ranked_pairs: give each pair of a ranked row of K responses the weight 1 / C(K, 2) in the
            reward loss (batch key ``pair_weight``), so every prompt counts once however many responses it
            ranks (Ouyang et al. 2022, eq. 1); other pairs weigh 1.
        prompt_template: build the prompt from several fields instead of ``prompt_field``, e.g.
            ``"{instruction}\\n\\n{input}"`` (placeholders are field paths; empty ends are stripped).
        separator: text mode: put between an explicit prompt and a response that have no whitespace between
            them (default one space; ``""`` glues them).
        chat_template: render text data as a chat with the tokenizer's chat template: HH transcripts
            are parsed into user/assistant turns, plain prompts become one user message (this is the
            switch for chat models such as SmolLM2; message data is always rendered).
        max_length: the longest prompt + response in tokens.
        max_prompt_length: cut prompts to at most this many tokens first (from the left).
        min_prompt_tokens: skip a pair (``response_too_long``) whose longer response + EOS leaves fewer
            prompt tokens than this.
        append_eos: append the tokenizer's EOS to every response that does not end with it.
    """

    stage = "preference"
    formats = ("hh", "explicit", "messages", "sharegpt", "ranked", "oasst_tree", "unpaired")

    def __init__(
        self,
        train_files: list[str] | str,
        val_files: list[str] | str | None = None,
        val_size: int | float = 0.05,
        max_train_samples_per_file: int | None = None,
        train_part: tuple[int, int] | None = None,
        format: Literal[
            "auto", "hh", "explicit", "messages", "sharegpt", "ranked", "oasst_tree", "unpaired"
        ] = "auto",
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        responses_field: str = "responses",
        ranks_field: str = "ranks",
        margin_field: str | None = None,
        conversations_field: str = "conversations",
        messages_field: str = "messages",
        completion_field: str = "completion",
        label_field: str = "label",
        pair_unpaired: bool = False,
        weight_ranked_pairs: bool = False,
        prompt_template: str | None = None,
        separator: str = " ",
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
            chosen=chosen_field,
            rejected=rejected_field,
            responses=responses_field,
            ranks=ranks_field,
            margin=margin_field,
            conversations=conversations_field,
            messages=messages_field,
            completion=completion_field,
            label=label_field,
            prompt_template=prompt_template,
            separator=separator,
        )
        self.pair_unpaired, self.weight_ranked_pairs = pair_unpaired, weight_ranked_pairs
        self.unpaired = False  # set by setup(): the examples are unpaired completions, not pairs
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
            train_part=train_part,
        )

    def _convert(self, rows: Any, fmt: str, source: int, where: str):
        return preference_records(
            rows,
            fmt,
            self.fields,
            self.chat_template,
            source,
            where,
            self.pair_unpaired,
            self.weight_ranked_pairs,
        )

    def _check_file(self, rows: Any, fmt: str, path: str) -> None:
        super()._check_file(rows, fmt, path)
        columns = set(rows.column_names)
        if (
            fmt == "unpaired"
            and not {self.fields.completion.split(".")[0], self.fields.messages.split(".")[0]} & columns
        ):
            raise DataFormatError(
                f"{display_name(path)}: format 'unpaired' needs a {self.fields.completion!r} (with "
                f"{self.fields.prompt!r}) or a {self.fields.messages!r} field, but the file's columns are "
                f"{sorted(columns)}; set completion_field / messages_field"
            )

    def _tokenize(
        self, tok: Tokenization, records: list[dict], counter: SkipCounter, split: str
    ) -> list[dict]:
        unpaired = [r for r in records if "label" in r]
        pairs = [r for r in records if "label" not in r]
        return tok.preference(pairs, counter, split) + tok.sft(unpaired, counter, split)

    def _finish(self, examples: list[dict]) -> ExampleDataset:
        kinds = {"label" in e for e in examples}
        if len(kinds) > 1:
            unpaired = sorted({self.source_names[e["source"]] for e in examples if "label" in e})
            raise DataFormatError(
                f"{', '.join(unpaired)}: unpaired (KTO-style) rows cannot be mixed with preference pairs from the "
                "other files; set pair_unpaired: true to build pairs from them"
            )
        self.unpaired = kinds == {True}
        return ExampleDataset(examples)

    def _collator(self) -> PreferenceCollator | UnpairedCollator:
        if self.unpaired:
            return UnpairedCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)
        return PreferenceCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of)
