"""Step 1 of an iteration: where responses come from.

A :class:`Sampler` draws responses from the current policy (``sample``) and is told when the policy's
weights have changed (``sync``, after each update), so an engine that holds its own copy of the weights
(an inference server) can refresh it. :class:`HFSampler` is the first implementation: Hugging Face
``generate`` on the policy itself (``rlhf_lit.generation.sample_responses``), which reads the live weights,
so its ``sync`` does nothing.

Notation: B rows, P prompt width (left padded), R response width (right padded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from rlhf_lit.generation import SamplingConfig, sample_responses

__all__ = ["HFSampler", "Sampler"]


class Sampler(Protocol):
    """``sample(policy, prompt_ids, prompt_mask, *, synced_gpus, merge)`` -> ``(response_ids (B, R) long,
    response_mask (B, R) bool, has_stop (B,) bool)`` with the actor adapter of ``policy`` (an ``ActorCritic``);
    ``sync(policy)`` after every update."""

    def sample(
        self,
        policy,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        synced_gpus: bool = False,
        merge: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def sync(self, policy) -> None: ...


class HFSampler:
    """Hugging Face ``generate`` with the actor adapter on (or, with ``merge``, folded into the base weights
    for speed: one process, not 4-bit; exact on exit).

    Args:
        sampling: the sampling settings (temperature, lengths, samples per prompt).
        stop_ids: token ids that end a response (``generation.resolve_stop_ids``).
        pad_token_id: the id responses are padded with after their stop token.
        generate: the sampling function; default ``generation.sample_responses`` (or one with its signature).
    """

    def __init__(
        self,
        sampling: SamplingConfig,
        stop_ids: list[int],
        pad_token_id: int,
        generate: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.pad_token_id = pad_token_id
        self.generate = generate or sample_responses

    def sample(self, policy, prompt_ids, prompt_mask, *, synced_gpus=False, merge=False):
        lm = policy.lm
        with lm.merged("actor") if merge else lm.adapter("actor"):
            return self.generate(
                lm,  # AdaptedLM.generate: an FSDP forward method when sharded
                prompt_ids,
                prompt_mask,
                self.sampling,
                self.stop_ids,
                self.pad_token_id,
                synced_gpus=synced_gpus,
            )

    def sync(self, policy) -> None:
        """Nothing to do: ``generate`` runs on the policy's live weights."""
