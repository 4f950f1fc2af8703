"""The 2025 policy-gradient family: pieces that GSPO, DAPO, CISPO and their peers add to the clipped update.

Each is one pure function here; ``rlhf_lit.rl`` wires it to a ``ppo.*`` / ``reward.*`` setting (docs/ppo.md,
"The policy-gradient family"):

* :func:`importance_log_ratio`: the log importance ratio per token at the token level (PPO), at the sequence
  level (GSPO: the length-normalised sequence ratio) or GSPO-token's (the sequence ratio's value, each
  token's own gradient);
* :func:`cispo_policy_loss`: CISPO's loss, a REINFORCE term weighted by the clipped, stop-gradient ratio;
* :func:`top_entropy_mask`: the highest-entropy fraction of the response tokens ("Beyond the 80/20 Rule");
* :func:`overlong_penalty`: DAPO's soft overlong punishment;
* :func:`zero_variance_groups`: DAPO's dynamic-sampling filter (groups whose rewards are all equal);
* :func:`refill_order`: which groups of several sampling rounds make the batch when dynamic sampling refills it;
* :func:`rollout_is_weights`: importance weights of the sampler / trainer mismatch at the token or sequence
  level, truncated or masked.

Notation: B responses, R response positions; ``mask`` ``(B, R)`` True on the tokens that enter the loss.
Log-probabilities in nats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from rlhf_lit.functional.masked import masked_mean, masked_weighted_mean

__all__ = [
    "IS_LEVELS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "cispo_policy_loss",
    "importance_log_ratio",
    "overlong_penalty",
    "refill_order",
    "rollout_is_weights",
    "top_entropy_mask",
    "zero_variance_groups",
]

IS_LEVELS = ("token", "sequence", "sequence_token")
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_IS_MODES = ("truncate", "mask")


def importance_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """``(B, R)`` log importance ratio of each token, 0 off the mask.

    * ``token``: ``logp_t - old_t`` (PPO; Schulman et al. 2017).
    * ``sequence``: ``log s_i = mean over the response's tokens of (logp_t - old_t)`` on every token of response
      i: the length-normalised sequence ratio ``s_i = (pi(y_i) / pi_old(y_i)) ^ (1 / |y_i|)`` of GSPO (Zheng et
      al. 2025, "Group Sequence Policy Optimization", eq. 7); the gradient flows through every token's log-prob
      with weight ``1 / |y_i|``.
    * ``sequence_token``: GSPO-token (ibid., eq. 13): ``sg[log s_i] + logp_t - sg[logp_t]``: the value of
      ``log s_i`` on each token, the gradient of ``logp_t`` alone (so the ratio ``sg[s_i] pi(y_t) / sg[pi(y_t)]``
      equals ``s_i`` with its own token's gradient).

    E.g. ``logp - old = [[0.2, -0.4, x]]`` with mask ``[[1, 1, 0]]``: token ``[[0.2, -0.4, 0]]``; sequence and
    sequence_token ``[[-0.1, -0.1, 0]]`` (``(0.2 - 0.4) / 2``). A row with no masked token has ratio 1 (log 0).

    Args:
        logprobs: ``(B, R)`` current log-probs (with grad).
        old_logprobs: ``(B, R)`` log-probs at rollout time (no grad).
        mask: ``(B, R)`` bool or 0/1.
        level: one of :data:`IS_LEVELS`.

    Raises:
        ValueError: an unknown level.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {level!r}")
    mask = mask.bool()
    token = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    if level == "token":
        return token
    count = mask.sum(-1, keepdim=True).clamp(min=1).to(token.dtype)
    seq = token.sum(-1, keepdim=True) / count  # (B, 1)
    if level == "sequence":
        out = seq.expand_as(token)
    else:
        out = seq.detach() + logprobs - logprobs.detach()
    return torch.where(mask, out, torch.zeros_like(out))


def cispo_policy_loss(
    log_ratio: Tensor,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    weights: Tensor | None = None,
    is_weights: Tensor | None = None,
    token_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", eq. 4): per token ``-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t *
    logp_t``: the importance weight is clipped and carries no gradient, so no token loses its gradient (the
    clipped PPO surrogate zeroes the gradient of clipped tokens); the gradient is ``-clip(r) A grad logp``,
    PPO's at ``r = 1``.

    E.g. eps_low = eps_high = 0.2: (r 1.5, A +1, logp -1) -> -1.2 * 1 * -1 = 1.2, gradient -1.2 w.r.t. logp;
    (r 0.5, A -1, logp -2) -> -0.8 * -1 * -2 = -1.6, gradient 0.8.

    Args:
        log_ratio: ``(B, R)`` log importance ratio (:func:`importance_log_ratio`); only its value is used.
        logprobs: ``(B, R)`` current log-probs (with grad): the REINFORCE term.
        advantages: ``(B, R)``.
        mask: ``(B, R)`` bool or 0/1, the loss's tokens.
        clip_low, clip_high: ``eps_low^IS``, ``eps_high^IS`` > 0.
        weights: ``(B, R)`` the loss aggregation's token weights (``masked_weighted_mean``); None = token mean.
        is_weights: ``(B, R)`` rollout importance weights multiplying each token's term (no grad), or None.
        token_mask: ``(B, R)`` bool, the tokens whose term counts (:func:`top_entropy_mask`); the others count
            0 without leaving the aggregation's denominator. None = all.

    Returns:
        ``(loss, stats)``: 0-dim loss; detached token means over ``mask``: ``clipfrac_low`` (``r < 1 - eps_low``),
        ``clipfrac_high`` (``r > 1 + eps_high``), ``clipfrac`` (their sum), ``approx_kl`` (``(r - 1) - log r``),
        ``ratio_mean``, ``dual_clipfrac`` (0).

    Raises:
        ValueError: a clip range <= 0.
    """
    if clip_low <= 0 or clip_high <= 0:
        raise ValueError(f"CISPO's clip ranges must be > 0, got {clip_low}, {clip_high}")
    mask = mask.bool()
    with torch.no_grad():
        log_ratio = torch.where(mask, log_ratio.detach(), torch.zeros_like(log_ratio))
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    safe_logp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    per_token = -weight * advantages * safe_logp
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    if token_mask is not None:
        per_token = per_token * token_mask.to(per_token.dtype)
    loss = masked_weighted_mean(per_token, mask, weights)
    with torch.no_grad():
        low, high = (ratio < 1.0 - clip_low).float(), (ratio > 1.0 + clip_high).float()
        stats = {
            "clipfrac_low": masked_mean(low, mask),
            "clipfrac_high": masked_mean(high, mask),
            "clipfrac": masked_mean(low + high, mask),
            "dual_clipfrac": torch.zeros((), dtype=ratio.dtype, device=ratio.device),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """``(B, R)`` bool: the masked tokens whose entropy is at least the ``1 - quantile`` quantile of the masked
    tokens' entropies (linear interpolation, ``torch.quantile``): the top-``quantile`` highest-entropy "forking"
    tokens, on which Wang et al. 2025 ("Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
    RLVR", s. 4) keep the policy gradient (their 20%: ``quantile = 0.2``). ``quantile = 1`` returns ``mask``.

    E.g. entropies ``[[0.1, 0.5, 0.9], [0.3, 7.0, 0.0]]``, mask ``[[1, 1, 1], [1, 0, 0]]``, quantile 0.5: the
    masked entropies sorted are 0.1, 0.3, 0.5, 0.9; their 0.5 quantile is 0.4 (halfway between 0.3 and 0.5),
    so ``[[0, 1, 1], [0, 0, 0]]``. No masked token: all False.

    Args:
        entropy: ``(B, R)`` per-token entropies (nats); read without gradient.
        mask: ``(B, R)`` bool or 0/1.
        quantile: the kept fraction, in ``(0, 1]``.

    Raises:
        ValueError: ``quantile`` outside ``(0, 1]``.
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must lie in (0, 1], got {quantile}")
    mask = mask.bool()
    if quantile == 1.0 or not bool(mask.any()):
        return mask.clone()
    with torch.no_grad():
        values = entropy.detach().float()
        threshold = torch.quantile(values[mask], 1.0 - quantile)
        return mask & (values >= threshold)


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """``(B,)`` DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), ``<= 0``, added to the score:

    ``0`` for ``L <= L_max - L_cache``; ``penalty * ((L_max - L_cache) - L) / L_cache`` inside the window;
    ``-penalty`` at ``L_max`` (responses cannot be longer here: ``L_max = max_new_tokens``), with ``L_cache =
    buffer``. E.g. ``L_max = 10``, buffer 4, penalty 2: lengths 6, 7, 9, 10 -> 0, -0.5, -1.5, -2.

    Args:
        lengths: ``(B,)`` response lengths in tokens.
        max_new_tokens: ``L_max`` >= 1.
        buffer: ``L_cache``, in ``[1, max_new_tokens]``.
        penalty: the punishment at ``L_max`` (>= 0; DAPO: 1).

    Raises:
        ValueError: a buffer outside ``[1, max_new_tokens]`` or a negative penalty.
    """
    if not 1 <= buffer <= max_new_tokens:
        raise ValueError(f"overlong_buffer must lie in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    if penalty < 0:
        raise ValueError(f"overlong_penalty must be >= 0, got {penalty}")
    start = max_new_tokens - buffer
    over = (lengths.float() - start).clamp(min=0.0, max=float(buffer))
    return -penalty * over / buffer


def zero_variance_groups(scores: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """``(B,)`` bool: the responses of groups whose valid scores are all equal (fewer than two valid scores
    included): such a group's relative advantages are all 0, so it carries no signal; DAPO's dynamic sampling
    drops it (Yu et al. 2025, s. 3.2, eq. 11's ``0 < |{o_i : is_equivalent(a, o_i)}| < G``). Groups are
    ``group_size`` consecutive rows.

    E.g. scores ``[1, 1, 0, 1, 2, 2]``, group_size 2: ``[1, 1, 0, 0, 1, 1]``; with ``valid`` False on row 2 the
    second group has one valid score: ``[1, 1, 1, 1, 1, 1]``.

    Raises:
        ValueError: ``group_size < 2`` or ``B`` not a multiple of it.
    """
    if group_size < 2:
        raise ValueError(f"dynamic sampling needs groups of >= 2 responses, got {group_size}")
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(f"{tuple(scores.shape)} scores do not split into groups of {group_size}")
    v = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    s = scores.double().view(-1, group_size)
    v = v.view(-1, group_size)
    high = torch.where(v, s, -math.inf).amax(-1)
    low = torch.where(v, s, math.inf).amin(-1)
    flat = (v.sum(-1) < 2) | (high == low)
    return flat.repeat_interleave(group_size)


def refill_order(flat: Sequence[Tensor], num_groups: int) -> tuple[Tensor, Tensor]:
    """The groups that make a batch of ``num_groups`` when dynamic sampling draws more rounds of prompts (DAPO,
    Yu et al. 2025, Algorithm 1: sample until the batch holds enough groups with signal): ``(round, group)``
    index pairs, first every informative group (``flat`` False) in round order then group order, then, when
    they are fewer than ``num_groups`` (the cap on rounds was hit), flat groups in the same order to fill the
    batch (they stay out of the loss). Extra informative groups of the last round are left out.

    Args:
        flat: per round r, ``(G_r,)`` bool, True for a group whose scores are all equal
            (:func:`zero_variance_groups`' value on the group's rows).
        num_groups: G, the batch's groups; at most ``sum_r G_r``.

    Returns:
        ``(rounds, groups)``, each ``(G,)`` long. E.g. rounds ``[F, T, T]`` and ``[T, F, F]``, G = 3:
        ``rounds = [0, 1, 1]``, ``groups = [0, 1, 2]``; rounds ``[F, T, T]`` and ``[T, T, F]``: the informative
        (0, 0) and (1, 2), then the first flat one (0, 1): ``[0, 1, 0]``, ``[0, 2, 1]``.

    Raises:
        ValueError: no round, or fewer groups in all rounds than ``num_groups``.
    """
    if not flat:
        raise ValueError("refill_order needs at least one round")
    flags = torch.cat([f.bool().flatten().cpu() for f in flat])
    if flags.numel() < num_groups:
        raise ValueError(f"refill_order: {flags.numel()} groups in all rounds, fewer than the {num_groups} asked")
    rounds = torch.cat([torch.full((f.numel(),), r, dtype=torch.long) for r, f in enumerate(flat)])
    groups = torch.cat([torch.arange(f.numel()) for f in flat])
    order = torch.cat([(~flags).nonzero().flatten(), flags.nonzero().flatten()])[:num_groups]
    return rounds[order], groups[order]


def rollout_is_weights(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    known: Tensor,
    mask: Tensor,
    cap: float,
    level: str = "token",
    mode: str = "truncate",
) -> tuple[Tensor, Tensor]:
    """Importance weights of a sampler that is not the trainer, ``(weights, affected)``, both ``(B, R)``.

    The ratio is ``pi_trainer / pi_sampler`` per token (``token``) or its product over the response's tokens
    (``sequence``: ``exp(sum_t (trainer_t - sampler_t))`` on every token of the response). ``truncate`` caps
    it at ``cap`` (TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training"); ``mask`` keeps it where it is at most ``cap`` and sets it to 0 above (the token or the whole
    response leaves the loss: masked importance sampling, veRL's ``rollout_is_mode: mask``). ``affected`` is
    True where the cap bound (capped or masked). Tokens where the sampler's log-prob is not ``known`` have
    ratio 1; positions off ``mask`` have weight 1 and are never affected.

    E.g. trainer - sampler = ``[[ln 3, ln 0.5], [ln 1.5, ln 1.8]]``, cap 2: token truncate ``[[2, 0.5], [1.5,
    1.8]]`` (affected ``[[1, 0], [0, 0]]``); token mask ``[[0, 0.5], [1.5, 1.8]]``; sequence (ratios 1.5 and 2.7)
    truncate ``[[1.5, 1.5], [2, 2]]`` (row 1 affected), mask ``[[1.5, 1.5], [0, 0]]``.

    Args:
        trainer_logprobs, sampler_logprobs: ``(B, R)`` nats (the rollout's old log-probs; the sampler's).
        known: ``(B, R)`` bool, the sampler's log-prob is known there.
        mask: ``(B, R)`` bool, the response's tokens.
        cap: ``C >= 1``.
        level: ``token`` or ``sequence``; mode: ``truncate`` or ``mask``.

    Returns:
        ``(weights, affected)``: float32 detached weights in ``[0, cap]``; bool.

    Raises:
        ValueError: ``cap < 1``, an unknown level or mode, or shapes that differ.
    """
    if cap < 1.0:
        raise ValueError(f"the rollout importance-sampling cap must be >= 1, got {cap}")
    if level not in ROLLOUT_IS_LEVELS or mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"level must be one of {ROLLOUT_IS_LEVELS} and mode one of {ROLLOUT_IS_MODES}")
    if not (trainer_logprobs.shape == sampler_logprobs.shape == known.shape == mask.shape):
        raise ValueError("trainer_logprobs, sampler_logprobs, known and mask must have one shape")
    with torch.no_grad():
        mask = mask.bool()
        use = known.bool() & mask
        log_ratio = torch.where(use, trainer_logprobs.double() - sampler_logprobs.double(), 0.0)
        if level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        log_cap = math.log(cap)
        affected = (log_ratio > log_cap) & mask
        if mode == "truncate":
            weights = torch.exp(log_ratio.clamp(max=log_cap))
        else:
            weights = torch.where(affected, 0.0, torch.exp(log_ratio.clamp(max=log_cap)))
        weights = torch.where(mask, weights, 1.0)
        return weights.float(), affected
