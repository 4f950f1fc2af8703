"""``FSDP2Strategy``: Lightning's ``ModelParallelStrategy`` for data-parallel FSDP2, with a partial loader.

This is the adapter to Lightning's strategy internals (checked against Lightning 2.6.6;
``tests/test_library_contracts.py`` fails loudly if they change): the private ``_data_parallel_size``
attribute of ``ModelParallelStrategy``, ``lightning.fabric.strategies.model_parallel._is_sharded_checkpoint``
and ``lightning.fabric.utilities.load._METADATA_FILENAME`` (the name of a sharded checkpoint's metadata file).
"""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

__all__ = ["FSDP2Strategy"]


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with every process in one data-parallel (FSDP2) group.

    Lightning's default for ``ModelParallelStrategy`` on one node is tensor parallelism across the
    node's devices (``data_parallel_size = num_nodes``); rlhf_lit shards data-parallel only, so this
    sets ``data_parallel_size = num_nodes * devices`` and ``tensor_parallel_size = 1``.

    Args:
        save_distributed_checkpoint: each rank writes its shard (a checkpoint folder); False gathers the
            full state on rank 0 into one file.
        process_group_backend: ``nccl`` / ``gloo`` (default: by device).
    """

    def __init__(
        self, save_distributed_checkpoint: bool = True, process_group_backend: str | None = None
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
        )

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """Load a checkpoint; a sharded one may hold only some of the model's keys.

        PPO checkpoints hold the adapters and heads, not the frozen base (``PPOModule.on_save_checkpoint``;
        the module sets ``strict_loading = False``). Lightning's sharded loader asks the checkpoint for every
        key of the model and fails on the missing base; here a non-strict module loads the keys the
        checkpoint has and keeps its own values for the rest. Full (single-file) checkpoints and strict
        modules take Lightning's path, which already loads a full checkpoint non-strictly.
        """
        from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint import DefaultLoadPlanner, load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if self.lightning_module.strict_loading or not _is_sharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        planner = DefaultLoadPlanner(allow_partial_load=True)
        state = {"state_dict": get_model_state_dict(self.model)}
        load(state, checkpoint_id=path, planner=planner)  # in place into the model's (sharded) tensors
        self.model.load_state_dict(state["state_dict"], strict=False)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load(optim_state, checkpoint_id=path)
            set_optimizer_state_dict(
                self.model,
                optimizer,
                optim_state_dict=optim_state[key],
                options=StateDictOptions(cpu_offload=True),
            )
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
