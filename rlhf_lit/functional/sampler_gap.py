"""How far the sampler's log-probs are from the trainer's: the statistic of the rollout-policy guard.

The sampler reports each drawn token's log-prob under the distribution it drew from; the trainer recomputes
the same tokens' log-probs (the rollout's ``old_logprobs``, at the sampling temperature). When both run the
same weights the two agree up to float rounding; a stale or wrong sampler (weights one update behind, the
adapter never delivered, another temperature) moves them apart. NeMo RL guards its rollouts with the same
comparison (its ``token_mult_prob_error``, a ratio of probabilities; here the absolute log-prob difference, in
nats, so a tolerance reads in the units of the KL).

Notation: B rows, R response width. Log-probs in nats.
"""

from __future__ import annotations

import torch

__all__ = ["logprob_gap"]


def logprob_gap(
    sampler_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum, count, max)`` of ``|sampler_logprobs - trainer_logprobs|`` over the tokens where ``mask`` is True.

    Sums and counts rather than a mean, so ranks can add theirs before dividing (a token mean over the global
    batch). Values outside the mask never enter, even when they are inf or nan (a padded position's log-prob
    may be -inf).

    Args:
        sampler_logprobs: ``(B, R)`` float, log-probs the sampler drew the tokens with (nats).
        trainer_logprobs: ``(B, R)`` float, the trainer's log-probs of the same tokens (nats).
        mask: ``(B, R)`` bool, True on the tokens to compare.

    Returns:
        ``sum`` float64 scalar (nats), ``count`` float64 scalar (tokens), ``max`` float64 scalar (nats per token;
        0 when no token is compared).
    """
    diff = (sampler_logprobs.double() - trainer_logprobs.double()).abs()
    diff = torch.where(mask, diff, torch.zeros_like(diff))
    count = mask.sum().double()
    return diff.sum(), count, diff.max() if diff.numel() else diff.new_zeros(())

