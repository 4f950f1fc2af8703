"""Moved to :mod:`rlhf_lit.parallel` (FSDP2 units, gathered parameters) and :mod:`rlhf_lit.parallel.strategy`
(``FSDP2Strategy``, class path ``rlhf_lit.parallel.strategy.FSDP2Strategy``).

These names stay importable from here (torch only, no Lightning) for code written against the old path.
"""

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

__all__ = [
    "LM_FORWARD_METHODS",
    "data_parallel_mesh",
    "gathered_parameters",
    "grad_norm_value",
    "is_sharded",
    "plain_state_dict",
    "shard_head",
    "shard_lm",
    "transformer_blocks",
]
