"""What the three DataModules share: reading files, counting skips, splitting, and building loaders.

Splits are made AFTER filtering, per file and per source ROW (every pair of a ranked row lands on
the same side), with a generator seeded from ``seed`` and the file's name, so validation never
overlaps training and is the same in every run and whatever other files are listed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rlhf_lit.data.formats import Fields, detect_format, required_fields
from rlhf_lit.data.loading import DataFormatError, display_name, is_hub_id, load_rows, source_name
from rlhf_lit.data.records import SkipCounter
from rlhf_lit.data.split import ExampleDataset, split_examples, val_count
from rlhf_lit.data.tokenize import Tokenization
from rlhf_lit.errors import ConfigError

__all__ = ["ExampleDataset", "LoaderArgs", "RLHFDataModule", "loader_args_doc", "split_examples"]

log = logging.getLogger("rlhf_lit.data")


@dataclass
class LoaderArgs:
    """The reading, splitting and batching arguments every rlhf_lit DataModule takes, validated once.

    The DataModules keep them as flat, typed ``__init__`` arguments (``data.init_args.batch_size`` in a
    config, each with its ``--help`` line) and hand them over as one object: ``LoaderArgs.pick(locals())``.
    Their documentation is written once too (:func:`loader_args_doc`).

    Raises:
        ConfigError: no train file, a batch size or ``pad_to_multiple_of`` < 1, a bad ``val_size`` or
            ``max_train_samples_per_file``.
    """

    train_files: str | Sequence[str]
    val_files: str | Sequence[str] | None
    val_size: int | float
    max_train_samples_per_file: int | None
    batch_size: int
    val_batch_size: int | None
    num_workers: int
    shuffle: bool
    seed: int
    pad_to_multiple_of: int | None

    def __post_init__(self) -> None:
        files = self.train_files
        self.train_files = [files] if isinstance(files, str) else list(files)
        files = self.val_files
        self.val_files = [files] if isinstance(files, str) else list(files) if files else None
        if not self.train_files:
            raise ConfigError("train_files is empty; give at least one file or hub id")
        for name, value in (
            ("batch_size", self.batch_size),
            ("val_batch_size", self.val_batch_size or 1),
            ("pad_to_multiple_of", self.pad_to_multiple_of or 1),
        ):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.max_train_samples_per_file is not None and self.max_train_samples_per_file < 1:
            raise ConfigError(
                f"max_train_samples_per_file must be >= 1 or None, got {self.max_train_samples_per_file}"
            )
        val_count(self.val_size, 0)  # validates the value early

    @classmethod
    def pick(cls, arguments: dict[str, Any]) -> LoaderArgs:
        """The loader arguments out of a DataModule's ``__init__`` arguments (its ``locals()``), by name."""
        return cls(**{f.name: arguments[f.name] for f in dataclass_fields(cls)})


_LOADER_ARGS_DOC = """\
train_files: training files (``.json``, ``.jsonl``, ``.gz``, ``.parquet``, ``.csv``) or hub ids
    (``":test"`` picks a split){train_files}; one string is accepted too.
val_files: validation files; when given, ``val_size`` is ignored.
val_size: held out of EACH train file after filtering: a fraction (< 1) or a row count.{val_size}
max_train_samples_per_file: keep at most this many training {unit} per file (a fixed, seeded subset);
    None keeps all.
batch_size: {unit} per training batch{batch_size}.
val_batch_size: {unit} per validation batch (default: ``batch_size``).
num_workers: DataLoader worker processes.
shuffle: shuffle the training {unit} ({order}).
seed: seeds the split, the per-file subset and the {seeded}.
pad_to_multiple_of: round the padded {padded} up to a multiple of this.
tokenizer: the tokenizer object (linked from the model by the CLI, not set in YAML)."""


def loader_args_doc(
    unit: str,
    padded: str = "length",
    order: str = "seeded with ``seed``",
    seeded: str = "shuffle",
    **extra: str,
):
    """Class decorator: writes the shared docs of :class:`LoaderArgs` (and ``tokenizer``) into the class
    docstring's ``Args:`` section, where it says ``{LOADER_ARGS}``; ``unit`` names what a batch holds
    (``examples``, ``pairs``, ``prompts``), ``extra`` adds words after ``train_files``, ``val_size`` or
    ``batch_size``. LightningCLI's ``--help`` reads the result (docstring-parser)."""

    def decorate(cls: type) -> type:
        text = _LOADER_ARGS_DOC.format(
            unit=unit,
            padded=padded,
            order=order,
            seeded=seeded,
            train_files=extra.get("train_files", ""),
            val_size=extra.get("val_size", ""),
            batch_size=extra.get("batch_size", ""),
        )
        marker = next(line for line in cls.__doc__.splitlines() if line.strip() == "{LOADER_ARGS}")
        indent = marker[: len(marker) - len(marker.lstrip())]
        cls.__doc__ = cls.__doc__.replace(marker, "\n".join(indent + line for line in text.splitlines()))
        return cls

    return decorate


