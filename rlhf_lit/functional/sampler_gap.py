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

__all__ = ["logprob_gap", "truncated_is_weights"]


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


def truncated_is_weights(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, known: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(trainer - sampler), cap)`` per token, 1 where the
    sampler's log-prob is not known.

    When the sampler's distribution is not the trainer's (a bf16 sampling copy under a float32 trainer), the
    rollout's tokens come from the sampler, so the policy gradient, whose expectation is over the trainer's
    policy, is biased; weighting each token's term by ``pi_trainer / pi_sampler`` removes the bias and capping
    the weight at ``cap`` bounds its variance (truncated importance sampling: Yao et al. 2025, "Your Efficient
    RL Framework Secretly Brings You Off-Policy RL Training"; veRL's token-level ``rollout_is_threshold``).
    The weights carry no gradient.

    Args:
        trainer_logprobs: ``(B, R)`` float, the trainer's log-probs of the sampled tokens at rollout time (the
            rollout's ``old_logprobs``, nats).
        sampler_logprobs: ``(B, R)`` float, the sampler's log-probs of the same tokens (nats); read only where
            ``known``.
        known: ``(B, R)`` bool, True where the sampler's log-prob is that of the token in the rollout.
        cap: ``C >= 1``, the largest weight.

    Returns:
        ``(B, R)`` float32 weights in ``(0, cap]``, detached; exactly 1 where ``known`` is False.

    Raises:
        ValueError: if ``cap < 1`` or the shapes differ.
    """
    if cap < 1.0:
        raise ValueError(f"the truncated importance-sampling cap must be >= 1, got {cap}")
    if not (trainer_logprobs.shape == sampler_logprobs.shape == known.shape):
        raise ValueError(
            f"shapes differ: trainer {tuple(trainer_logprobs.shape)}, sampler {tuple(sampler_logprobs.shape)}, "
            f"known {tuple(known.shape)}"
        )
    with torch.no_grad():
        log_ratio = torch.where(known, trainer_logprobs.float() - sampler_logprobs.float(), 0.0)
        return torch.exp(log_ratio).clamp(max=cap)
