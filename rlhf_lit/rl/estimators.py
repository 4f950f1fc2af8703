"""Advantage estimators: step 5 of an iteration, from a :class:`~rlhf_lit.rl.rollout.Rollout` to advantages.

An estimator is called as ``estimator(rollout, kl_coef, distributed)`` and returns :class:`Advantages`.
It may read any field of the rollout (scores, per-token KL, masks, values) and must not change it.
What an estimator needs (a critic? groups of responses?) is declared once, in its
:class:`~rlhf_lit.rl.algorithms.AlgorithmSpec` (``rlhf_lit.rl.algorithms``), not on the estimator.

Notation: B sequences, R response positions; masks True on real tokens; KL and rewards in nats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rlhf_lit.functional.advantages import gae
from rlhf_lit.functional.group_advantages import (
    discounted_returns,
    group_relative_advantages,
    leave_one_out_advantages,
    token_advantages,
)
from rlhf_lit.functional.kl import shaped_rewards
from rlhf_lit.functional.masked import masked_mean, masked_whiten

if TYPE_CHECKING:
    from rlhf_lit.rl.rollout import Rollout

__all__ = [
    "AdvantageEstimator",
    "Advantages",
    "GAEEstimator",
    "GroupEstimator",
    "ReinforcePPEstimator",
]


@dataclass
class Advantages:
    """What an estimator gives the update.

    Attributes:
        advantages: ``(B, R)``, 0 on padding; what the policy loss multiplies the ratio by.
        returns: ``(B, R)`` regression targets of the critic, or None for a critic-free estimator.
        non_score_rewards: ``(B, R)`` the part of the per-token rewards that is not the score (the KL
            penalty, ``-kl_coef * KL_t``).
        raw_advantage_mean: 0-dim, the mean advantage over the update tokens before any normalisation
            (all ranks), for the logs.
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None
    non_score_rewards: torch.Tensor
    raw_advantage_mean: torch.Tensor


class AdvantageEstimator(Protocol):
    """``(rollout, kl_coef, distributed) -> Advantages``.

    ``kl_coef`` is this iteration's KL penalty coefficient (the KL controller's value); ``distributed``
    asks for statistics over all ranks (a collective: every rank calls the estimator)."""

    def __call__(self, rollout: Rollout, kl_coef: float, distributed: bool) -> Advantages: ...


@dataclass
class GAEEstimator:
    """PPO's estimator (Ouyang et al. 2022; Stiennon et al. 2020): KL-shaped token rewards, GAE, whitening.

    1. ``r_t = -kl_coef * KL_t`` on every real response token, plus the (shaped) score on the last one
       (``functional.kl.shaped_rewards``);
    2. GAE with the critic's values, ``V = 0`` after the last real token, ``returns = A + V``
       (Schulman et al. 2016, eq. 16; ``functional.advantages.gae``);
    3. optionally whitening over the update tokens of every rank (``functional.masked.masked_whiten``).

    Args:
        gamma: discount factor.
        gae_lambda: GAE lambda.
        whiten: normalise the advantages to mean 0, variance 1 over the update tokens.
    """

    gamma: float
    gae_lambda: float
    whiten: bool = True

    @classmethod
    def from_settings(cls, ppo) -> GAEEstimator:
        """From ``PPOConfig``'s ``gamma``, ``gae_lambda`` and ``whiten_advantages``."""
        return cls(ppo.gamma, ppo.gae_lambda, ppo.whiten_advantages)

    def __call__(self, rollout: Rollout, kl_coef: float, distributed: bool) -> Advantages:
        mask, update_mask = rollout.response_mask, rollout.update_mask
        rewards, non_score = shaped_rewards(rollout.scores, rollout.kl, mask, kl_coef)
        advantages, returns = gae(rewards, rollout.old_values, mask, self.gamma, self.gae_lambda)
        raw_mean = masked_mean(advantages, update_mask, distributed=distributed)
        if self.whiten:
            advantages = masked_whiten(advantages, update_mask, distributed=distributed)
        return Advantages(advantages, returns, non_score, raw_mean)


