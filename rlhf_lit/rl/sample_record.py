"""What a sampler records of each batch it draws, for the rollout-policy guard (``rlhf_lit.rl.guard``):
:class:`SampleRecord` and the :func:`adapter_fingerprint` of the actor adapter weights that sampled. Shared by
every sampler (``rl.sampler``, ``rl.vllm_sampler``). Notation: B rows, R response width.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["SampleRecord", "adapter_fingerprint"]


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
