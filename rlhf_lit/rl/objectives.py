"""Objectives: the loss of one micro-batch, term by term, from the policy's outputs and the rollout's rows.

The update (``rlhf_lit.rl.update.PPOUpdater``) runs the policy's forward for the terms it wants and asks the
objective for their loss: all terms in one forward and one backward, or the ``policy`` terms and then the
``value`` term, each right after its own forward (the two-pass option). :meth:`Objective.loss` builds the
same sum either way, so both give the same gradients.

Notation: b rows of the micro-batch, R response positions; masks True on the update tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf_lit import metrics as M
from rlhf_lit.functional.kl import kl_per_token
from rlhf_lit.functional.losses import ppo_policy_loss, ppo_value_loss
from rlhf_lit.functional.masked import masked_mean, masked_weighted_mean
from rlhf_lit.functional.policy_gradient import cispo_policy_loss, importance_log_ratio, top_entropy_mask
from rlhf_lit.rl.settings import PPOConfig

__all__ = ["TERMS", "MicroBatch", "Objective", "PPOObjective"]

TERMS = ("policy", "value")


@dataclass
class MicroBatch:
    """The rollout rows one forward / backward sees.

    Attributes:
        input_ids: ``(b, T)`` prompt (left padded) then response; ``attention_mask`` ``(b, T)``.
        prompt_len: P, the width of the prompt block.
        mask: ``(b, R)`` bool, the update tokens (all False on a zero-weight filler row).
        old_logprobs: ``(b, R)`` the sampling policy's log-probs.
        advantages: ``(b, R)``.
        old_values: ``(b, R)`` the rollout's critic values, or None without a critic.
        returns: ``(b, R)`` the critic's targets, or None without a critic.
        ref_logprobs: ``(b, R)`` the reference's log-probs, given when the KL is a loss term, else None.
        kl_coef: the weight of that KL term (this iteration's ``kl_coef``).
        token_weights: ``(b, R)`` the loss aggregation's token weights (``functional.aggregation.aggregation_weights``),
            or None for the plain token mean.
        is_weights: ``(b, R)`` truncated importance-sampling weights of the policy term (``ppo.tis_cap``), or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    kl_coef: float = 0.0
    token_weights: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None


class Objective(Protocol):
    """``terms(has_critic)`` lists the loss terms; ``loss(out, mb, terms)`` is the micro-batch's loss over
    those terms (a 0-dim tensor to back-propagate) and its detached statistics by metric name. ``out`` is
    the ``PolicyOutput`` of a forward that computed what the terms need (``wants``)."""

    def terms(self, has_critic: bool) -> tuple[str, ...]: ...

    def wants(self, terms: tuple[str, ...]) -> dict[str, bool]: ...

    def loss(
        self, out, mb: MicroBatch, terms: tuple[str, ...]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


@dataclass
class PPOObjective:
    """``policy_loss + vf_coef * value_loss - entropy_coef * entropy`` (Schulman et al. 2017, eq. 9), token
    means over the micro-batch's update tokens (weighted by ``mb.token_weights`` for another loss
    aggregation: ``ppo.loss_aggregation``).

    Terms: ``policy`` = the clipped surrogate (``functional.losses.ppo_policy_loss``, dual clip optional;
    each token's term times ``mb.is_weights`` when given: truncated importance sampling, ``ppo.tis_cap``)
    minus the entropy bonus, plus, with the KL in the loss (``mb.ref_logprobs`` given), ``kl_coef`` times the
    per-token estimate of KL(policy || reference) that ``kl.estimator`` names (default there: k3,
    ``exp(ref - logp) - (ref - logp) - 1``; GRPO: Shao et al. 2024, eq. 4), aggregated the same way; ``value`` = ``vf_coef`` times the (optionally clipped) value
    loss (``ppo_value_loss``). Without a critic there is no ``value`` term.

    The 2025 family (docs/ppo.md): ``clip_range_high`` makes the clip asymmetric (DAPO); ``importance_sampling_level``
    puts GSPO's sequence ratio (or GSPO-token's) in the surrogate; ``policy_loss="cispo"`` replaces the clipped
    surrogate by CISPO's loss (``functional.policy_gradient.cispo_policy_loss``, its weight clipped to
    ``[1 - clip_range, 1 + clip_range_high]``); ``top_entropy_quantile < 1`` keeps the policy term on the
    micro-batch's highest-entropy tokens only (``top_entropy_mask``).

    Args:
        clip_range: epsilon of the clipped surrogate (its lower side when ``clip_range_high`` is given).
        dual_clip: c > 1 caps the loss of negative-advantage tokens (Ye et al. 2020); None disables.
        value_clip_range: clip of the value around the rollout value; None disables.
        vf_coef: weight of the value loss.
        entropy_coef: weight of the entropy bonus (subtracted).
        kl_estimator: the per-token KL estimator of the in-loss KL term (``kl.estimator``).
        clip_range_high: the clip's upper epsilon; None = ``clip_range``.
        importance_sampling_level: ``token``, ``sequence`` (GSPO) or ``sequence_token`` (GSPO-token).
        policy_loss: ``ppo`` or ``cispo``.
        top_entropy_quantile: q in (0, 1]; 1 = every token.
    """

    clip_range: float
    dual_clip: float | None
    value_clip_range: float | None
    vf_coef: float
    entropy_coef: float
    kl_estimator: str = "k3"
    clip_range_high: float | None = None
    importance_sampling_level: str = "token"
    policy_loss: str = "ppo"
    top_entropy_quantile: float = 1.0

    @classmethod
    def from_settings(cls, ppo: PPOConfig, kl_estimator: str = "k3") -> PPOObjective:
        """From ``PPOConfig``'s clip bounds (``clip_range`` or ``clip_range_low`` / ``clip_range_high``),
        ``dual_clip``, ``value_clip_range``, ``vf_coef``, ``entropy_coef``, ``importance_sampling_level``,
        ``policy_loss``, ``top_entropy_quantile`` and the KL estimator of the in-loss term."""
        low, high = ppo.clip_bounds
        return cls(
            clip_range=low,
            dual_clip=ppo.dual_clip,
            value_clip_range=ppo.value_clip_range,
            vf_coef=ppo.vf_coef,
            entropy_coef=ppo.entropy_coef,
            kl_estimator=kl_estimator,
            clip_range_high=high,
            importance_sampling_level=ppo.importance_sampling_level,
            policy_loss=ppo.policy_loss,
            top_entropy_quantile=ppo.top_entropy_quantile,
        )

    def terms(self, has_critic: bool) -> tuple[str, ...]:
        return TERMS if has_critic else ("policy",)

    def wants(self, terms: tuple[str, ...]) -> dict[str, bool]:
        """The ``ActorCritic`` outputs the terms read (entropy is always logged)."""
        return {
            "want_logprobs": "policy" in terms,
            "want_values": "value" in terms,
            "want_entropy": "policy" in terms,
        }

    def loss(
        self, out, mb: MicroBatch, terms: tuple[str, ...]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        stats: dict[str, torch.Tensor] = {}
        loss = None
        if "policy" in terms:
            loss, pg_stats = self.policy_term(out, mb)
            stats[M.PPO_POLICY_LOSS] = loss
            stats[M.PPO_CLIPFRAC] = pg_stats["clipfrac"]
            stats[M.PPO_CLIPFRAC_LOW] = pg_stats["clipfrac_low"]
            stats[M.PPO_CLIPFRAC_HIGH] = pg_stats["clipfrac_high"]
            if "high_entropy_frac" in pg_stats:
                stats[M.PPO_HIGH_ENTROPY_FRAC] = pg_stats["high_entropy_frac"]
            stats[M.PPO_APPROX_KL] = pg_stats["approx_kl"]
            stats[M.PPO_RATIO_MEAN] = pg_stats["ratio_mean"]
            if self.dual_clip is not None:
                stats[M.PPO_DUAL_CLIPFRAC] = pg_stats["dual_clipfrac"]
            if mb.ref_logprobs is not None:
                kl = kl_per_token(out.logprobs, mb.ref_logprobs, self.kl_estimator)
                stats[M.PPO_KL_LOSS] = masked_mean(kl, mb.mask)  # logged as a token mean
                loss = loss + mb.kl_coef * masked_weighted_mean(kl, mb.mask, mb.token_weights)
        if "value" in terms:
            vf_loss, vf_stats = ppo_value_loss(
                out.values, mb.old_values, mb.returns, mb.mask, self.value_clip_range, mb.token_weights
            )
            stats[M.PPO_VALUE_LOSS] = vf_loss
            stats[M.PPO_VALUE_CLIPFRAC] = vf_stats["value_clipfrac"]
            loss = self.vf_coef * vf_loss if loss is None else loss + self.vf_coef * vf_loss
        if "policy" in terms:
            entropy = masked_weighted_mean(out.entropy, mb.mask, mb.token_weights)
            stats[M.PPO_ENTROPY] = masked_mean(out.entropy, mb.mask)  # logged as a token mean
            loss = loss - self.entropy_coef * entropy
        return loss, {k: v.detach() for k, v in stats.items()}

    def policy_term(self, out, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss of the micro-batch (``ppo`` or ``cispo``, at the configured ratio level, on the
        tokens the entropy quantile keeps) and its statistics."""
        token_mask, extra = None, {}
        if self.top_entropy_quantile < 1.0:
            token_mask = top_entropy_mask(out.entropy, mb.mask, self.top_entropy_quantile)
            extra["high_entropy_frac"] = masked_mean(token_mask.float(), mb.mask)
        high = self.clip_range if self.clip_range_high is None else self.clip_range_high
        if self.policy_loss == "cispo":
            log_ratio = importance_log_ratio(
                out.logprobs, mb.old_logprobs, mb.mask, self.importance_sampling_level
            )
            loss, pg_stats = cispo_policy_loss(
                log_ratio,
                out.logprobs,
                mb.advantages,
                mb.mask,
                self.clip_range,
                high,
                weights=mb.token_weights,
                is_weights=mb.is_weights,
                token_mask=token_mask,
            )
        else:
            loss, pg_stats = ppo_policy_loss(
                out.logprobs,
                mb.old_logprobs,
                mb.advantages,
                mb.mask,
                self.clip_range,
                self.dual_clip,
                weights=mb.token_weights,
                is_weights=mb.is_weights,
                clip_range_high=high,
                importance_sampling_level=self.importance_sampling_level,
                token_mask=token_mask,
            )
        return loss, {**pg_stats, **extra}
