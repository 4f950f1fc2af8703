"""Everything that depends on several processes, in one place: FSDP2 sharding, global sums, the strategy.

* :mod:`rlhf_lit.parallel.fsdp` -- FSDP2 (``torch.distributed.fsdp.fully_shard``) units of a causal LM
  and its heads, which unit owns which module (exports stream one unit at a time), gathering full parameters
  (a reward head's export), and the state dict of gathered parameters. torch
  only, so ``rlhf_lit.models`` may use it without importing Lightning.
* :mod:`rlhf_lit.parallel.collectives` -- sums, means and gathers over ranks through the trainer's
  strategy (the module calls them; on one process they return their input).
* :mod:`rlhf_lit.parallel.strategy` -- ``FSDP2Strategy``, Lightning's ``ModelParallelStrategy`` with every
  process in one data-parallel group and a non-strict sharded checkpoint loader (class path
  ``rlhf_lit.parallel.strategy.FSDP2Strategy``). It is the only module here that imports Lightning, and this
  package does not import it, so ``rlhf_lit.models`` can use the FSDP helpers without Lightning.

The private APIs of torch, transformers and Lightning that distributed training needs are reached here
only, each with the version it was checked against; ``tests/test_library_contracts.py`` fails loudly when
one changes.
"""

from __future__ import annotations

from rlhf_lit.parallel.collectives import global_mean, global_sum, is_distributed, rank_and_world
from rlhf_lit.parallel.fsdp import (
    LM_FORWARD_METHODS,
    data_parallel_mesh,
    fsdp_units,
    gathered_parameters,
    grad_norm_value,
    is_sharded,
    plain_state_dict,
    shard_head,
    shard_lm,
    transformer_blocks,
)

__all__ = [
    "LM_FORWARD_METHODS",
    "data_parallel_mesh",
    "fsdp_units",
    "gathered_parameters",
    "global_mean",
    "global_sum",
    "grad_norm_value",
    "is_distributed",
    "is_sharded",
    "plain_state_dict",
    "rank_and_world",
    "shard_head",
    "shard_lm",
    "transformer_blocks",
]
