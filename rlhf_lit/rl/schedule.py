"""The minibatch schedule of one PPO epoch: which rows of the global rollout each rank takes, and how many
micro-batches every rank runs (``PPOUpdater`` draws one permutation per epoch and calls it)."""

from __future__ import annotations

import torch

__all__ = ["epoch_schedule"]


def epoch_schedule(
    order: torch.Tensor,
    world_size: int,
    rank: int,
    minibatch_size: int,
    micro_batch_size: int,
    group_size: int = 1,
) -> list[tuple[torch.Tensor, int]]:
    """This rank's rows of each global minibatch of one PPO epoch, and the micro-batches every rank runs.

    The global rollout batch has ``W * B`` rows; global row ``g`` is row ``g // W`` of rank ``g % W`` (the
    prompt sampler deals each global batch out round-robin: ``ResumableSampler``, like PyTorch's
    ``DistributedSampler``). ``order`` is one permutation of the global rows, drawn identically on every
    rank; global minibatch ``k`` is ``order[k * W * minibatch_size : (k + 1) * W * minibatch_size]``, exactly
    the minibatch one rank holding all ``W * B`` rows draws with ``ppo_minibatch_size = W * minibatch_size``.
    Each rank takes its own rows of it, in that order; their number varies between ranks and minibatches.
    DDP and FSDP need the same number of forwards and backwards on every rank, so the micro-batch count of a
    minibatch is the largest over the ranks (a rank with fewer runs empty, zero-weight micro-batches).

    With n samples per prompt (``group_size``) a rank holds the n responses of each of its prompts in
    consecutive rows, so global row ``g`` is sample ``g % n`` of global prompt ``q = g // n``, held by rank
    ``q % W`` as its row ``(q // W) * n + g % n``: the same numbering as one rank holding every prompt.

    Args:
        order: ``(W * B,)`` a permutation of the global rows.
        world_size: W.
        rank: this rank.
        minibatch_size: ``ppo.ppo_minibatch_size``, rows per rank per minibatch on average.
        micro_batch_size: rows per forward / backward.
        group_size: n, responses per prompt (``sampling.num_samples_per_prompt``).

    Returns:
        One ``(local_rows, num_micro_batches)`` per global minibatch; ``local_rows`` is a long tensor of this
        rank's row indices (possibly empty). E.g. W = 2, order ``[3, 0, 2, 1, ...]``, minibatch 2: global
        minibatch ``[3, 0, 2, 1]`` -> rank 0 takes rows ``[0, 1]`` (global 0, 2), rank 1 rows ``[1, 0]``.
    """
    global_mb = minibatch_size * world_size
    out = []
    for start in range(0, order.numel(), global_mb):
        rows = order[start : start + global_mb]
        prompt, sample = rows // group_size, rows % group_size
        owners = prompt % world_size
        counts = torch.bincount(owners, minlength=world_size)
        n_micro = int(-(-int(counts.max()) // micro_batch_size))
        local = (prompt // world_size) * group_size + sample
        out.append((local[owners == rank], n_micro))
    return out
