"""The rollout-policy guard: is the sampler the policy being trained?

A sampler that draws from stale weights (an inference engine the new adapter never reached) or from the base
(adapters off) leaves every loss finite and the exit code 0 while PPO learns from off-policy data. On every
iteration, after sampling and before the first update, :func:`check_sampler` compares two things the sampler
recorded while it sampled (``Sampler.last_record``, a :class:`~rlhf_lit.rl.sampler.SampleRecord`) with the
trainer's view of the same moment:

1. the log-prob of each drawn token under the scores it was drawn from against the rollout's ``old_logprobs``
   (``rlhf_lit.functional.sampler_gap.logprob_gap``): ``rollout/sampler_logprob_gap`` (mean over the real
   response tokens of every rank) and ``rollout/sampler_logprob_gap_max``, nats per token;
2. the :func:`~rlhf_lit.rl.sampler.adapter_fingerprint` of the actor adapter weights that sampled against
   the policy's now.

A gap above ``sampling.logprob_gap_tolerance`` or a fingerprint mismatch logs a warning, or with
``sampling.strict_sync`` raises :class:`~rlhf_lit.errors.SamplerSyncError`. Every rank takes the same decision
(the figures are global), so no rank waits in a collective for one that stopped.
"""

from __future__ import annotations

import logging

import torch

from rlhf_lit import metrics as M
from rlhf_lit.errors import SamplerSyncError
from rlhf_lit.functional.policy_gradient import rollout_is_weights
from rlhf_lit.functional.sampler_gap import logprob_gap
from rlhf_lit.parallel.collectives import gather, global_sum, is_distributed
from rlhf_lit.rl.sampler import adapter_fingerprint

log = logging.getLogger("rlhf_lit")

__all__ = ["check_sampler", "local_gap", "rollout_importance", "sampler_logprobs"]


def check_sampler(
    sampler,
    policy,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    settings,
    iteration: int = 0,
    trainer=None,
) -> dict[str, float]:
    """The guard's figures for one iteration: ``{rollout/sampler_logprob_gap, ..._max}`` (empty when no rank's
    sampler reported log-probs); warns or raises as the module docstring says. A collective under several
    processes: every rank calls it.

    Args:
        sampler: the :class:`~rlhf_lit.rl.sampler.Sampler` that drew the rollout; its ``last_record`` is read
            (absent or None: nothing to compare on this rank).
        policy: the ``ActorCritic`` being trained; its actor adapter's fingerprint now (no update has run
            since sampling) is compared with the record's.
        response_ids: ``(B, R)`` long, the rollout's responses.
        response_mask: ``(B, R)`` bool, their real tokens.
        old_logprobs: ``(B, R)`` the trainer's log-probs of them at the sampling temperature (nats).
        settings: ``gap_tolerance(precision)`` (nats per token, on the mean, for the trainer's precision) and
            ``strict_sync`` (``RolloutSettings``, from ``sampling.*``).
        iteration: the 0-based iteration, for the message.
        trainer: the Lightning trainer (collectives), or None.

    Raises:
        SamplerSyncError: when the guard fires and ``strict_sync`` is set.
    """
    precision = getattr(trainer, "precision", None)
    record, tolerance = getattr(sampler, "last_record", None), settings.gap_tolerance(precision)
    policy_fingerprint = adapter_fingerprint(policy.actor_parameters())
    gap_sum, count, gap_max = local_gap(record, response_ids, response_mask, old_logprobs)
    stale = record is not None and record.fingerprint is not None and record.fingerprint != policy_fingerprint
    totals = torch.stack(
        [gap_sum, count, torch.tensor(float(stale), dtype=torch.float64, device=count.device)]
    )
    if is_distributed(trainer):
        totals = global_sum(trainer, totals)
        gap_max = gather(trainer, gap_max.reshape(1)).max()
    gap_sum, count, num_stale = (float(x) for x in totals)
    stats = {}
    if count > 0:
        stats = {
            M.ROLLOUT_SAMPLER_LOGPROB_GAP: gap_sum / count,
            M.ROLLOUT_SAMPLER_LOGPROB_GAP_MAX: float(gap_max),
        }
    problems = []
    if num_stale:
        where = "" if not is_distributed(trainer) else f" on {int(num_stale)} rank(s)"
        mine = f" (here {record.fingerprint} vs {policy_fingerprint})" if stale else ""
        problems.append(f"the actor adapter weights that sampled are not the policy's{where}{mine}")
    if count > 0 and stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP] > tolerance:
        problems.append(
            f"mean |sampler log-prob - trainer log-prob| = {stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP]:.3g} nats per "
            f"token (max {stats[M.ROLLOUT_SAMPLER_LOGPROB_GAP_MAX]:.3g}) > sampling.logprob_gap_tolerance="
            f"{tolerance:g}"
        )
    if problems:
        message = (
            f"PPO iteration {iteration + 1}: the sampler is not the policy being trained: "
            + "; ".join(problems)
            + ". A stale sampler learns from off-policy data: check that the sampler receives every update "
            "(Sampler.sync); a bf16 sampler differs from a float32 trainer by ~0.03 nats per token on SmolLM2-135M, and "
            "sampling.min_new_tokens > 0 widens the gap (stop tokens are suppressed while sampling only)"
        )
        if settings.strict_sync:
            raise SamplerSyncError(message)
        if trainer is None or getattr(trainer, "is_global_zero", True):
            log.warning("%s (sampling.strict_sync: true stops the run instead)", message)
    return stats


