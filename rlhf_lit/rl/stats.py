"""The metrics of one PPO iteration (step 7): what the rollout, the estimator and the update measured.

Names and units are those of :mod:`rlhf_lit.metrics`. Under several processes every figure is over the
GLOBAL batch (see :func:`global_stats`), so rank 0's logs describe the whole run.
"""

from __future__ import annotations

import torch

from rlhf_lit import metrics as M
from rlhf_lit.functional.advantages import explained_variance
from rlhf_lit.functional.kl import kl_per_token
from rlhf_lit.functional.masked import masked_mean
from rlhf_lit.parallel.collectives import gather, global_mean, global_sum, is_distributed
from rlhf_lit.rl.estimators import Advantages
from rlhf_lit.rl.rollout import Rollout

__all__ = [
    "all_stats",
    "correlation",
    "global_kl_per_response",
    "global_stats",
    "iteration_stats",
    "peak_memory",
    "perf_stats",
]


def iteration_stats(rollout: Rollout, adv: Advantages, has_stop_token: bool, distributed: bool) -> dict:
    """This rank's rollout / advantage / critic statistics (means over sequences, or over update tokens
    of all ranks where ``distributed``), before :func:`global_stats`."""
    r, mask, update_mask = rollout, rollout.response_mask, rollout.update_mask
    finite = r.finite
    stats = {
        M.ROLLOUT_SCORE_MEAN: r.raw_scores[finite].mean(),
        M.ROLLOUT_SCORE_STD: r.raw_scores[finite].std(unbiased=False),
        M.ROLLOUT_KL_REF: (r.kl * mask).sum(-1).mean(),
        M.ROLLOUT_KL_ESTIMATOR.format(estimator="k1"): ((r.old_logprobs - r.ref_logprobs) * mask)
        .sum(-1)
        .mean(),
        M.ROLLOUT_KL_ESTIMATOR.format(estimator="k3"): (
            kl_per_token(r.old_logprobs, r.ref_logprobs, "k3") * mask
        )
        .sum(-1)
        .mean(),
        M.ROLLOUT_NON_SCORE_REWARD: adv.non_score_rewards.sum(-1).mean(),
        M.ROLLOUT_RESPONSE_LEN: mask.sum(-1).float().mean(),
        M.ROLLOUT_NO_EOS_FRAC: (~r.has_stop).float().mean() if has_stop_token else torch.tensor(1.0),
        M.PPO_ADVANTAGE_MEAN: adv.raw_advantage_mean,
    }
    if adv.returns is not None:
        stats[M.PPO_RETURN_MEAN] = masked_mean(adv.returns, update_mask, distributed=distributed)
    if r.old_values is not None:
        stats[M.CRITIC_VALUE_MEAN] = masked_mean(r.old_values, update_mask, distributed=distributed)
        if adv.returns is not None:
            stats[M.CRITIC_EXPLAINED_VARIANCE] = explained_variance(r.old_values, adv.returns, update_mask)
    for name, scores in r.reward_components.items():
        stats[M.ROLLOUT_SOURCE_SCORE.format(name=name)] = scores[finite].mean()
    stats[M.MONITOR_REF_PERPLEXITY] = torch.exp(
        -masked_mean(r.ref_logprobs, update_mask, distributed=distributed)
    )
    if r.is_weights is not None:  # ppo.tis_cap: token means over the update tokens of every rank
        stats[M.ROLLOUT_TIS_WEIGHT] = masked_mean(r.is_weights, update_mask, distributed=distributed)
        if r.filters.is_level == "sequence":  # the share of responses (with an update token) whose ratio the cap bound
            rows = update_mask.any(-1)
            hit = r.filters.is_affected.any(-1).float()
            stats[M.ROLLOUT_TIS_CAPPED_FRAC] = masked_mean(hit, rows, distributed=distributed)
        else:
            hit = r.filters.is_affected.float()
            stats[M.ROLLOUT_TIS_CAPPED_FRAC] = masked_mean(hit, update_mask, distributed=distributed)
    f = r.filters
    if f.overlong is not None:  # reward.overlong_buffer: means over the responses
        stats[M.ROLLOUT_OVERLONG_FRAC] = (f.overlong < 0).float().mean()
        stats[M.ROLLOUT_OVERLONG_PENALTY] = f.overlong.float().mean()
    if f.truncated_masked is not None:  # ppo.mask_truncated_completions
        stats[M.ROLLOUT_TRUNCATED_MASKED_FRAC] = f.truncated_masked.float().mean()
    return stats


