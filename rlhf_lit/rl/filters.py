"""What the 2025 policy-gradient family's options do to a rollout between its scores and its update.

After step 4 scores the responses, :func:`apply_filters` decides, from ``RolloutSettings``: the rollout
importance weights of the policy loss (``ppo.tis_cap`` / ``tis_level`` / ``tis_mode``), the responses left out of
the loss for reaching ``max_new_tokens`` without a stop token (``ppo.mask_truncated_completions``) or for
belonging to a group whose scores are all equal (``ppo.dynamic_sampling``, DAPO). The overlong penalty is part of
the scores already (``ScoreShaper``); it is kept here for the metrics. docs/policy_gradient.md.

Notation: B responses of this rank, R response positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlhf_lit.functional.policy_gradient import zero_variance_groups
from rlhf_lit.parallel.collectives import global_sum
from rlhf_lit.rl.guard import rollout_importance

__all__ = ["FilterSettings", "RolloutFilters", "Shaped", "apply_filters"]


@dataclass
class FilterSettings:
    """The collector's settings of the family: ``ppo.tis_level`` / ``ppo.tis_mode`` (resolved; with
    ``RolloutSettings.tis_cap``), ``ppo.mask_truncated_completions``, ``ppo.dynamic_sampling``."""

    tis_level: str = "token"
    tis_mode: str = "truncate"
    mask_truncated: bool = False
    dynamic_sampling: bool = False


@dataclass
class RolloutFilters:
    """The family's decisions on one rollout.

    Attributes:
        overlong: ``(B,)`` the overlong penalties added to the scores (``reward.overlong_buffer``), else None.
        truncated_masked: ``(B,)`` bool, responses left out of the loss for reaching ``max_new_tokens`` without a
            stop token (``ppo.mask_truncated_completions``), else None.
        filtered: ``(B,)`` bool, responses of groups whose scores are all equal, left out of the loss
            (``ppo.dynamic_sampling``), else None; ``filtered_groups`` their groups in the GLOBAL batch (with a
            refill, ``ppo.dynamic_sampling_max_rounds``: the loader's batch's, before any extra round).
        rounds: with ``ppo.dynamic_sampling_max_rounds > 0``, the extra rounds of prompts sampled this iteration
            (``rl.dynamic_sampling``; the same on every rank), else None; ``unfilled_groups`` the filtered groups
            still in the rollout after them, GLOBAL (the cap was hit; they weigh 0).
        is_affected: ``(B, R)`` bool where the rollout importance ratio passed ``ppo.tis_cap`` (capped or
            masked), else None; ``is_level`` ``ppo.tis_level``.
    """

    overlong: torch.Tensor | None = None
    truncated_masked: torch.Tensor | None = None
    filtered: torch.Tensor | None = None
    filtered_groups: int = 0
    rounds: int | None = None
    unfilled_groups: int = 0
    is_affected: torch.Tensor | None = None
    is_level: str = "token"

    def kept(self, finite: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool: the responses that enter the loss, those with a finite score less the left-out ones."""
        kept = finite
        for dropped in (self.truncated_masked, self.filtered):
            if dropped is not None:
                kept = kept & ~dropped
        return kept


class Shaped(NamedTuple):
    """:func:`apply_filters`' result: ``scores`` ``(B,)`` shaped, ``is_weights`` ``(B, R)`` or None, ``filters``."""

    scores: torch.Tensor
    is_weights: torch.Tensor | None
    filters: RolloutFilters


def apply_filters(collector, raw_scores, finite, has_stop, response_ids, response_mask, old_logprobs) -> Shaped:
    """The shaped scores (``collector.shaper``: the missing-EOS and overlong penalties, normalisation, clipping),
    the rollout importance weights and the left-out responses of a scored rollout (the module docstring).

    Args:
        collector: the ``RolloutCollector`` (its ``settings``: ``tis_cap``, ``filters``, ``num_samples_per_prompt``;
            its ``sampler``, whose ``last_record`` holds its log-probs; ``shaper``; ``world()`` for the global
            count of filtered groups: every rank calls this together).
        raw_scores: ``(B,)`` as the reward function returned them; finite, has_stop ``(B,)`` bool.
        response_ids, response_mask, old_logprobs: ``(B, R)``.
    """
    s, f = collector.settings, collector.settings.filters
    scores = collector.shaper(raw_scores, finite, has_stop, response_mask.sum(-1))
    filters = RolloutFilters(overlong=collector.shaper.overlong(response_mask.sum(-1)), is_level=f.tis_level)
    if f.mask_truncated:
        filters.truncated_masked = ~has_stop
    if f.dynamic_sampling:  # DAPO: groups of equal scores carry no signal
        filters.filtered = zero_variance_groups(scores, s.num_samples_per_prompt, finite)
        groups = filters.filtered.float().sum() / s.num_samples_per_prompt
        filters.filtered_groups = int(round(float(global_sum(collector.world(), groups))))
    is_weights = None
    if s.tis_cap is not None:
        is_weights, filters.is_affected = rollout_importance(
            collector.sampler, response_ids, response_mask, old_logprobs, s.tis_cap, f.tis_level, f.tis_mode
        )
    return Shaped(scores, is_weights, filters)
