"""What ``rlhf-lit evaluate`` scores with: any preference model behind one small interface.

A scorer reads a preference file into :class:`TokenPair` s in ITS OWN encoding (the one it was trained with)
and scores them: ``read_pairs(path) -> (pairs, skip_report)``, then ``score_pairs(pairs) -> (chosen_scores,
rejected_scores)``. Response lengths are counted in its tokens (``len(chosen_ids)``, the appended EOS
included, as the reward stage's own evaluation counts them). :class:`RewardExportScorer` is the reward
model exported by the reward stage; a DPO policy's implicit reward, ``beta * (log pi - log pi_ref)`` of each
response, would be a second implementation of :class:`PairScorer`.

**The encoding of a reward-model export** is exactly that of its training: the preference data module
(``rlhf_lit.data.PreferenceDataModule``, the same reading, format detection, rendering, tokenization and skip
rules) built with the export's tokenizer and the ``input_format`` its ``rlhf_lit.json`` records
(``chat_template``, ``append_eos``, ``max_length``, ``max_prompt_length``; ``min_prompt_tokens`` from its
``data`` record). So a causal-LM export sees ``[BOS] prompt response EOS`` (a chat rendering for chat data),
and an encoder export such as the MiniLM recipe ``[CLS] prompt response [SEP]`` with the prompt cut from the
left to the recorded ``max_prompt_length`` (1 in the MiniLM recipe: ``[CLS] response [SEP]``). An export
with no ``input_format`` (saved outside a fit) gets the data module's defaults, cut to its position limit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_lit.errors import UserError
from rlhf_lit.models.backbone import encoder_special_tokens
from rlhf_lit.models.export import META_FILE, RewardScorer, load_reward_model, read_meta
from rlhf_lit.models.reward_input import RewardInputFormat
from rlhf_lit.models.tokenizer import load_tokenizer

__all__ = ["ExportError", "PairScorer", "RewardExportScorer", "TokenPair", "length_sorted_batches"]

# The longest sequence scored when an export records no max_length and its model has no position limit.
DEFAULT_MAX_LENGTH = 512


class ExportError(UserError, ValueError):
    """A ``--model`` that is not a reward-model export (missing folder, no ``rlhf_lit.json``, another kind)."""


@dataclass(frozen=True)
class TokenPair:
    """One preference pair in a scorer's encoding: the prompt ids and the two response ids (EOS included)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


