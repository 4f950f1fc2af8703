"""How a preference stage's rows reach a model (``sequences``; ``lm_response_logps``: packed, trimmed or padded),
and where its reference log-probs come from: nowhere (reference-free losses), the on-disk cache
(``rlhf_lit.models.reference_cache``), or a no-grad forward of the reference per batch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from rlhf_lit.data.collate import IGNORE_INDEX
from rlhf_lit.errors import ConfigError
from rlhf_lit.functional.packing import response_logps_packed
from rlhf_lit.functional.preference import response_logps_from_hidden, response_logps_in_length_groups
from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.reference_cache import (
    ReferenceLogpCache,
    data_fingerprint,
    tensor_fingerprint,
    tokenizer_fingerprint,
)

log = logging.getLogger("rlhf_lit")

RowLayout = Literal["packed", "trimmed", "padded"]
RunReference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sequences(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, prompt_len, response_len)`` of a batch, right padded: a pair batch
    gives its B chosen rows then its B rejected rows (2B rows), an unpaired (KTO) batch its B rows."""
    if "chosen_input_ids" in batch:
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        prompt_len = batch["prompt_len"].repeat(2)
        response_len = torch.cat([batch["chosen_response_len"], batch["rejected_response_len"]])
        return ids, mask, prompt_len, response_len
    response_len = (batch["labels"] != IGNORE_INDEX).sum(-1)
    return batch["input_ids"], batch["attention_mask"], batch["prompt_len"], response_len


def lm_response_logps(lm: AdaptedLM, ids, mask, prompt_len, response_len, layout: RowLayout) -> torch.Tensor:
    """``(N,)`` summed response log-probs of ``lm`` (its current adapter setting), the LM head on response
    positions only; the trunk runs the rows ``packed`` (``response_logps_packed``), ``trimmed`` (length
    groups, ``response_logps_in_length_groups``) or ``padded`` (one forward)."""
    if layout == "packed":
        trunk = lambda packed_ids, position_ids: lm.hidden_states(packed_ids, None, position_ids)  # noqa: E731
        return response_logps_packed(trunk, lm.logits, ids, mask, prompt_len, response_len)
    if layout == "trimmed":
        return response_logps_in_length_groups(lm.hidden_states, lm.logits, ids, mask, prompt_len, response_len)
    return response_logps_from_hidden(lm.hidden_states(ids, mask), lm.logits, ids, prompt_len, response_len)


def reference_numerics(precision: str, layout: RowLayout) -> dict[str, Any]:
    """What besides the weights changes a reference log-prob's rounding, for the cache key: the trainer's
    precision and the row layout. ``trim_padding`` keeps its meaning (True: length groups ran); ``packing: True``
    joins only for packed rows, so an unpacked run keeps the key it had before packing (its cache stays valid)."""
    numerics = {"precision": precision, "trim_padding": layout == "trimmed"}
    return {**numerics, "packing": True} if layout == "packed" else numerics


class ReferenceSource:
    """The reference log-probs of a batch's sequences, and how many reference forwards were run.

    Args:
        run: ``(ids, mask, prompt_len, response_len) -> (N,)`` summed log-probs, one reference forward.
        weights: the named tensors the reference reads (hashed into the cache key).
        tokenizer: the policy's tokenizer (hashed into the cache key).
        folder: the cache folder; None computes the reference every batch.
        reference_free: the loss needs no reference (``logps`` returns None).
        device: ``() -> torch.device`` where batches are moved for the cache's precomputation.
        sequences: ``batch -> (ids, mask, prompt_len, response_len)``.
    """

    def __init__(
        self,
        run: RunReference,
        weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        tokenizer: Any,
        folder: str | None,
        reference_free: bool,
        device: Callable[[], torch.device],
        sequences: Callable[[dict], tuple],
    ) -> None:
        self._run, self._weights, self._tokenizer = run, weights, tokenizer
        self._device, self._sequences = device, sequences
        self.folder = folder
        self.reference_free = reference_free
        self.cache: ReferenceLogpCache | None = None
        self.forwards = 0  # reference forward passes run by this process
        self._fingerprint: str | None = None

    def fingerprint_start(self) -> None:
        """Hash the reference weights now (call before a checkpoint is restored into them: with full
        fine-tuning the reference is the weights at the start)."""
        if self.folder and not self.reference_free and self._fingerprint is None:
            self._fingerprint = tensor_fingerprint(self._weights())

    def prepare(
        self,
        datamodule: Any,
        reference_restored: bool,
        numerics: dict[str, Any] | None = None,
        context: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        """Load the cache of this key, or compute it over the train and val splits and write it.

        Args:
            datamodule: the fit's data module (its train and val loaders are read).
            reference_restored: the weights the reference reads were restored from a trained checkpoint (a
                resumed full fine-tuning without ``reference_copy``): they are no longer the reference.
            numerics: the settings besides the weights that change the numbers (the trainer's precision,
                ``trim_padding``), hashed into the key: a cache written under ``32-true`` is not read under
                ``bf16-mixed``.
            context: the context the training step's forwards run in (the precision plugin's autocast), so
                the cached numbers are those an uncached step computes (a reference computed outside
                ``bf16-mixed``'s autocast made the first DPO loss 0.69343, not ln 2, on the tiny config).

        Raises:
            ConfigError: if a resumed run needs a cache that is gone and the weights no longer are the
                reference (full fine-tuning without ``reference_copy``).
        """
        if not self.folder or self.reference_free or self.cache is not None:
            return
        if datamodule is None or not hasattr(datamodule, "train_dataloader"):
            raise ConfigError("model.init_args.reference_cache needs a data module (rlhf-lit fit --data ...)")
        self.fingerprint_start()
        parts = {
            "data": data_fingerprint(datamodule),
            "tokenizer": tokenizer_fingerprint(self._tokenizer),
            "reference": self._fingerprint,
            **(numerics or {}),
        }
        cache = ReferenceLogpCache(self.folder, parts)
        if cache.load():
            log.info("reference log-probs: %d sequences from %s", len(cache), cache.path)
            self.cache = cache
            return
        if reference_restored:
            raise ConfigError(
                f"the reference cache {cache.path} is missing, and this resumed run's weights are no longer the "
                "reference; start the run again, or restore the cache folder"
            )
        train = datamodule.train_dataloader()
        loaders = [DataLoader(train.dataset, batch_size=train.batch_size, collate_fn=train.collate_fn)]
        val = datamodule.val_dataloader()
        loaders += [val] if isinstance(val, DataLoader) else list(val or [])
        device = self._device()
        for loader in loaders:
            for batch in loader:
                ids, mask, prompt_len, response_len = (t.to(device) for t in self._sequences(batch))
                with context():
                    logps = self._forward(ids, mask, prompt_len, response_len)
                cache.add(ids, prompt_len, response_len, logps)
        cache.save()
        log.info("reference log-probs: %d sequences computed, written to %s", len(cache), cache.path)
        self.cache = cache

    def _forward(self, ids, mask, prompt_len, response_len) -> torch.Tensor:
        self.forwards += 1
        return self._run(ids, mask, prompt_len, response_len)

    def logps(self, ids, mask, prompt_len, response_len) -> torch.Tensor | None:
        """``(N,)`` summed reference log-probs (nats) of the N sequences; None for a reference-free loss."""
        if self.reference_free:
            return None
        if self.cache is not None:
            return self.cache.lookup(ids, prompt_len, response_len)
        return self._forward(ids, mask, prompt_len, response_len)
