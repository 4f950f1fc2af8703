"""Splitting a file's examples into training and validation (and training parts), after filtering.

Per file and per source ROW (every pair of a ranked row lands on the same side), with a generator seeded
from ``seed`` and the file's name, so validation never overlaps training and is the same in every run
and whatever other files are listed.
"""

from __future__ import annotations

import zlib

import torch
from torch.utils.data import Dataset

from rlhf_lit.errors import ConfigError

__all__ = ["ExampleDataset", "split_examples", "val_count"]


class ExampleDataset(Dataset):
    """A list of tokenised examples (dicts of id lists and metadata)."""

    def __init__(self, examples: list[dict]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]


def val_count(val_size: int | float, num_rows: int) -> int:
    if isinstance(val_size, bool) or val_size < 0:
        raise ConfigError(f"val_size must be a fraction in [0, 1) or a row count >= 1, got {val_size!r}")
    if val_size < 1:
        return int(round(val_size * num_rows))
    if val_size != int(val_size):
        raise ConfigError(f"val_size >= 1 is a row count and must be a whole number, got {val_size!r}")
    return int(val_size)


def split_examples(
    examples: list[dict],
    val_size: int | float,
    max_train_rows: int | None,
    seed: int,
    name: str,
    train_part: tuple[int, int] | None = None,
) -> tuple[list[dict], list[dict]]:
    """Split one file's kept examples into ``(train, val)`` by source row.

    Args:
        examples: kept examples of ONE file, each with a ``"row"`` key.
        val_size: a fraction of the file's kept rows (< 1), or a row count (>= 1); 0 for none.
        max_train_rows: keep at most this many training rows (a fixed, seeded subset); None: all.
        seed: the split seed; the generator is seeded with ``seed + crc32(name)``.
        name: the file's name, so each file gets its own (stable) permutation.
        train_part: ``(i, n)``: keep only part ``i`` (0-based) of ``n`` contiguous, equal parts of the
            seeded training order (before ``max_train_rows``); the validation rows are the same for every
            part, and the parts are disjoint. None: all training rows.

    Returns:
        ``(train, val)``, each in the file's original order.

    Raises:
        ConfigError: if ``val_size`` is invalid or would leave no training rows.
    """
    rows = sorted({e["row"] for e in examples})
    n_val = val_count(val_size, len(rows))
    if rows and n_val >= len(rows):
        raise ConfigError(
            f"val_size={val_size} takes all {len(rows)} kept rows of {name}; nothing is left to train on"
        )
    generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    order = [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
    val_rows = set(order[:n_val])
    train_order = order[n_val:]
    if train_part is not None:
        part, parts = train_part
        train_order = train_order[part * len(train_order) // parts : (part + 1) * len(train_order) // parts]
    train_rows = set(train_order if max_train_rows is None else train_order[:max_train_rows])
    return [e for e in examples if e["row"] in train_rows], [e for e in examples if e["row"] in val_rows]
