"""Advantage estimators: step 5 of an iteration, from a :class:`~rlhf_lit.rollout.Rollout` to advantages.

An estimator is called as ``estimator(rollout, kl_coef, distributed)`` and returns :class:`Advantages`.
It may read any field of the rollout (scores, per-token KL, masks, values) and must not change it.
``needs_critic`` says whether it reads ``rollout.old_values`` (and returns targets for the critic).

Notation: B sequences, R response positions; masks True on real tokens; KL and rewards in nats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rlhf_lit.functional.advantages import gae
from rlhf_lit.functional.kl import shaped_rewards
from rlhf_lit.functional.masked import masked_mean, masked_whiten

if TYPE_CHECKING:
    from rlhf_lit.rollout import Rollout

__all__ = ["AdvantageEstimator", "Advantages", "GAEEstimator"]


@dataclass
class Advantages:
    """What an estimator gives the update.

    Attributes:
        advantages: ``(B, R)``, 0 on padding; what the policy loss multiplies the ratio by.
        returns: ``(B, R)`` regression targets of the critic, or None for a critic-free estimator.
        token_rewards: ``(B, R)`` per-token rewards the advantages were computed from.
        non_score_rewards: ``(B, R)`` the part of ``token_rewards`` that is not the score (the KL penalty).
        raw_advantage_mean: 0-dim, the mean advantage over the update tokens before any normalisation
            (all ranks), for the logs.
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None
    token_rewards: torch.Tensor
    non_score_rewards: torch.Tensor
    raw_advantage_mean: torch.Tensor


class AdvantageEstimator(Protocol):
    """``(rollout, kl_coef, distributed) -> Advantages``; ``needs_critic``: it reads ``rollout.old_values``.

    ``kl_coef`` is this iteration's KL penalty coefficient (the KL controller's value); ``distributed``
    asks for statistics over all ranks (a collective: every rank calls the estimator)."""

    needs_critic: bool

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
    needs_critic: bool = True

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
        return Advantages(advantages, returns, rewards, non_score, raw_mean)
