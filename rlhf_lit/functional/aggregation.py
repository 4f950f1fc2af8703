"""Loss aggregation: how the token losses of a minibatch are weighed into one loss (``ppo.loss_aggregation``).

Notation: B responses, R response positions; ``mask`` True on the tokens that enter the update.
"""

from __future__ import annotations

import torch

__all__ = ["AGGREGATIONS", "aggregation_weights"]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "token_sum_norm")


def aggregation_weights(mask: torch.Tensor, aggregation: str) -> torch.Tensor | None:
    """``(B, R)`` float token weights of a loss aggregation, 0 off the update tokens.

    None for ``token_mean`` (the objective's plain token mean), 1 for ``token_sum_norm`` (Dr.GRPO: Liu et al.
    2025, eq. 3, normalised by a constant later), and ``1 / (the response's update tokens)`` for
    ``seq_mean_token_mean`` (Shao et al. 2024, eq. 3's ``1 / |o_i|``), so that each response weighs the same.
    E.g. mask ``[[1, 1, 0], [1, 0, 0]]`` -> ``[[0.5, 0.5, 0], [1, 0, 0]]``.

    Raises:
        ValueError: an aggregation not in :data:`AGGREGATIONS`.
    """
    if aggregation == "token_mean":
        return None
    weights = mask.float()
    if aggregation == "seq_mean_token_mean":
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=1.0)
    elif aggregation != "token_sum_norm":
        raise ValueError(f"unknown ppo.loss_aggregation {aggregation!r}")
    return weights
