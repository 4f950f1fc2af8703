"""PromptDataModule: prompts for PPO rollouts, left-padded, in an exactly resumable order.

Resumption (a resumed PPO run must see the prompts an uninterrupted run sees): the training order
of epoch ``e`` is ``randperm(seed + e)`` (see :class:`~rlhf_lit.data.sampler.ResumableSampler`).
:meth:`PromptDataModule.state_dict` records how many training batches the whole run has consumed;
:meth:`PromptDataModule.load_state_dict` makes the next training pass continue right after them.

* Under ``Trainer.fit`` the PPO module has NOTHING to call: Lightning calls the sampler's
  ``set_epoch`` at each epoch start, ``datamodule.state_dict()`` when it saves a checkpoint and
  ``datamodule.load_state_dict()`` when it restores one, and the consumed count is read from the fit
  loop's batch progress (batches whose ``training_step`` finished, however many PPO updates each did),
  so a checkpoint written by ``ModelCheckpoint`` mid-epoch and one written by ``trainer.save_checkpoint``
  after a ``max_steps`` stop resume alike.
  The PPO module must take exactly one prompt batch per ``training_step`` from the ``batch`` argument.
* A loop that draws batches itself (outside ``Trainer.fit``) calls ``datamodule.set_epoch(e)`` at
  each epoch start and ``datamodule.mark_consumed()`` after using each batch.
"""

from __future__ import annotations

from typing import Any, Literal

from torch.utils.data import DataLoader

from rlhf_lit.data.base import ExampleDataset, LoaderArgs, RLHFDataModule, loader_args_doc
from rlhf_lit.data.collate import PromptCollator
from rlhf_lit.data.formats import Fields
from rlhf_lit.data.prompt_formats import prompt_records
from rlhf_lit.data.records import SkipCounter
from rlhf_lit.data.sampler import ResumableSampler
from rlhf_lit.data.tokenize import Tokenization
from rlhf_lit.errors import ConfigError

__all__ = ["PromptDataModule"]

_NO_LIMIT = 1 << 30


