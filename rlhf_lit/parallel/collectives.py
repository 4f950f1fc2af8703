"""Sums, means and gathers over the ranks of a run, through the trainer's strategy.

Every function takes the ``trainer`` (anything with ``world_size`` and ``strategy``: Lightning's
``Trainer``; None outside a trainer: one process) and is a collective when ``world_size > 1``: every rank must call it, in the same order. On one
process each returns its input unchanged, so single-process code pays nothing. Values are detached: these
are statistics and weights, never part of a loss's graph.
"""

from __future__ import annotations

import torch

__all__ = ["gather", "global_mean", "global_sum", "is_distributed", "rank_and_world"]


def is_distributed(trainer) -> bool:
    """More than one process (DDP, FSDP2); None (no trainer) is one process."""
    return trainer is not None and trainer.world_size > 1


def rank_and_world(trainer) -> tuple[int, int]:
    """``(global rank, world size)`` of this process; ``(0, 1)`` with no trainer (one process). Not a collective."""
    return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)


def global_sum(trainer, value: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor over all ranks (elementwise); the tensor itself on one process."""
    if not is_distributed(trainer):
        return value
    return trainer.strategy.reduce(value.detach().clone(), reduce_op="sum")


def global_mean(trainer, value: torch.Tensor) -> torch.Tensor:
    """The mean of a tensor over all ranks (elementwise); the tensor itself on one process."""
    if not is_distributed(trainer):
        return value
    return trainer.strategy.reduce(value.detach().clone(), reduce_op="mean")


def gather(trainer, value: torch.Tensor) -> torch.Tensor:
    """Every rank's ``(N, ...)`` tensor, stacked to ``(W * N, ...)`` in rank order (same N on every rank)."""
    if not is_distributed(trainer):
        return value.detach()
    group = torch.distributed.group.WORLD
    return trainer.strategy.all_gather(value.detach(), group=group).flatten(0, 1)
