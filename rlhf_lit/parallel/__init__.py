"""Everything that depends on several processes, in one place: FSDP2 sharding, global sums, the strategy.

* :mod:`rlhf_lit.parallel.fsdp` -- FSDP2 (``torch.distributed.fsdp.fully_shard``) units of a causal LM
  and its heads, gathering full parameters (exports), and the state dict of gathered parameters. torch
  only, so ``rlhf_lit.models`` may use it without importing Lightning.
* :mod:`rlhf_lit.parallel.collectives` -- sums, means and gathers over ranks through the trainer's
  strategy (the module calls them; on one process they return their input).
* :mod:`rlhf_lit.parallel.strategy` -- :class:`FSDP2Strategy`, Lightning's ``ModelParallelStrategy`` with
  every process in one data-parallel group and a non-strict sharded checkpoint loader. It is the only
  module here that imports Lightning, and it is imported on first use of ``rlhf_lit.parallel.FSDP2Strategy``
  (the class path configs name), so importing this package does not import Lightning.

The private APIs of torch, transformers and Lightning that distributed training needs are reached here
only, each with the version it was checked against; ``tests/test_library_contracts.py`` fails loudly when
one changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlhf_lit.parallel.collectives import global_mean, global_sum, is_distributed
from rlhf_lit.parallel.fsdp import (
    LM_FORWARD_METHODS,
    data_parallel_mesh,
    gathered_parameters,
    grad_norm_value,
    is_sharded,
    plain_state_dict,
    shard_head,
    shard_lm,
    transformer_blocks,
)

if TYPE_CHECKING:
    from rlhf_lit.parallel.strategy import FSDP2Strategy

__all__ = [
    "LM_FORWARD_METHODS",
    "FSDP2Strategy",
    "data_parallel_mesh",
    "gathered_parameters",
    "global_mean",
    "global_sum",
    "grad_norm_value",
    "is_distributed",
    "is_sharded",
    "plain_state_dict",
    "shard_head",
    "shard_lm",
    "transformer_blocks",
]


def __getattr__(name: str) -> Any:
    """``rlhf_lit.parallel.FSDP2Strategy`` imports Lightning's strategy classes on first use only."""
    if name == "FSDP2Strategy":
        from rlhf_lit.parallel.strategy import FSDP2Strategy

        return FSDP2Strategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