def sampler_logprobs(
    record, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The record's log-probs laid over the rollout's responses: ``(logprobs, known)``, each ``(B, R)``;
    ``known`` is True on the real response tokens that are still the tokens the sampler drew (a wrapper of a
    sampler may edit some) and that it recorded; ``logprobs`` is 0 elsewhere. All False when the record holds
    no log-probs for these rows."""
    logprobs = torch.zeros(response_ids.shape, dtype=torch.float32, device=response_ids.device)
    known = torch.zeros(response_ids.shape, dtype=torch.bool, device=response_ids.device)
    if record is None or record.logprobs is None or record.logprobs.shape[0] != response_ids.shape[0]:
        return logprobs, known
    width = min(record.logprobs.shape[1], response_ids.shape[1])
    drawn = record.response_ids[:, :width].to(response_ids.device)
    known[:, :width] = response_mask[:, :width] & (drawn == response_ids[:, :width])
    logprobs[:, :width] = record.logprobs[:, :width].to(response_ids.device, torch.float32)
    return logprobs, known


def local_gap(
    record, response_ids: torch.Tensor, response_mask: torch.Tensor, old_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logprob_gap``'s ``(sum, count, max)`` on this rank: the record's log-probs against ``old_logprobs`` on
    the tokens :func:`sampler_logprobs` knows; zeros when the record holds no log-probs for these rows."""
    logprobs, known = sampler_logprobs(record, response_ids, response_mask)
    return logprob_gap(logprobs.to(old_logprobs.device), old_logprobs, known.to(old_logprobs.device))


def rollout_importance(
    sampler,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    old_logprobs: torch.Tensor,
    cap: float,
    level: str = "token",
    mode: str = "truncate",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, affected)`` ``(B, R)``: the rollout importance weights of the policy loss (``ppo.tis_cap``,
    ``ppo.tis_level``, ``ppo.tis_mode``; ``functional.policy_gradient.rollout_is_weights``) from the log-probs the
    sampler recorded (ratio 1 where it recorded none), and where the cap bound."""
    drawn, known = sampler_logprobs(getattr(sampler, "last_record", None), response_ids, response_mask)
    device = old_logprobs.device
    return rollout_is_weights(
        old_logprobs, drawn.to(device), known.to(device), response_mask.bool(), cap, level, mode
    )

