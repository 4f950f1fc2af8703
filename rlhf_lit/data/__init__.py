"""Data for the three stages: row formats -> canonical records -> token ids -> batches.

Modules: ``loading`` (files and hub ids -> rows, with one clear error for malformed files),
``records`` (canonical records, :class:`SkipCounter`, HH helpers), ``formats`` (row formats ->
records), ``tokenize`` (prompt/response boundaries, EOS, left truncation), ``collate`` (padding,
masks from lengths, labels), ``base`` (split, report, loaders; the shared loader arguments) and the three
DataModules.

Hook for generated data: :func:`~rlhf_lit.data.loading.register_source` maps a scheme to a row
maker. This package registers ``"demo"`` (the synthetic demo task, ``demo_task.load_source``), so configs
can list ``train_files: ["demo:preference?n=1000&seed=0&split=train"]``.

The DataModules (Lightning classes) are imported on first use of their names, so the Lightning-free parts
(formats, records, tokenisation, collation) can be imported by ``rlhf_lit.models`` without Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf_lit.data import demo_task
from rlhf_lit.data.loading import DataFormatError, load_rows, register_source
from rlhf_lit.data.records import SKIP_REASONS, SkipCounter

if TYPE_CHECKING:
    from rlhf_lit.data.preference import PreferenceDataModule
    from rlhf_lit.data.prompts import PromptDataModule
    from rlhf_lit.data.sft import SFTDataModule

register_source("demo", demo_task.load_source)

_DATAMODULES = {
    "PreferenceDataModule": "rlhf_lit.data.preference",
    "PromptDataModule": "rlhf_lit.data.prompts",
    "SFTDataModule": "rlhf_lit.data.sft",
}

__all__ = [
    "SKIP_REASONS",
    "DataFormatError",
    "PreferenceDataModule",
    "PromptDataModule",
    "SFTDataModule",
    "SkipCounter",
    "load_rows",
    "register_source",
]


def __getattr__(name: str) -> Any:
    """``rlhf_lit.data.<X>DataModule`` imports its module (and Lightning) on first use."""
    if name in _DATAMODULES:
        import importlib

        value = getattr(importlib.import_module(_DATAMODULES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
