"""Data for the three stages: row formats -> canonical records -> token ids -> batches.

Modules: ``loading`` (files and hub ids -> rows, with one clear error for malformed files),
``records`` (canonical records, :class:`SkipCounter`, HH helpers), ``formats`` (row formats ->
records), ``tokenize`` (prompt/response boundaries, EOS, left truncation), ``collate`` (padding,
masks from lengths, labels), ``base`` (split, report, loaders) and the three DataModules.

Hook for generated data: :func:`~rlhf_lit.data.loading.register_source` maps a scheme to a row
maker. ``"demo"`` is wired to the synthetic demo task (``demo_task.rows_from_spec``), so configs can
list ``train_files: ["demo:preference?n=1000&seed=0&split=train"]``.
"""

from rlhf_lit.data.loading import DataFormatError, load_rows, register_source
from rlhf_lit.data.preference import PreferenceDataModule
from rlhf_lit.data.prompts import PromptDataModule
from rlhf_lit.data.records import SKIP_REASONS, SkipCounter
from rlhf_lit.data.sft import SFTDataModule

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
