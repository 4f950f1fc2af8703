"""Collators: tokenised examples -> batches of tensors.

Attention masks come from the example LENGTHS, never from ``ids != pad_token_id``: with pad == EOS
(GPT-2, Llama, SmolLM2) the response's EOS must keep mask 1 and label != -100 (docs/pitfalls.md: score token, SFT labels).
Masks are ``long`` 1 = real token, 0 = padding, as ``transformers`` models expect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "IGNORE_INDEX",
    "PreferenceCollator",
    "PromptCollator",
    "SFTCollator",
    "UnpairedCollator",
    "pad_sequences",
]

IGNORE_INDEX = -100


def _round_up(length: int, multiple: int | None) -> int:
    if not multiple:
        return length
    return -(-length // multiple) * multiple


def pad_sequences(
    sequences: Sequence[Sequence[int]], pad_value: int, length: int, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad id lists to ``length``; return ``(ids, mask)``, both ``(B, length)`` long, mask from lengths.

    Raises:
        ValueError: if a sequence is longer than ``length``.
    """
    ids = torch.full((len(sequences), length), pad_value, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        n = len(seq)
        if n > length:
            raise ValueError(f"sequence of length {n} does not fit the padded length {length}")
        if n == 0:
            continue
        cols = slice(length - n, length) if left else slice(0, n)
        ids[i, cols] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def _response_labels(
    prompt_lens: Sequence[int], sequences: Sequence[Sequence[int]], length: int
) -> torch.Tensor:
    """Labels ``(B, length)``: the ids on response positions, -100 on prompt and padding."""
    labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
    for i, (p, seq) in enumerate(zip(prompt_lens, sequences)):
        if len(seq) <= p:
            raise ValueError(f"example {i} has no response tokens; it would train on nothing")
        labels[i, p : len(seq)] = torch.as_tensor(list(seq[p:]), dtype=torch.long)
    return labels


@dataclass
class PreferenceCollator:
    """Right-pads chosen and rejected to ONE common length T (so a module can run them as one batch).

    Batch keys: ``chosen_input_ids``, ``chosen_attention_mask``, ``rejected_input_ids``,
    ``rejected_attention_mask``, ``chosen_labels`` (B, T) (-100 on prompt and padding, for an optional
    LM term), ``margin`` (B,) float (0.0 where the data gives none), ``source`` (B,) long (index into
    ``source_names``), ``chosen_response_len``, ``rejected_response_len``, ``prompt_len`` (B,) long
    (response lengths include the EOS), and with ``weight_ranked_pairs`` ``pair_weight`` (B,) float
    (``1 / C(K, 2)`` for a pair of a ranked row of K responses, 1 otherwise).

    Args:
        pad_token_id: the id written into padding positions.
        pad_to_multiple_of: round T up to a multiple of this (None: no rounding).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        chosen = [e["prompt_ids"] + e["chosen_ids"] for e in examples]
        rejected = [e["prompt_ids"] + e["rejected_ids"] for e in examples]
        length = _round_up(max(len(s) for s in chosen + rejected), self.pad_to_multiple_of)
        chosen_ids, chosen_mask = pad_sequences(chosen, self.pad_token_id, length)
        rejected_ids, rejected_mask = pad_sequences(rejected, self.pad_token_id, length)
        prompt_lens = [len(e["prompt_ids"]) for e in examples]
        margins = [0.0 if e.get("margin") is None else float(e["margin"]) for e in examples]
        return {
            "chosen_input_ids": chosen_ids,
            "chosen_attention_mask": chosen_mask,
            "rejected_input_ids": rejected_ids,
            "rejected_attention_mask": rejected_mask,
            "chosen_labels": _response_labels(prompt_lens, chosen, length),
            "margin": torch.tensor(margins, dtype=torch.float),
            "source": torch.tensor([e.get("source", 0) for e in examples], dtype=torch.long),
            "chosen_response_len": torch.tensor([len(e["chosen_ids"]) for e in examples], dtype=torch.long),
            "rejected_response_len": torch.tensor(
                [len(e["rejected_ids"]) for e in examples], dtype=torch.long
            ),
            "prompt_len": torch.tensor(prompt_lens, dtype=torch.long),
            **self._weights(examples),
        }

    @staticmethod
    def _weights(examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        """``pair_weight`` (B,) float when the data module weighs pairs (``weight_ranked_pairs``), else nothing."""
        if "weight" not in examples[0]:
            return {}
        return {
            "pair_weight": torch.tensor([float(e.get("weight", 1.0)) for e in examples], dtype=torch.float)
        }


@dataclass
class SFTCollator:
    """Right-pads prompt + response; labels are -100 on prompt and padding, the response EOS is kept.

    Batch keys: ``input_ids``, ``attention_mask``, ``labels`` (B, T) and ``prompt_len`` (B,) long.

    Args:
        pad_token_id: the id written into padding positions.
        pad_to_multiple_of: round T up to a multiple of this (None: no rounding).

    Raises:
        ValueError: (when called) if an example has no response tokens, so no batch trains on nothing.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        sequences = [e["prompt_ids"] + e["response_ids"] for e in examples]
        length = _round_up(max(len(s) for s in sequences), self.pad_to_multiple_of)
        input_ids, attention_mask = pad_sequences(sequences, self.pad_token_id, length)
        prompt_lens = [len(e["prompt_ids"]) for e in examples]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": _response_labels(prompt_lens, sequences, length),
            "prompt_len": torch.tensor(prompt_lens, dtype=torch.long),
        }


