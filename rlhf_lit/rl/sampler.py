"""Step 1 of an iteration: where responses come from.

A :class:`Sampler` draws responses from the current policy (``sample``) and is told when the policy's
weights have changed (``sync``, after each update), so an engine that holds its own copy of the weights
(an inference server) can refresh it. :class:`HFSampler` is the first implementation: Hugging Face
``generate`` on the policy itself (``rlhf_lit.rl.generation.sample_responses``), which reads the live weights,
so its ``sync`` does nothing. :class:`CopySampler` runs the same ``generate`` on a separate copy of the policy
in ``sampling.copy_dtype`` (``rlhf_lit.models.inference_copy``), which ``sync`` refreshes. :class:`VLLMSampler` asks a vLLM engine in its own process (``rlhf_lit.vllm_server``) and pushes the
merged weights (or the actor adapter alone, ``sampling.vllm.weight_sync: lora``) to it at every ``sync``.
:func:`build_sampler` picks one from the sampling settings.

For the rollout-policy guard (``rlhf_lit.rl.guard``) a sampler keeps, after each ``sample``, a
:class:`SampleRecord` in ``last_record``: the tokens it drew, each one's log-prob under the distribution it
was drawn from, and the :func:`adapter_fingerprint` of the actor adapter weights that sampled.

Notation: B rows, P prompt width (left padded), R response width (right padded).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_lit.rl.generation import SampledLogprobs, SamplingConfig, sample_responses

__all__ = [
    "CopySampler",
    "HFSampler",
    "SampleRecord",
    "Sampler",
    "VLLMSampler",
    "adapter_fingerprint",
    "build_sampler",
]


def adapter_fingerprint(params: Iterable[torch.Tensor]) -> str:
    """A checksum of adapter weights: sha256 (16 hex digits) of every tensor's shape, float64 sum and float64
    sum of squares, in order. Any optimizer step changes it (the sums of a LoRA matrix that moved are not
    the same to the last bit); the same weights give the same digest.

    Cost: two reductions per tensor on its device and one ``(2 N,)`` float64 transfer (N tensors), no copy of
    the weights (a hash of every byte would move the whole adapter to the host: ~80 MB for r = 16 on a 7B
    model). Under FSDP2 each rank checksums its own shards, so compare digests on the same rank.
    """
    params = [p.detach() for p in params]
    params = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # DTensor shards
    digest = hashlib.sha256(repr([tuple(p.shape) for p in params]).encode())
    if params:
        sums = [torch.stack([p.double().sum(), p.double().square().sum()]) for p in params]
        digest.update(torch.cat([s.cpu() for s in sums]).numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class SampleRecord:
    """What a sampler saw when it drew a batch (``Sampler.last_record``), for the rollout-policy guard.

    Attributes:
        response_ids: ``(B, R)`` long, the tokens as drawn (a wrapper may edit what ``sample`` returns; the
            guard compares only tokens that are still these).
        logprobs: ``(B, R)`` float32, each drawn token's log-prob under the scores it was drawn from (after
            every logits processor and the temperature; nats), or None if the sampler cannot tell.
        fingerprint: :func:`adapter_fingerprint` of the actor adapter weights that sampled, or None.
    """

    response_ids: torch.Tensor
    logprobs: torch.Tensor | None
    fingerprint: str | None


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


class VLLMSampler:
    """Responses from a vLLM engine in its own process (``sampling.backend: vllm``; ``rlhf_lit.vllm_server``).

    ``sample`` sends the prompts as token ids (each row without its left padding) with the temperature, the
    lengths, the stop tokens and a seed drawn from torch's generator (so a seeded run, and validation under its
    forked generator, asks for the same draws); row i is seeded ``seed + i``. The replies are laid out as
    :func:`~rlhf_lit.rl.generation.sample_responses` lays out ``generate``'s: R = the longest response, right
    padded with ``pad_token_id``, the mask True up to and including the first stop token
    (``truncate_after_stop``), so the rollout is the one the ``hf`` backend builds for the same tokens.

    ``sync`` (``sampling.vllm.weight_sync: merged``) writes the policy's weights with the actor adapter merged
    (``models.inference_copy.merged_weights``, in ``sampling.vllm.dtype``) to ``weights.safetensors`` in
    ``sampling.vllm.weights_dir`` (atomically), and asks the engine to load it; the first ``sample`` syncs
    first. With ``weight_sync: lora`` the first ``sync`` pushes the base that way (the reference weights: every
    frozen base adapter merged, the actor off), and every ``sync`` writes the actor adapter alone as a peft
    folder ``adapter-<n>`` (renamed into place when complete) and asks the engine to load it as its LoRA
    request (``/load_lora``); the rollouts then ask for it (``lora: true``). The engine answers every request
    with the sha256 of the bytes it last loaded (``<weights>+<adapter>`` with the adapter); the
    :class:`SampleRecord`'s fingerprint is the adapter's at the last push when that digest is the one of the
    bytes pushed, else ``engine:<digest>``, which never matches the policy's: an engine that missed a push (a
    skipped ``sync``, a restarted server) is caught by the rollout-policy guard on the next iteration (a
    restarted server asked for an adapter it never loaded refuses the request: one line, the run stops). The
    record's log-probs are the engine's after the temperature (vLLM's ``processed_logprobs``), for the guard and
    ``ppo.tis_cap``.

    Args:
        sampling: the sampling settings (``sampling.vllm``: where the server is).
        stop_ids: token ids that end a response.
        pad_token_id: the id responses are padded with after their stop token.
        client: the protocol client; default a ``rl.vllm_client.VLLMClient`` on ``sampling.vllm.url``.

    Attributes:
        sync_s: seconds of the latest ``sync`` (merge or adapter state, write, the engine's load); ``load_s`` the
            engine's part.
    """

    def __init__(self, sampling: SamplingConfig, stop_ids: list[int], pad_token_id: int, client=None) -> None:
        from rlhf_lit.rl.vllm_client import VLLMClient

        self.sampling, self.stop_ids, self.pad_token_id = sampling, list(stop_ids), pad_token_id
        settings = sampling.vllm
        self.client = client or VLLMClient(settings.url, settings.timeout_s)
        self._tmp = None
        if settings.weights_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rlhf_lit_vllm_")
        self.weights_dir = settings.weights_dir or self._tmp.name
        self.dtype = getattr(torch, settings.dtype)
        self.lora = settings.weight_sync == "lora"
        self.last_record: SampleRecord | None = None
        self.pushed: tuple[str, str] | None = None  # (the digest the engine should report, adapter fingerprint)
        self.base_pushed: str | None = None  # weight_sync lora: the digest of the base weights pushed
        self.adapters = 0  # weight_sync lora: adapter folders written
        self.sync_s = self.load_s = 0.0

    def sample(self, policy, prompt_ids, prompt_mask, *, synced_gpus=False, merge=False):
        from rlhf_lit.functional.sequence import truncate_after_stop

        if synced_gpus:
            raise RuntimeError("sampling.backend: vllm runs with one training process")
        if self.pushed is None:
            self.sync(policy)
        cfg = self.sampling
        prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        seed = int(torch.randint(0, 2**31 - 1 - len(prompts), (1,)))
        out = self.client.generate(
            prompts, cfg.temperature, cfg.max_new_tokens, cfg.min_new_tokens, self.stop_ids, seed, self.lora
        )
        width = max(len(tokens) for tokens in out["tokens"])
        response = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(prompts), width), dtype=torch.float32)
        for i, (tokens, lps) in enumerate(zip(out["tokens"], out["logprobs"])):
            response[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        response = response.to(prompt_ids.device)
        digest, fingerprint = self.pushed
        held = out["weights"]
        self.last_record = SampleRecord(response, logprobs, fingerprint if held == digest else f"engine:{held}")
        if not self.stop_ids:
            mask = torch.ones_like(response, dtype=torch.bool)
            return response, mask, torch.zeros(response.shape[0], dtype=torch.bool, device=response.device)
        return truncate_after_stop(response, self.stop_ids, self.pad_token_id)

    def sync(self, policy) -> None:
        """Push the policy's current weights to the engine: merged, or the base once and the actor adapter (see the
        class docstring)."""
        from rlhf_lit.models.inference_copy import merged_weights

        t0 = time.perf_counter()
        lm = policy.lm
        if self.lora:
            load_s = 0.0
            if self.base_pushed is None:
                self.base_pushed, load_s = self._push_weights(merged_weights(lm, None))  # the reference weights
            adapter, adapter_load_s = self._push_adapter(lm)
            expected, load_s = f"{self.base_pushed}+{adapter}", load_s + adapter_load_s
        else:
            expected, load_s = self._push_weights(merged_weights(lm, "actor" if lm.is_peft else None))
        self.pushed = (expected, adapter_fingerprint(policy.actor_parameters()))
        self.load_s, self.sync_s = load_s, time.perf_counter() - t0

    def _push_weights(self, tensors: dict[str, torch.Tensor]) -> tuple[str, float]:
        """Write ``tensors`` to ``weights.safetensors`` (atomically) and have the engine load them:
        ``(digest of the bytes, the engine's load seconds)``."""
        from safetensors.torch import save

        from rlhf_lit.vllm_server import file_digest

        data = save({k: v.to(device="cpu", dtype=self.dtype).contiguous() for k, v in tensors.items()})
        os.makedirs(self.weights_dir, exist_ok=True)
        path = os.path.join(self.weights_dir, "weights.safetensors")
        partial = path + ".partial"
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
        reply = self.client.load_weights(path)
        return file_digest(data), float(reply.get("load_s", 0.0))

    def _push_adapter(self, lm) -> tuple[str, float]:
        """Write the actor adapter as a peft folder ``adapter-<n>`` (renamed into place when complete), have the
        engine load it, remove the previous folder: ``(adapter digest, the engine's load seconds)``.

        Raises:
            ValueError: the policy has no actor LoRA adapter.
        """
        from peft import get_peft_model_state_dict
        from safetensors.torch import save

        from rlhf_lit.vllm_server import ADAPTER_FILES, adapter_digest

        if not lm.is_peft or "actor" not in lm.model.peft_config:
            raise ValueError("sampling.vllm.weight_sync: lora needs a LoRA actor adapter (backbone.lora)")
        config = {**lm.model.peft_config["actor"].to_dict(), "inference_mode": True}
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}  # as peft saves it
        config_bytes = json.dumps(config, indent=2, sort_keys=True).encode()
        tensors = get_peft_model_state_dict(lm.model, adapter_name="actor")
        weights = save({k: v.detach().to(device="cpu", dtype=self.dtype).contiguous() for k, v in tensors.items()})
        self.adapters += 1
        folder = os.path.join(self.weights_dir, f"adapter-{self.adapters}")
        partial = folder + ".partial"
        for stale in (partial, folder):  # left by a run that used this folder before
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(partial)
        for name, data in zip(ADAPTER_FILES, (config_bytes, weights)):
            with open(os.path.join(partial, name), "wb") as f:
                f.write(data)
        os.replace(partial, folder)
        reply = self.client.load_lora(folder)
        shutil.rmtree(os.path.join(self.weights_dir, f"adapter-{self.adapters - 1}"), ignore_errors=True)
        return adapter_digest(config_bytes, weights), float(reply.get("load_s", 0.0))


def build_sampler(sampling: SamplingConfig, stop_ids: list[int], pad_token_id: int) -> Sampler:
    """The sampler ``sampling`` asks for: :class:`VLLMSampler` for ``backend: vllm``, :class:`CopySampler`
    with ``copy_dtype`` set, else :class:`HFSampler`."""
    if sampling.backend == "vllm":
        return VLLMSampler(sampling, stop_ids, pad_token_id)
    cls = CopySampler if sampling.copy_dtype is not None else HFSampler
    return cls(sampling, stop_ids, pad_token_id)
