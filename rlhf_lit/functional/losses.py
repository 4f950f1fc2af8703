"""Losses of the three stages: reward-model pairwise loss, SFT NLL, PPO policy and value losses.

Notation:
    B batch size, T sequence length (prompt + response), R response length, V vocabulary size.
    mask: (B, R) bool or 0/1, True = a real response token.
    ratio = exp(logprobs - old_logprobs), the PPO importance ratio per token.
    eps = clip_range, c = dual_clip.
    Losses are to be minimised; log-probs and entropies are in nats.

PPO losses are token-level means over all real tokens of the minibatch (not a mean of per-sequence
means), as in the lm-human-preferences and TRL implementations; the paper's objective (Schulman et
al. 2017) is a mean over timesteps of a single-sequence rollout buffer, to which this reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lit.functional.masked import masked_mean, masked_weighted_mean
from rlhf_lit.functional.policy_gradient import importance_log_ratio
from rlhf_lit.functional.sequence import chunk_views, gather_logprobs, scaled_piece
from rlhf_lit.ranges import LABEL_SMOOTHING, check_value

__all__ = ["bt_pairwise_loss", "sft_nll", "ppo_policy_loss", "ppo_value_loss", "entropy_from_logits"]


def bt_pairwise_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    margin: Tensor | float | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Bradley–Terry negative log-likelihood that the chosen response beats the rejected one.

    ``d = r_chosen - r_rejected - margin``;
    ``loss = -(1 - s) * log sigmoid(d) - s * log sigmoid(-d)`` with ``s = label_smoothing``.
    Bradley & Terry 1952; Ouyang et al. 2022, eq. 1 (per pair, without the 1/C(K,2) weighting);
    the margin is that of Llama 2 (Touvron et al. 2023, eq. 2); the smoothing treats each label as
    wrong with probability ``s`` (conservative / robust label smoothing). Equal rewards give ln 2.

    Args:
        chosen_rewards: (B,) scalar rewards of the preferred responses.
        rejected_rewards: (B,) scalar rewards of the other responses.
        margin: (B,) or scalar required gap (>= 0 usually), or None for no margin.
        label_smoothing: s in [0, 0.5) (``rlhf_lit.ranges.LABEL_SMOOTHING``).

    Returns:
        (B,) per-pair loss in nats (the caller takes the mean). Decreasing in ``d`` when s = 0; with
        s > 0 it equals ``softplus(-d) + s * d``, smallest at ``d = ln((1 - s) / s)``, so confident
        margins beyond that are pulled back.

    Raises:
        ValueError: If the shapes differ or ``label_smoothing`` lies outside [0, 0.5).
    """
    if chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(
            f"chosen {tuple(chosen_rewards.shape)} and rejected {tuple(rejected_rewards.shape)} differ"
        )
    check_value("label_smoothing", label_smoothing, LABEL_SMOOTHING)
    d = chosen_rewards - rejected_rewards
    if margin is not None:
        d = d - margin
    loss = -F.logsigmoid(d)
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-d)
    return loss