def global_stats(trainer, stats: dict, rollout: Rollout) -> dict:
    """The iteration's statistics over all ranks (one all-reduce and two all-gathers), for rank 0's logs.

    Every rank holds the same number of sequences, so the mean over ranks of a per-sequence mean is the
    global mean; token means (advantages, returns, values) are already global (``distributed=True``); the
    losses and clip fractions of the update are weighted so that their mean over ranks is the token mean of
    the global minibatch; the score's mean and std and its correlation with the response length come from
    all scores (all-gather). Only ``critic/explained_variance`` is a mean of per-rank values.
    """
    raw_scores, finite = rollout.raw_scores, rollout.finite
    response_len = rollout.response_mask.sum(-1)
    if not is_distributed(trainer):
        return {**stats, M.MONITOR_SCORE_LENGTH_CORR: correlation(raw_scores[finite], response_len[finite])}
    keys = list(stats)
    values = torch.stack([torch.as_tensor(stats[k], dtype=torch.float64).detach().cpu() for k in keys])
    values = global_mean(trainer, values.to(raw_scores.device)).cpu()
    out = dict(zip(keys, values.unbind()))
    scores = gather(trainer, raw_scores).flatten().double()
    kept = torch.isfinite(scores)  # dropped responses (reward.skip_non_finite) are not scores
    scores = scores[kept]
    out[M.ROLLOUT_SCORE_MEAN] = scores.mean()
    out[M.ROLLOUT_SCORE_STD] = scores.std(unbiased=False)
    lengths = gather(trainer, response_len).flatten()[kept]
    out[M.MONITOR_SCORE_LENGTH_CORR] = correlation(scores, lengths)
    return out


def correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of two (N,) series; 0 when either is constant (no linear relation to report)."""
    both = torch.stack([x.detach().double().flatten(), y.detach().double().flatten()])
    if both.shape[1] < 2 or bool((both.std(dim=1) == 0).any()):
        return torch.tensor(0.0, dtype=torch.float64)
    return torch.corrcoef(both)[0, 1]


def all_stats(
    trainer, rollout: Rollout, adv: Advantages, update_stats: dict, has_stop_token: bool, times
) -> dict:
    """Every figure of an iteration but its number, KL coefficient and peak memory: :func:`iteration_stats`
    and the update's statistics over all ranks (:func:`global_stats`), the non-finite count, and
    :func:`perf_stats` of the four ``time.perf_counter()`` marks ``times``."""
    stats = iteration_stats(rollout, adv, has_stop_token, is_distributed(trainer))
    stats = global_stats(trainer, {**stats, **update_stats}, rollout)
    stats[M.ROLLOUT_NON_FINITE_SCORES] = float(rollout.num_non_finite)
    if rollout.filters.filtered is not None:  # ppo.dynamic_sampling: already a global count
        stats[M.ROLLOUT_FILTERED_GROUPS] = float(rollout.filters.filtered_groups)
    if rollout.filters.rounds is not None:  # ppo.dynamic_sampling_max_rounds: global counts
        stats[M.ROLLOUT_DYNAMIC_SAMPLING_ROUNDS] = float(rollout.filters.rounds)
        stats[M.ROLLOUT_UNFILLED_GROUPS] = float(rollout.filters.unfilled_groups)
    stats.update(rollout.sampler_stats)  # the rollout-policy guard's, already global (rl.guard)
    sampled = rollout.sampled_tokens if rollout.sampled_tokens is not None else rollout.response_ids.numel()
    stats.update(perf_stats(times, sampled))
    return stats


def peak_memory(peak_mb: float) -> dict:
    """``{perf/peak_memory_mb: peak_mb}`` (MiB)."""
    return {M.PERF_PEAK_MEMORY_MB: peak_mb}


def perf_stats(
    times: tuple[float, float, float, float], response_tokens: int, peak_mb: float | None = None
) -> dict:
    """``perf/*`` of an iteration from its four ``time.perf_counter()`` marks: start, after sampling, after
    the advantages, after the update (seconds per phase), generation tokens per second, and peak memory
    (MiB) when given."""
    t0, t1, t2, t3 = times
    out = {
        M.PERF_GENERATION_S: t1 - t0,
        M.PERF_EXPERIENCE_S: t2 - t1,
        M.PERF_UPDATE_S: t3 - t2,
        M.PERF_ITERATION_S: t3 - t0,
        M.PERF_GENERATION_TOKENS_PER_S: response_tokens / max(t1 - t0, 1e-9),
    }
    return out if peak_mb is None else {**out, M.PERF_PEAK_MEMORY_MB: peak_mb}


def global_kl_per_response(trainer, rollout: Rollout) -> tuple[float, int]:
    """``(mean KL per response, number of responses)`` over the GLOBAL batch: the KL controller's input
    (nats; the configured estimator, summed over each response's tokens)."""
    seq_kl = (rollout.kl * rollout.response_mask).sum(-1)
    num_sequences = global_sum(trainer, torch.tensor(float(seq_kl.numel()), device=seq_kl.device))
    return float(global_sum(trainer, seq_kl.detach().sum()) / num_sequences), int(num_sequences)