@dataclass
class GroupEstimator:
    """Critic-free, one advantage per response from the rewards of the n responses to the same prompt.

    ``kind="grpo"``: ``(r_i - mean) / (std + eps)`` over the group (Shao et al. 2024, DeepSeekMath, section
    4.1.2); with ``scale_by_std=False`` only ``r_i - mean`` (Dr.GRPO: Liu et al. 2025, section 3.1).
    ``kind="rloo"``: ``r_i`` minus the mean of the other responses' rewards (Ahmadian et al. 2024, eq. 7).
    The response's advantage is put on each of its tokens; no whitening.

    The sequence reward ``r_i`` is the (shaped) score plus the KL penalty summed over the response,
    ``-kl_coef * sum_t KL_t`` (RLOO's sequence-level ``r - beta * KL``). GRPO puts the KL in the loss
    instead (``ppo.kl_placement: loss``, the objective's k3 term): the module then passes ``kl_coef = 0``
    and ``r_i`` is the score.

    Groups are consecutive rows of THIS rank's rollout: a prompt's n responses are sampled on the rank
    that holds the prompt (``RolloutCollector.collect`` repeats each prompt n times), so the statistics need
    no collective and are the same under any number of ranks. Responses with a non-finite score leave their
    group's statistics (``functional.group_advantages``).

    Args:
        kind: ``grpo`` or ``rloo``.
        group_size: n, ``sampling.num_samples_per_prompt`` (>= 2).
        scale_by_std: GRPO's division by the group std (False = Dr.GRPO); ignored by RLOO.
    """

    kind: str
    group_size: int
    scale_by_std: bool = True

    def __call__(self, rollout: Rollout, kl_coef: float, distributed: bool) -> Advantages:
        mask, update_mask = rollout.response_mask, rollout.update_mask
        rewards, non_score = shaped_rewards(rollout.scores, rollout.kl, mask, kl_coef)
        seq_rewards = rewards.sum(-1)  # the score plus the summed KL penalty
        if self.kind == "grpo":
            seq_adv = group_relative_advantages(
                seq_rewards, self.group_size, self.scale_by_std, valid=rollout.finite
            )
        else:
            seq_adv = leave_one_out_advantages(seq_rewards, self.group_size, valid=rollout.finite)
        advantages = token_advantages(seq_adv, update_mask)
        raw_mean = masked_mean(advantages, update_mask, distributed=distributed)
        return Advantages(advantages, None, non_score, raw_mean)


@dataclass
class ReinforcePPEstimator:
    """REINFORCE++ (Hu 2025, section 3): critic-free token returns of the KL-shaped rewards, normalised over
    the global batch.

    1. ``r_t = -kl_coef * KL_t`` on every real token, plus the score on the last one (as for GAE);
    2. ``G_t = sum_{s >= t} gamma^(s - t) r_s`` (``functional.group_advantages.discounted_returns``);
    3. whitening over the update tokens of every rank (``masked_whiten``): the "global batch
       normalisation" that stands in for a critic's baseline. Needs no groups (any n).

    Args:
        gamma: discount (``ppo.gamma``).
    """

    gamma: float = 1.0

    def __call__(self, rollout: Rollout, kl_coef: float, distributed: bool) -> Advantages:
        mask, update_mask = rollout.response_mask, rollout.update_mask
        rewards, non_score = shaped_rewards(rollout.scores, rollout.kl, mask, kl_coef)
        returns = discounted_returns(rewards, mask, self.gamma)
        raw_mean = masked_mean(returns, update_mask, distributed=distributed)
        advantages = masked_whiten(returns, update_mask, distributed=distributed)
        return Advantages(advantages, None, non_score, raw_mean)
