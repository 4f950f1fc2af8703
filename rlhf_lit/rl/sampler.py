"""Step 1 of an iteration: where responses come from.

A :class:`Sampler` draws responses from the current policy (``sample``) and is told when the policy's
weights have changed (``sync``, after each update), so an engine that holds its own copy of the weights
(an inference server) can refresh it. :class:`HFSampler` is the first implementation: Hugging Face
``generate`` on the policy itself (``rlhf_lit.rl.generation.sample_responses``), which reads the live weights,
so its ``sync`` does nothing. :class:`CopySampler` runs the same ``generate`` on a separate copy of the policy
in ``sampling.copy_dtype`` (``rlhf_lit.models.inference_copy``), which ``sync`` refreshes.
``rl.vllm_sampler.VLLMSampler`` asks a vLLM engine in its own process (``rlhf_lit.vllm_server``) and pushes the
merged weights (or the actor adapter alone, ``sampling.vllm.weight_sync: lora``) to it at every ``sync``.
:func:`build_sampler` picks one from the sampling settings.

For the rollout-policy guard (``rlhf_lit.rl.guard``) a sampler keeps, after each ``sample``, a
:class:`SampleRecord` in ``last_record``: the tokens it drew, each one's log-prob under the distribution it
was drawn from, and the :func:`adapter_fingerprint` of the actor adapter weights that sampled.

Notation: B rows, P prompt width (left padded), R response width (right padded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from rlhf_lit.rl.generation import SampledLogprobs, SamplingConfig, sample_responses
from rlhf_lit.rl.sample_record import SampleRecord, adapter_fingerprint

__all__ = [
    "CopySampler",
    "HFSampler",
    "SampleRecord",
    "Sampler",
    "adapter_fingerprint",
    "build_sampler",
]


class Sampler(Protocol):
    """``sample(policy, prompt_ids, prompt_mask, *, synced_gpus, merge)`` -> ``(response_ids (B, R) long,
    response_mask (B, R) bool, has_stop (B,) bool)`` with the actor adapter of ``policy`` (an ``ActorCritic``);
    ``sync(policy)`` after every update; ``last_record`` the :class:`SampleRecord` of the latest ``sample``
    (None: the guard can check nothing)."""

    last_record: SampleRecord | None

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
        generate: the sampling function; default ``generation.sample_responses`` (or one with its signature,
            whose records then hold no log-probs).
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
        self.generate = generate
        self.last_record: SampleRecord | None = None

    def sample(self, policy, prompt_ids, prompt_mask, *, synced_gpus=False, merge=False):
        lm = policy.lm
        with lm.merged("actor") if merge else lm.adapter("actor"):
            fingerprint = adapter_fingerprint(policy.actor_parameters())  # the weights that sample
            # AdaptedLM.generate: an FSDP forward method when sharded
            return self._draw(lm, prompt_ids, prompt_mask, synced_gpus, fingerprint)

    def _draw(self, model, prompt_ids, prompt_mask, synced_gpus: bool, fingerprint: str | None):
        """``generate`` on ``model``, keeping the :class:`SampleRecord` (the default records log-probs while it
        samples; an injected function is called as before and records none)."""
        recorder = SampledLogprobs(self.sampling) if self.generate is None else None
        generate = self.generate or sample_responses
        out = generate(
            model,
            prompt_ids,
            prompt_mask,
            self.sampling,
            self.stop_ids,
            self.pad_token_id,
            synced_gpus=synced_gpus,
            **({"logprobs": recorder} if recorder is not None else {}),
        )
        logprobs = recorder.finish(out[0]) if recorder is not None else None
        self.last_record = SampleRecord(out[0], logprobs, fingerprint)
        return out

    def sync(self, policy) -> None:
        """Nothing to do: ``generate`` runs on the policy's live weights."""


class CopySampler(HFSampler):
    """``generate`` on a separate copy of the policy in ``sampling.copy_dtype``, the actor adapter (and any
    frozen base adapter) merged into its weights (``rlhf_lit.models.inference_copy``): one matmul per linear
    layer and, in bf16, half the bytes per decoding step. The copy is built at the first ``sample`` and
    refreshed by every ``sync``; between two syncs it is the policy of the last one, so a missed ``sync`` is a
    stale sampler, which the rollout-policy guard reports (the record's fingerprint is the adapter's at the
    last refresh). Log-probs for the PPO ratio and the KL are still the trainer's (the rollout recomputes
    them); a 16-bit copy samples from a distribution that differs from the trainer's by rounding
    (``rollout/sampler_logprob_gap``; ``SamplingConfig.gap_tolerance``).

    Args: as :class:`HFSampler`; ``sampling.copy_dtype`` names the copy's dtype.
    """

    def __init__(self, sampling, stop_ids, pad_token_id, generate=None) -> None:
        super().__init__(sampling, stop_ids, pad_token_id, generate)
        self.dtype = getattr(torch, sampling.copy_dtype)
        self.copy: torch.nn.Module | None = None
        self.copy_fingerprint: str | None = None  # the actor adapter's at the last refresh

    def sample(self, policy, prompt_ids, prompt_mask, *, synced_gpus=False, merge=False):
        if self.copy is None:
            self.sync(policy)
        return self._draw(self.copy, prompt_ids, prompt_mask, synced_gpus, self.copy_fingerprint)

    def sync(self, policy) -> None:
        """Write the policy's current weights, actor adapter merged, into the copy (built on first use)."""
        from rlhf_lit.models.inference_copy import build_inference_copy, load_merged_weights

        if self.copy is None:
            self.copy = build_inference_copy(policy.lm, self.dtype)
        load_merged_weights(policy.lm, "actor" if policy.lm.is_peft else None, self.copy)
        self.copy_fingerprint = adapter_fingerprint(policy.actor_parameters())


def build_sampler(sampling: SamplingConfig, stop_ids: list[int], pad_token_id: int) -> Sampler:
    """The sampler ``sampling`` asks for: ``rl.vllm_sampler.VLLMSampler`` for ``backend: vllm``, :class:`CopySampler`
    with ``copy_dtype`` set, else :class:`HFSampler`."""
    if sampling.backend == "vllm":
        from rlhf_lit.rl.vllm_sampler import VLLMSampler

        return VLLMSampler(sampling, stop_ids, pad_token_id)
    cls = CopySampler if sampling.copy_dtype is not None else HFSampler
    return cls(sampling, stop_ids, pad_token_id)
