"""A prompt sampler whose order is a pure function of ``(seed, epoch)`` and that can skip consumed batches.

It subclasses ``DistributedSampler`` so Lightning keeps it under DDP/FSDP instead of wrapping it (a
wrapper would re-shuffle and break exact resumption); each rank takes every ``num_replicas``-th index
of the epoch's permutation, and the tail that does not fill a whole global batch is dropped.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

__all__ = ["ResumableSampler"]


class ResumableSampler(DistributedSampler):
    """Seeded per-epoch permutation (``torch.randperm`` with generator seed ``seed + epoch``).

    Args:
        dataset: the (sized) dataset to sample from.
        batch_size: the per-rank batch size of the DataLoader that uses this sampler.
        seed: the base seed.
        shuffle: permute (True) or keep the dataset order (False).
        num_replicas: ranks taking part (default: the torch.distributed world size, or 1).
        rank: this rank (default: the torch.distributed rank, or 0).

    Raises:
        ValueError: if the dataset is too small for one batch on every rank.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        num_replicas = num_replicas if num_replicas is not None else dist.get_world_size() if distributed else 1
        rank = rank if rank is not None else dist.get_rank() if distributed else 0
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self.batches_per_epoch = len(dataset) // (num_replicas * batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(dataset)} training prompts do not fill one batch of {batch_size} on each of {num_replicas} ranks"
            )
        self._skip_epoch: int | None = None
        self._skip_batches = 0

    def skip(self, epoch: int, num_batches: int) -> None:
        """Make the next pass over ``epoch`` start after its first ``num_batches`` batches (per rank)."""
        self._skip_epoch, self._skip_batches = epoch, num_batches

    def __len__(self) -> int:
        # The FULL epoch, also on a resumed pass, so that Lightning's restored batch counter and the
        # shortened iterator end the epoch together.
        return self.batches_per_epoch * self.batch_size

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        order = order[: self.batches_per_epoch * self.num_replicas * self.batch_size]
        mine = order[self.rank :: self.num_replicas]
        skip = self._skip_batches if self._skip_epoch == self.epoch else 0
        self._skip_epoch, self._skip_batches = None, 0  # a skip applies to one pass only
        return iter(mine[skip * self.batch_size :])
