"""An endless, resumable stream of SFT batches: the pretraining-mix (PTX) term of PPO (Ouyang et al. 2022)."""

from __future__ import annotations

from typing import Any

from rlhf_lit.data.sft import SFTDataModule

__all__ = ["PTXStream"]


class PTXStream:
    """SFT batches, one per ``next_batch`` call, cycling over the files for ever in a seeded order.

    Args:
        cfg: ``PTXConfig`` (``train_files``, ``format``, ``batch_size``, ``max_length``).
        tokenizer: the policy's tokenizer.
        seed: seeds the loader order (so :meth:`fast_forward` replays a resumed run's position).
    """

    def __init__(self, cfg: Any, tokenizer: Any, seed: int) -> None:
        self.datamodule = SFTDataModule(
            train_files=cfg.train_files,
            format=cfg.format,
            batch_size=cfg.batch_size,
            max_length=cfg.max_length,
            val_size=0,
            seed=seed,
            tokenizer=tokenizer,
        )
        self.consumed = 0
        self._iterator = None
        self._ready = False  # the files are read at the first batch, not when the run is built

    def next_batch(self) -> dict:
        if not self._ready:
            self.datamodule.setup("fit")
            self._ready = True
        while True:
            if self._iterator is None:
                self._iterator = iter(self.datamodule.train_dataloader())
            try:
                batch = next(self._iterator)
                self.consumed += 1
                return batch
            except StopIteration:
                self._iterator = None

    def fast_forward(self, consumed: int) -> None:
        """Skip the batches an interrupted run already used (the loader order is seeded)."""
        for _ in range(consumed):
            self.next_batch()