def sft_nll(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> tuple[Tensor, int]:
    """Mean next-token negative log-likelihood over the label tokens of a batch.

    The function shifts: ``labels[:, i]`` is predicted by ``logits[:, i - 1]``. Log-probs come from
    ``gather_logprobs`` (float32, no full log-softmax copy).

    Args:
        logits: (B, T, V) model logits on ``input_ids``.
        labels: (B, T) long, aligned with ``input_ids``; ``ignore_index`` marks prompt and padding.
        ignore_index: Label value that carries no loss.

    Returns:
        ``(loss, num_tokens)``: 0-dim float32 loss in nats per token (mean over every label token of
        the batch, not a mean of row means) and the number of label tokens as an int.

    Raises:
        ValueError: If shapes disagree or the batch has no label token (docs/pitfalls.md: SFT labels: a batch whose
            labels are all ``ignore_index`` means the prompt/response boundary was lost).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + (V,)")
    targets = labels[:, 1:]
    real = targets != ignore_index
    num_tokens = int(real.sum())
    if num_tokens == 0:
        raise ValueError("sft_nll: the batch has no label tokens (every label is ignore_index)")
    safe_targets = torch.where(real, targets, torch.zeros_like(targets))
    logprobs = gather_logprobs(logits[:, :-1], safe_targets)
    nll = -torch.where(real, logprobs, torch.zeros_like(logprobs)).sum() / num_tokens
    return nll, num_tokens


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_range: float,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
    is_weights: Tensor | None = None,
    clip_range_high: float | None = None,
    importance_sampling_level: str = "token",
    token_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss, optionally dual-clipped, asymmetric, or on the sequence ratio.

    Per token ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))`` (Schulman et al. 2017, eq. 7,
    negated to a loss). With ``dual_clip = c > 1``, tokens with ``A < 0`` are further capped at
    ``-c * A`` so a huge ratio cannot produce an unbounded loss (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games with Deep RL", AAAI 2020, dual-clip PPO). E.g. eps 0.2: (ratio 1.5, A +1) -> -1.2,
    (0.5, -1) -> +0.8, (0.5, +1) -> -0.5 (docs/pitfalls.md: value positions). ``clip_range_high``: DAPO's
    clip-higher (Yu et al. 2025, eq. 10). The ratio's level: ``policy_gradient.importance_log_ratio`` (GSPO).

    Args:
        logprobs: (B, R) log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: (B, R) log-probs at rollout time (no grad).
        advantages: (B, R) advantages, usually whitened.
        mask: (B, R) bool or 0/1, True = real response token.
        clip_range: eps > 0.
        dual_clip: c > 1, or None to disable.
        weights: (B, R) token weights of the loss (``masked_weighted_mean``; the loss aggregation); None =
            the token mean. The statistics are token means either way.
        is_weights: (B, R) importance-sampling weights (no grad) multiplying each token's clipped term (a
            sampler that is not the trainer: ``policy_gradient.rollout_is_weights``); None = 1. Stats ignore them.
        clip_range_high: the upper epsilon (> 0); None = ``clip_range``.
        importance_sampling_level: ``token`` (PPO), ``sequence`` (GSPO) or ``sequence_token`` (GSPO-token).
        token_mask: ``(B, R)`` bool, the tokens whose term counts (``top_entropy_mask``; 0 elsewhere). None = all.

    Returns:
        ``(loss, stats)``: 0-dim loss, the token-level masked mean (weighted by ``weights``). ``stats`` holds detached 0-dim
        tensors: ``clipfrac`` = fraction of real tokens where the clipped term binds (it is strictly
        larger than the unclipped one, so the token's gradient is zero; TRL's definition) = ``clipfrac_low``
        (ratio < 1) + ``clipfrac_high`` (ratio > 1);
        ``dual_clipfrac`` = fraction where the dual clip binds (0 without it); ``approx_kl`` =
        mean of ``(ratio - 1) - log(ratio)``, the k3 estimate of KL(old || new) in nats per token;
        ``ratio_mean``.

    Raises:
        ValueError: If ``clip_range <= 0``, ``clip_range_high <= 0``, ``dual_clip <= 1`` or an unknown level.
    """
    high = clip_range if clip_range_high is None else clip_range_high
    if clip_range <= 0 or high <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range} (high {high})")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}")
    mask = mask.bool()
    log_ratio = importance_log_ratio(logprobs, old_logprobs, mask, importance_sampling_level)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    dual_bound = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_bound = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_bound, cap, per_token)
    for factor in (is_weights, token_mask):  # importance weights, the entropy mask: no gradient
        if factor is not None:
            per_token = per_token * factor.detach().to(per_token.dtype)
    loss = masked_weighted_mean(per_token, mask, weights)
    with torch.no_grad():
        binds, low = clipped > unclipped, ratio < 1.0
        stats = {
            "clipfrac": masked_mean(binds.float(), mask),
            "clipfrac_low": masked_mean((binds & low).float(), mask),
            "clipfrac_high": masked_mean((binds & ~low).float(), mask),
            "dual_clipfrac": masked_mean(dual_bound.float(), mask),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    value_clip_range: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic regression loss with optional PPO2-style value clipping.

    ``0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))`` over real tokens, the
    OpenAI baselines PPO2 convention (max, not min). Value clipping is not in Schulman et al. 2017;
    it comes from the baselines code. Without ``value_clip_range``: ``0.5 * mean((V - R)^2)``.
    E.g. R 10, V_old 5, V 1, c 0.2 -> 0.5 * max(81, 27.04) = 40.5 (docs/pitfalls.md: value positions).

    Args:
        values: (B, R) current critic values (with grad).
        old_values: (B, R) critic values cached at rollout time (not recomputed).
        returns: (B, R) GAE returns.
        mask: (B, R) bool or 0/1, True = real response token.
        value_clip_range: c > 0, or None to disable.
        weights: (B, R) token weights (``masked_weighted_mean``); None = the token mean.

    Returns:
        ``(loss, stats)``: 0-dim loss (squared return units); ``stats["value_clipfrac"]`` is the
        detached fraction of real tokens with ``|V - V_old| > c``, measured before clipping
        (0 without clipping).

    Raises:
        ValueError: If ``value_clip_range <= 0``.
    """
    mask = mask.bool()
    per_token = (values - returns).square()
    clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    if value_clip_range is not None:
        if value_clip_range <= 0:
            raise ValueError(f"value_clip_range must be > 0, got {value_clip_range}")
        change = values - old_values
        clipped_values = old_values + torch.clamp(change, -value_clip_range, value_clip_range)
        per_token = torch.maximum(per_token, (clipped_values - returns).square())
        clipfrac = masked_mean((change.abs() > value_clip_range).to(values.dtype), mask)
    loss = 0.5 * masked_weighted_mean(per_token, mask, weights)
    return loss, {"value_clipfrac": clipfrac.detach()}


class _ChunkedEntropy(torch.autograd.Function):
    """``H = log s - sum_v e_v z_v / s`` with ``z = logits / T - max``, ``e = exp(z)``, ``s = sum_v e_v``
    (= ``-sum_v p_v log p_v``), piece by piece; the backward recomputes the softmax piece by piece.

    Saves only the logits (already alive) and the (B, R) entropies; holds two float32 temporaries of one
    piece at a time (``sum_v e_v z_v`` needs ``z`` and ``exp(z)`` together), freed before the next piece is
    made. A -inf logit (probability 0) contributes 0, not 0 * inf.
    """

    @staticmethod
    def forward(ctx, logits, temperature, pieces):
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        lowest = torch.finfo(compute_dtype).min
        out = torch.empty(logits.shape[:-1], dtype=compute_dtype, device=logits.device)
        lse = torch.empty_like(out)
        for rows, cols in pieces:
            z, own = scaled_piece(logits[rows, cols], temperature, compute_dtype)
            peak = z.amax(dim=-1, keepdim=True)
            z = (z.sub_(peak) if own else z - peak).clamp_(min=lowest)  # temporary 1
            e = z.exp()  # temporary 2
            total = e.sum(dim=-1)
            weighted = e.mul_(z).sum(dim=-1)
            log_total = total.log()
            out[rows, cols] = log_total - weighted / total
            lse[rows, cols] = log_total + peak.squeeze(-1)
            del z, e, peak, total, weighted, log_total  # freed before the next piece is made
        ctx.save_for_backward(logits, out, lse)
        ctx.temperature, ctx.pieces = temperature, pieces
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        # with z = x / T and p = softmax(z): dH/dz_v = -p_v (log p_v + H), so dH/dx_v = -p_v (log p_v + H) / T
        logits, entropy, lse = ctx.saved_tensors
        T = ctx.temperature
        lowest = torch.finfo(lse.dtype).min
        grad = torch.empty_like(logits)
        for rows, cols in ctx.pieces:
            z, own = scaled_piece(logits[rows, cols], T, lse.dtype)
            shift = lse[rows, cols].unsqueeze(-1)
            logp = (z.sub_(shift) if own else z - shift).clamp_(min=lowest)  # temporary 1
            p = logp.exp()  # temporary 2
            logp.add_(entropy[rows, cols].unsqueeze(-1)).mul_(p)
            del p  # temporary 2 is no longer needed: free it before the scaling and the copy
            grad[rows, cols] = logp.mul_(grad_out[rows, cols].unsqueeze(-1).to(lse.dtype) * (-1.0 / T))
            del z, logp  # freed before the next piece is made
        return grad, None, None


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position, in nats.

    ``H = -sum_v p_v log p_v``, computed in float32 piece by piece over the positions
    (``rlhf_lit.functional.sequence.chunk_views``), with ``0 log 0 = 0``. Like ``gather_logprobs`` it never
    materialises a second (B, R, V) tensor: two float32 temporaries of one piece are alive at a time, and
    the backward (a custom autograd function) recomputes the softmax instead of keeping it.

    Args:
        logits: (B, R, V) logits; any strides.
        temperature: T > 0, the sampling temperature.
        chunk_size: Batch rows per piece; None (the default) picks pieces of a few positions
            (``chunk_views``). The extra memory is two float32 pieces plus the (B, R) results, in the forward
            and again on top of the logits' gradient in the backward: under 7% of one float32 (B, R, V)
            tensor once it holds 8 MiB, B * R >= 32 and V >= 1024, and never above 32 MiB plus the (B, R)
            results. With rows, a piece is one float32 tensor of shape (chunk_size, R, V).

    Returns:
        (B, R) entropies in nats, in [0, log V]; float32 (float64 for float64 logits);
        differentiable.

    Raises:
        ValueError: If ``temperature <= 0`` or ``chunk_size < 1``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, R, V), got shape {tuple(logits.shape)}")
    return _ChunkedEntropy.apply(logits, float(temperature), chunk_views(logits.shape, chunk_size))
