"""A prompt sampler whose order is a pure function of ``(seed, epoch)`` and that resumes mid-run exactly.

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
        num_replicas = (
            num_replicas if num_replicas is not None else dist.get_world_size() if distributed else 1
        )
        rank = rank if rank is not None else dist.get_rank() if distributed else 0
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        self.batch_size = batch_size
        self.batches_per_epoch = len(dataset) // (num_replicas * batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(dataset)} training prompts do not fill one batch of {batch_size} on each of {num_replicas} ranks"
            )
        self._anchor: tuple[int, int] | None = None
        self._offset = 0

    @property
    def order_epoch(self) -> int:
        """The epoch whose permutation the current pass uses (``set_epoch``'s value, shifted on resume)."""
        return self.epoch + self._offset

    def resume_at(self, batches_consumed: int) -> None:
        """Make the next pass continue the order after ``batches_consumed`` batches of the whole run.

        The position is ``(batches_consumed // batches_per_epoch, batches_consumed % batches_per_epoch)``:
        epoch and batch within it. Whatever epoch number Lightning sets next (a run stopped by
        ``max_steps`` is saved as a finished epoch, one stopped mid-epoch is not), that pass uses the saved
        epoch's permutation from the saved batch on, and later passes follow in order.
        """
        self._anchor = divmod(int(batches_consumed), self.batches_per_epoch)

    def __len__(self) -> int:
        # The FULL epoch, also on a resumed pass, so that Lightning's restored batch counter and the
        # shortened iterator end the epoch together.
        return self.batches_per_epoch * self.batch_size

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self._anchor is not None:
            anchor_epoch, skip = self._anchor
            self._offset, self._anchor = anchor_epoch - self.epoch, None  # a skip applies to one pass only
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.order_epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        order = order[: self.batches_per_epoch * self.num_replicas * self.batch_size]
        mine = order[self.rank :: self.num_replicas]
        return iter(mine[skip * self.batch_size :])