class RLHFDataModule(L.LightningDataModule):
    """Base of the three DataModules; subclasses set ``stage`` and implement ``_convert``,
    ``_tokenize`` and ``_collator``. The shared arguments arrive as one :class:`LoaderArgs`; the
    stage-specific ones (format, fields, lengths) are documented by the subclasses."""

    stage: str = ""
    formats: tuple[str, ...] = ()

    def __init__(
        self,
        loader: LoaderArgs,
        *,
        format: str,
        fields: Fields,
        chat_template: bool,
        max_length: int,
        max_prompt_length: int | None,
        min_prompt_tokens: int,
        append_eos: bool,
        tokenizer: Any,
        train_part: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if train_part is not None:
            train_part = tuple(int(v) for v in train_part)
            if len(train_part) != 2 or not 0 <= train_part[0] < train_part[1]:
                raise ConfigError(f"train_part must be [i, n] with 0 <= i < n, got {list(train_part)}")
        self.train_part = train_part
        if format not in ("auto",) + self.formats:
            raise ConfigError(
                f"unknown {self.stage} format {format!r}; expected one of {('auto',) + self.formats}"
            )
        self.loader = loader
        self.train_files, self.val_files = loader.train_files, loader.val_files
        self.val_size, self.max_train_samples_per_file = loader.val_size, loader.max_train_samples_per_file
        self.batch_size, self.val_batch_size = loader.batch_size, loader.val_batch_size
        self.num_workers, self.shuffle, self.seed = loader.num_workers, loader.shuffle, loader.seed
        self.pad_to_multiple_of = loader.pad_to_multiple_of
        self.format, self.fields, self.chat_template = format, fields, chat_template
        self.max_length, self.max_prompt_length = max_length, max_prompt_length
        self.min_prompt_tokens, self.append_eos = min_prompt_tokens, append_eos
        self.tokenizer = tokenizer
        self.source_names: list[str] = []
        self._source_specs: list[str] = []
        self.skip_counter: SkipCounter | None = None
        self.train_dataset: ExampleDataset | None = None
        self.val_dataset: ExampleDataset | None = None
        self._train_generator: torch.Generator | None = None
        self._resume_generator: torch.Tensor | None = None

    # --------------------------------------------------------------------------- subclass hooks
    def _convert(self, rows: Any, fmt: str, source: int, where: str):  # pragma: no cover - abstract
        raise NotImplementedError

    def _tokenize(
        self, tok: Tokenization, records: list[dict], counter: SkipCounter, split: str
    ) -> list[dict]:
        raise NotImplementedError  # pragma: no cover - abstract

    def _collator(self) -> Callable:
        raise NotImplementedError  # pragma: no cover - abstract

    def _check_file(self, rows: Any, fmt: str, path: str) -> None:
        """One error for a file whose columns cannot hold ``fmt`` (rather than every row skipped as
        ``missing_field``): it names the fields missing and the columns found."""
        columns = set(getattr(rows, "column_names", None) or (rows[0].keys() if len(rows) else []))
        missing = [f for f in required_fields(self.stage, fmt, self.fields) if f not in columns]
        if missing:
            raise DataFormatError(
                f"{display_name(path)}: format {fmt!r} needs the field(s) {', '.join(missing)}, but the file's columns "
                f"are {sorted(columns)}; set `format` or the *_field options (e.g. prompt_field) to match the file"
            )

    def _tokenization(self) -> Tokenization:
        return Tokenization(
            self.tokenizer, self.max_length, self.max_prompt_length, self.min_prompt_tokens, self.append_eos
        )

    # --------------------------------------------------------------------------------- building
    def _source_index(self, path: str) -> int:
        name = source_name(path)
        for i, existing in enumerate(self._source_specs):
            if existing == path:
                return i
        taken = set(self.source_names)
        unique, k = name, 2
        while unique in taken:
            unique, k = f"{name}_{k}", k + 1
        self._source_specs.append(path)
        self.source_names.append(unique)
        return len(self.source_names) - 1

    def _read_file(self, path: str, split: str, counter: SkipCounter, tok: Tokenization) -> list[dict]:
        source = self._source_index(path)
        rows = load_rows(path)
        counter.add_source(split, display_name(path))
        if len(rows) == 0:
            return []
        fmt = self.format if self.format != "auto" else detect_format(self.stage, rows[0], self.fields, path)
        self._check_file(rows, fmt, path)
        records = []
        for _, item in self._convert(rows, fmt, source, path):
            counter.count_seen(split)
            if isinstance(item, str):
                counter.count_skip(split, item)
            else:
                records.append(item)
        return self._tokenize(tok, records, counter, split)

    def prepare_data(self) -> None:
        """Fetch hub datasets once (Lightning calls this on one process) so ``setup`` reads the cache."""
        for path in self.train_files + (self.val_files or []):
            if is_hub_id(path):
                load_rows(path)

    def setup(self, stage: str | None = None) -> None:
        """Read, convert, tokenise, filter and split the data (once; later calls do nothing).

        Raises:
            ValueError: if no tokenizer was given, or no training example survives filtering.
            DataFormatError: for malformed files (the message names file, row and field).
        """
        if self.train_dataset is not None:
            return
        tok = self._tokenization()
        counter = SkipCounter(max_length=self._report_length())
        self.source_names, self._source_specs = [], []
        train: list[dict] = []
        val: list[dict] = []
        for path in self.train_files:
            examples = self._read_file(path, "train", counter, tok)
            val_size = 0 if self.val_files else self.val_size
            file_train, file_val = split_examples(
                examples,
                val_size,
                self.max_train_samples_per_file,
                self.seed,
                source_name(path),
                self.train_part,
            )
            counter.count_held_out("train", len(file_val))
            counter.count_not_sampled("train", len(examples) - len(file_train) - len(file_val))
            train += file_train
            val += file_val
        counter.set_kept("train", len(train))
        if self.val_files:
            for path in self.val_files:
                val += self._read_file(path, "val", counter, tok)
            counter.set_kept("val", len(val))
        elif val:
            for path in self.train_files:
                counter.add_source("val", display_name(path))
            counter.count_seen("val", len(val))
            counter.set_kept("val", len(val), note=f"held out of the train files, seed={self.seed}")
        self.skip_counter = counter
        if not train:
            raise DataFormatError(f"no training examples left after filtering: {counter.report('train')}")
        self.train_dataset, self.val_dataset = self._finish(train), self._finish(val) if val else None
        if rank_zero_only.rank == 0:
            for split in counter.splits:
                log.info(counter.report(split))

    def _finish(self, examples: list[dict]) -> ExampleDataset:
        return ExampleDataset(examples)

    def _report_length(self) -> int | None:
        return self.max_length

    # --------------------------------------------------------------------------------- reporting
    def data_report(self) -> dict[str, str]:
        """The one-line report per split (after ``setup``), e.g. for a README or the console."""
        counter = self._require_setup().skip_counter
        return {split: counter.report(split) for split in counter.splits}

    def data_metrics(self) -> dict[str, float]:
        """``data/<split>/kept`` and ``data/<split>/skipped_<reason>`` for every split (after ``setup``).

        A LightningModule logs them once, e.g. in ``on_train_start``:
        ``self.log_dict(self.trainer.datamodule.data_metrics(), rank_zero_only=True)``.
        """
        counter = self._require_setup().skip_counter
        metrics: dict[str, float] = {}
        for split in counter.splits:
            metrics.update(counter.as_metrics(split))
        return metrics

    def _require_setup(self) -> RLHFDataModule:
        if self.skip_counter is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run yet")
        return self

    # --------------------------------------------------------------------------------- loaders
    def _loader(
        self, dataset: Dataset, batch_size: int, loader_class: type = DataLoader, **kwargs: Any
    ) -> DataLoader:
        return loader_class(
            dataset,
            batch_size=batch_size,
            collate_fn=self._collator(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        """Training batches, shuffled with a generator seeded from ``seed`` when ``shuffle``.

        Every epoch draws its order from that one generator, whose state is in :meth:`state_dict`: a run
        resumed from an end-of-epoch checkpoint draws the orders an uninterrupted run draws. Under several
        processes (the attached trainer's ``world_size`` > 1) each rank takes every ``world_size``-th row of one
        order: a ``DistributedSampler`` seeded with ``seed`` (epoch ``e``: ``randperm`` seeded ``seed + e``,
        Lightning sets the epoch) when ``shuffle``, the file order otherwise. Lightning keeps that sampler;
        it would otherwise put in its own, shuffled whatever ``shuffle`` says and seeded by ``seed_everything``.
        """
        self._require_setup()
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.world_size > 1:
            sampler = DistributedSampler(
                self.train_dataset, trainer.world_size, trainer.global_rank, shuffle=self.shuffle, seed=self.seed
            )
            return self._loader(self.train_dataset, self.batch_size, sampler=sampler)
        self._train_generator = torch.Generator().manual_seed(self.seed)
        if self._resume_generator is not None:
            self._train_generator.set_state(self._resume_generator)
            self._resume_generator = None
        return self._loader(
            self.train_dataset, self.batch_size, shuffle=self.shuffle, generator=self._train_generator
        )

    # ------------------------------------------------------------------------------ resumption
    def state_dict(self) -> dict[str, Any]:
        """``{"train_generator": (5056,) uint8 tensor}``: the state of the training order's generator after
        the epochs drawn so far (``{}`` before the first training loader). Lightning saves it in checkpoints.
        """
        if self._train_generator is None:
            return {}
        return {"train_generator": self._train_generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training order: the next epoch draws what the saved run's next epoch drew.

        Exact from an end-of-epoch checkpoint (Lightning's ``ModelCheckpoint`` default); a mid-epoch
        checkpoint restarts its epoch on the next order (docs/resume.md). Ignored outside ``fit``.
        """
        state = state_dict.get("train_generator")
        trainer = getattr(self, "trainer", None)
        if state is None or (trainer is not None and trainer.state.fn not in (None, "fit")):
            return
        if self._train_generator is not None:
            self._train_generator.set_state(state)
        else:
            self._resume_generator = state

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in file order (an empty list when there is no validation split)."""
        self._require_setup()
        if self.val_dataset is None:
            return []
        return self._loader(self.val_dataset, self.val_batch_size or self.batch_size, shuffle=False)