@dataclass
class UnpairedCollator(SFTCollator):
    """Unpaired (KTO-style) completions: the SFT batch plus ``label`` (B,) bool (True = desirable) and
    ``source`` (B,) long, for an unpaired objective.

    Batch keys: ``input_ids``, ``attention_mask``, ``labels`` (B, T), ``prompt_len``, ``label``, ``source``.
    """

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = super().__call__(examples)
        batch["label"] = torch.tensor([bool(e["label"]) for e in examples], dtype=torch.bool)
        batch["source"] = torch.tensor([e.get("source", 0) for e in examples], dtype=torch.long)
        return batch


@dataclass
class PromptCollator:
    """LEFT-pads prompts for generation.

    Batch keys: ``input_ids`` (B, P), ``attention_mask`` (B, P), ``prompt_index`` (B,) long (the row's
    index in its split), ``reference`` (list of str or None), ``prompt_text`` (list of str: the
    rendered prompt before any left cut), ``prompt`` (list: the record's prompt before any rendering, a
    string or a list of ``{"role", "content"}`` messages, or None; a reward model with another tokenizer or
    chat template is fed from it), ``fields`` (list of dict: the prompt row's fields as read, plus
    ``reference``; what reward functions get, ``rlhf_lit.rewards``).

    Args:
        pad_token_id: the id written into padding positions.
        pad_to_multiple_of: round P up to a multiple of this (None: no rounding).
        pad_to_length: pad every batch to exactly this width (overrides ``pad_to_multiple_of``).
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    pad_to_length: int | None = None

    def __call__(self, examples: Sequence[dict]) -> dict[str, object]:
        prompts = [e["prompt_ids"] for e in examples]
        length = self.pad_to_length or _round_up(max(len(p) for p in prompts), self.pad_to_multiple_of)
        input_ids, attention_mask = pad_sequences(prompts, self.pad_token_id, length, left=True)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "prompt_index": torch.tensor([e["prompt_index"] for e in examples], dtype=torch.long),
            "reference": [e.get("reference") for e in examples],
            "prompt_text": [e.get("prompt_text", "") for e in examples],
            "prompt": [e.get("prompt") for e in examples],
            "fields": [e.get("fields") or {"reference": e.get("reference")} for e in examples],
        }