class _PromptLoader(DataLoader):
    """Tells Lightning the loader resumes exactly (no "not resumable" warning); the state itself is
    :meth:`PromptDataModule.state_dict`, so this loader's own state is empty."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


@loader_args_doc(
    "prompts",
    padded="width P",
    order="order = ``randperm(seed + epoch)``",
    seeded="order",
    val_size="\n    Default 0: PPO (the stage these prompts feed) never validates, so nothing is held out unless\n    asked for.",
    batch_size=", i.e. per rollout (per rank)",
)
class PromptDataModule(RLHFDataModule):
    """Prompts (and optional references) for rollouts, from one or more files, filtered and split.

    Row formats (``format="auto"`` picks one per file from its first row's keys):

    * ``explicit`` -- a ``prompt`` string field (files of bare JSON strings are read as ``prompt``);
      optional ``reference_field``.
    * ``alpaca`` -- ``instruction`` and optional ``input``, in the HH transcript form (as in SFT).
    * ``messages`` -- a message list rendered with the chat template and the generation prompt (a
      trailing assistant message is dropped, so SFT conversations can be reused).
    * ``sharegpt`` -- the same from ``conversations`` of ``{"from", "value"}`` messages.
    * ``hh`` -- the prompt part of the ``chosen`` transcript: up to and including the LAST
      ``"\\n\\nAssistant:"`` (or the FIRST, with ``hh_first_turn_only``).
    * ``gsm8k`` -- ``question``, in the HH transcript form ``"\\n\\nHuman: ...\\n\\nAssistant:"``; the
      reference is the final number after ``"####"`` in ``answer``.

    Prompts longer than ``max_prompt_length`` are cut from the LEFT and counted as ``truncated`` (not
    skipped); empty prompts are skipped (``empty_prompt``).

    Each batch (see :class:`~rlhf_lit.data.collate.PromptCollator`) holds ``input_ids`` and
    ``attention_mask`` (B, P) LEFT-padded, ``prompt_index`` (B,) (row in the split), ``reference``
    and ``prompt_text`` (lists), and ``prompt`` (the records' prompts before rendering: strings or message
    lists). Training batches are whole (``drop_last``).

    Args:
        {LOADER_ARGS}
        format: the row format; "auto" detects it per file.
        prompt_field: field holding the prompt (explicit format); a dotted / indexed path such as
            ``instances.0.input`` reads nested rows.
        prompt_template: build the prompt from several fields instead of ``prompt_field``, e.g.
            ``"{instruction}\\n\\n{instances.0.input}"`` for self-instruct seed tasks (placeholders are field
            paths; empty ends are stripped).
        messages_field: field holding the message list (messages format).
        conversations_field: field holding the ShareGPT message list (sharegpt format).
        reference_field: optional field holding a reference answer (explicit format).
        hh_first_turn_only: for hh, keep only the first human turn (as the shared benchmark does).
        chat_template: render plain prompts as one user message (HH prompts as their turns) with the
            tokenizer's chat template and generation prompt.
        max_prompt_length: cut prompts to at most this many tokens, from the left (default:
            ``pad_to_length``; None and no ``pad_to_length``: no limit).
        pad_to_length: pad every batch to exactly this width P (e.g. 64 for the shared benchmark).
    """

    stage = "prompt"
    formats = ("explicit", "alpaca", "messages", "sharegpt", "hh", "gsm8k")

    def __init__(
        self,
        train_files: list[str] | str,
        val_files: list[str] | str | None = None,
        val_size: int | float = 0,
        max_train_samples_per_file: int | None = None,
        format: Literal["auto", "explicit", "alpaca", "messages", "sharegpt", "hh", "gsm8k"] = "auto",
        prompt_field: str = "prompt",
        prompt_template: str | None = None,
        messages_field: str = "messages",
        conversations_field: str = "conversations",
        reference_field: str | None = None,
        hh_first_turn_only: bool = False,
        chat_template: bool = False,
        max_prompt_length: int | None = None,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        pad_to_multiple_of: int | None = None,
        pad_to_length: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        if pad_to_length is not None and max_prompt_length is not None and max_prompt_length > pad_to_length:
            raise ValueError(f"max_prompt_length ({max_prompt_length}) > pad_to_length ({pad_to_length})")
        limit = max_prompt_length if max_prompt_length is not None else pad_to_length
        fields = Fields(
            prompt=prompt_field,
            messages=messages_field,
            reference=reference_field,
            conversations=conversations_field,
            prompt_template=prompt_template,
        )
        super().__init__(
            LoaderArgs.pick(locals()),
            format=format,
            fields=fields,
            chat_template=chat_template,
            max_length=limit or _NO_LIMIT,
            max_prompt_length=limit,
            min_prompt_tokens=1,
            append_eos=False,
            tokenizer=tokenizer,
        )
        self.hh_first_turn_only, self.pad_to_length = hh_first_turn_only, pad_to_length
        self._epoch = 0
        self._manual_consumed = 0
        self._resume: int | None = None
        self._sampler: ResumableSampler | None = None

    def _convert(self, rows: Any, fmt: str, source: int, where: str):
        return prompt_records(
            rows, fmt, self.fields, self.chat_template, source, where, self.hh_first_turn_only
        )

    def _tokenize(
        self, tok: Tokenization, records: list[dict], counter: SkipCounter, split: str
    ) -> list[dict]:
        return tok.prompts(records, counter, split)

    def _collator(self) -> PromptCollator:
        return PromptCollator(self.tokenizer.pad_token_id, self.pad_to_multiple_of, self.pad_to_length)

    def _finish(self, examples: list[dict]) -> ExampleDataset:
        for index, example in enumerate(examples):
            example["prompt_index"] = index
        return ExampleDataset(examples)

    def _report_length(self) -> int | None:
        return None

    # ------------------------------------------------------------------------------- loaders
    def train_dataloader(self) -> DataLoader:
        """Whole batches of prompts in the resumable seeded order (``drop_last=True``)."""
        self._require_setup()
        sampler = ResumableSampler(self.train_dataset, self.batch_size, self.seed, self.shuffle)
        sampler.set_epoch(self._epoch)
        if self._resume is not None:
            sampler.resume_at(self._resume)
            self._resume = None
        self._sampler = sampler
        return self._loader(
            self.train_dataset, self.batch_size, _PromptLoader, sampler=sampler, drop_last=True
        )

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` in a loop outside ``Trainer.fit`` (Lightning calls the sampler's own)."""
        if epoch != self._epoch:
            self._manual_consumed = 0
        self._epoch = epoch
        if self._sampler is not None:
            self._sampler.set_epoch(epoch)

    def mark_consumed(self, num_batches: int = 1) -> None:
        """Record that a loop outside ``Trainer.fit`` used ``num_batches`` more training batches."""
        self._manual_consumed += num_batches

    # ------------------------------------------------------------------------------- resumption
    def _under_fit(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return trainer is not None and trainer.state.fn == "fit"

    def _batches_per_epoch(self) -> int:
        return len(self.train_dataset) // self.batch_size if self.train_dataset is not None else -1

    def state_dict(self) -> dict[str, int]:
        """``{"batches_consumed_total", "seed", "batch_size", "num_train_prompts"}`` of the training order.

        Under ``Trainer.fit`` the count is the fit loop's training batches processed over the whole run;
        otherwise ``epoch * batches_per_epoch`` plus the count given to :meth:`mark_consumed` since the
        last :meth:`set_epoch`.
        """
        if self._under_fit():
            consumed = self.trainer.fit_loop.epoch_loop.batch_progress.total.processed
        else:
            consumed = self._epoch * max(self._batches_per_epoch(), 0) + self._manual_consumed
        size = len(self.train_dataset) if self.train_dataset is not None else -1
        return {
            "batches_consumed_total": int(consumed),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_train_prompts": size,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume: the next training pass continues the order after the saved number of batches.

        Raises:
            ConfigError: if seed, batch size or the number of training prompts differ from the saved
                run (the order could not be reproduced).
        """
        if not state_dict:
            return
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.state.fn not in (None, "fit"):
            return  # validate / test / predict from a checkpoint: there is no training order to resume
        for key, mine in (
            ("seed", self.seed),
            ("batch_size", self.batch_size),
            ("num_train_prompts", len(self.train_dataset) if self.train_dataset is not None else -1),
        ):
            saved = state_dict.get(key)
            if saved is not None and mine != -1 and saved != -1 and saved != mine:
                raise ConfigError(
                    f"cannot resume the prompt order exactly: {key} was {saved} in the checkpoint but is {mine} "
                    "now; resume with the data settings (files, val_size, batch_size, seed) of the interrupted run"
                )
        consumed = int(state_dict["batches_consumed_total"])
        per_epoch = self._batches_per_epoch()
        if per_epoch > 0:
            self._epoch, self._manual_consumed = divmod(consumed, per_epoch)
        self._resume = consumed
        if self._sampler is not None:
            self._sampler.resume_at(consumed)
            self._resume = None