class PairScorer(Protocol):
    """A preference model as ``rlhf-lit evaluate`` sees it.

    Attributes:
        name: what the report calls it (e.g. the export folder).
        temperature: the calibration temperature recorded with it (None when none was: T = 1 is used).
        reference: the summary of the pairs it was calibrated on (``reward_eval.response_summary``), or None.
    """

    name: str
    temperature: float | None
    reference: dict | None

    def read_pairs(self, path: str, format: str = "auto") -> tuple[list[TokenPair], str]:
        """The file's pairs in this scorer's encoding, and the data module's one-line report of what was kept
        and skipped. Raises a ``UserError`` for a file that cannot be read."""
        ...

    def score_pairs(self, pairs: Sequence[TokenPair]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen_scores, rejected_scores)``, each ``(N,)`` float32, uncalibrated."""
        ...


def length_sorted_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` in batches of similar length: sorted by length (longest first), each batch as
    many rows as fit ``max_tokens`` padded tokens (rows x its longest row), at least one row.

    Example: lengths [3, 10, 4, 9] with 20 tokens: [[1, 3], [2, 0]] (2 x 10 = 20, then 2 x 4 = 8).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class RewardExportScorer:
    """A reward model exported by the reward stage (``rlhf_lit.models.export``), causal LM or encoder.

    Args:
        path: the export folder.
        max_tokens: padded tokens per forward (rows sorted by length; ``length_sorted_batches``).
        load: builds the ``RewardScorer`` from the folder (default ``load_reward_model``).

    Raises:
        ExportError: no such folder, no ``rlhf_lit.json`` in it, an export of another kind (a policy), or a
            tokenizer that does not fit the model (``_check_tokenizer``).
    """

    def __init__(
        self,
        path: str,
        max_tokens: int = 8192,
        load: Callable[[str], RewardScorer] = load_reward_model,
    ) -> None:
        if not os.path.isdir(path):
            raise ExportError(
                f"evaluate: --model {path}: no such folder (resolved to {os.path.abspath(path)})"
            )
        if not os.path.exists(os.path.join(path, META_FILE)):
            raise ExportError(
                f"evaluate: --model {path}: not an rlhf_lit export ({META_FILE} is missing); give the export_dir of a "
                "reward-model run"
            )
        meta = read_meta(path)
        if meta.get("kind") != "reward_model":
            raise ExportError(
                f"evaluate: --model {path}: holds a {meta.get('kind', 'policy')!r} export, not a reward model; give "
                "the export_dir of a reward-model run"
            )
        self.name = path
        self.meta = meta
        self.temperature: float | None = float(meta["temperature"]) if "temperature" in meta else None
        self.reference: dict | None = meta.get("validation_summary")
        self.max_tokens = max_tokens
        self._load = load
        self._model: RewardScorer | None = None  # loaded on first use: a bad data file is reported first
        # the tokenizer as load_reward_model sets it up (an encoder's gets BOS = [CLS], EOS = [SEP])
        self.tokenizer = load_tokenizer(path)
        if meta.get("architecture") == "encoder":
            encoder_special_tokens(self.tokenizer)
        self.input_format = RewardInputFormat.from_meta(meta)
        _check_tokenizer(path, self.tokenizer, self.input_format.append_eos)
        self.max_length = self.input_format.max_length or _position_limit(path, self.tokenizer)
        self.min_prompt_tokens = int((meta.get("data") or {}).get("min_prompt_tokens", 1))

    def read_pairs(self, path: str, format: str = "auto") -> tuple[list[TokenPair], str]:
        """Read, render and tokenize ``path`` as the reward stage would (the module docstring)."""
        from rlhf_lit.data import PreferenceDataModule

        data = PreferenceDataModule(
            train_files=[path],
            val_size=0,
            format=format,
            chat_template=self.input_format.chat_template,
            append_eos=self.input_format.append_eos,
            max_length=self.max_length,
            max_prompt_length=self.input_format.max_prompt_length,
            min_prompt_tokens=min(self.min_prompt_tokens, self.max_length - 1),
            shuffle=False,
            tokenizer=self.tokenizer,
        )
        data.setup("fit")
        if data.unpaired:
            raise UserError(f"{path}: unpaired (KTO-style) rows have no pairs to score; set pair_unpaired")
        pairs = [
            TokenPair(list(e["prompt_ids"]), list(e["chosen_ids"]), list(e["rejected_ids"]))
            for e in data.train_dataset.examples
        ]
        report = data.data_report()["train"]  # the module reads the file as its only (training) split
        return pairs, report.removeprefix("train: ")

    def read_heldout(self) -> list[tuple[str, list[TokenPair], str]]:
        """The export's own validation pairs, per file, in this scorer's encoding: the split its ``data``
        record names (files, ``val_size``, ``seed``, filters) rebuilt with the preference data module, so they
        are exactly the pairs the training run validated on and never trained on.

        Returns:
            ``[(file name, pairs, the data module's validation report line)]``, in the files' order.

        Raises:
            UserError: the export records no training data (saved outside a fit, or by an older rlhf_lit), a
                recorded file is missing, or the run held out no validation pairs.
        """
        from rlhf_lit.data import PreferenceDataModule

        record = self.meta.get("data")
        if not record:
            raise UserError(
                f"evaluate: --heldout: {self.name} records no training data (saved outside a fit, or by an "
                "older rlhf_lit); give the files with --data"
            )
        data = PreferenceDataModule(**record, shuffle=False, tokenizer=self.tokenizer)
        data.setup("fit")
        if data.val_dataset is None or data.unpaired:
            raise UserError(
                f"evaluate: --heldout: {self.name} was trained with no validation pairs (val_size 0)"
            )
        groups: dict[int, list[TokenPair]] = {}
        for e in data.val_dataset.examples:
            pair = TokenPair(list(e["prompt_ids"]), list(e["chosen_ids"]), list(e["rejected_ids"]))
            groups.setdefault(int(e["source"]), []).append(pair)
        line = data.data_report().get("val", "")
        return [(data.source_names[s], groups[s], line) for s in sorted(groups)]

    @property
    def model(self) -> RewardScorer:
        if self._model is None:
            self._model = self._load(self.name)
        return self._model

    @torch.no_grad()
    def score_pairs(self, pairs: Sequence[TokenPair]) -> tuple[torch.Tensor, torch.Tensor]:
        """Uncalibrated scores of every pair's two sequences (prompt + response), scored in length-sorted,
        right-padded batches (an encoder needs right padding; a causal LM reads its last real token)."""
        rows = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
        scores = torch.empty(len(rows), dtype=torch.float32)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        device = next(self.model.parameters()).device
        for batch in length_sorted_batches([len(r) for r in rows], self.max_tokens):
            width = len(rows[batch[0]])
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for k, i in enumerate(batch):
                ids[k, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
                mask[k, : len(rows[i])] = 1
            out = self.model.score(ids.to(device), mask.to(device), calibrated=False)
            scores[torch.tensor(batch)] = out.float().cpu()
        n = len(pairs)
        return scores[:n], scores[n:]


def _check_tokenizer(path: str, tokenizer, append_eos: bool) -> None:
    """Refuse, before any model loads, an export whose tokenizer does not fit its model: token ids past the
    embedding table (``vocab_size`` of its ``config.json``; the forward would fail with an ``IndexError``), or
    no EOS token where the recorded input format appends one (every response was trained ending with it).

    Raises:
        ExportError: naming the folder and the problem.
    """
    config_file = os.path.join(path, "config.json")
    config: dict = {}
    if os.path.exists(config_file):
        with open(config_file) as f:
            config = json.load(f)
    vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    ids = tokenizer.get_vocab().values()
    largest = max(ids, default=-1)
    if isinstance(vocab_size, int) and largest >= vocab_size:
        raise ExportError(
            f"evaluate: --model {path}: its tokenizer does not match its model: token ids reach {largest}, past "
            f"the model's {vocab_size} embeddings (vocab_size in config.json); the tokenizer files were replaced "
            "or come from another model -- export again from the run that trained it"
        )
    if append_eos and tokenizer.eos_token_id is None:
        raise ExportError(
            f"evaluate: --model {path}: its tokenizer has no EOS token, but the export appends one to every "
            f"response (input_format.append_eos in {META_FILE}); the tokenizer files were changed or come from "
            "another model -- export again from the run that trained it"
        )


def _position_limit(path: str, tokenizer) -> int:
    """The longest input of an export that records no ``max_length``: its config's position limit, its
    tokenizer's ``model_max_length``, or :data:`DEFAULT_MAX_LENGTH`."""
    config: dict = {}
    if os.path.exists(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    value = config.get("max_position_embeddings") or config.get("n_positions")
    limits = [n for n in (value, tokenizer.model_max_length) if n and n < 10**6]
    return int(min(limits)) if limits else DEFAULT_MAX_LENGTH
