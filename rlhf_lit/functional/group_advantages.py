"""Critic-free advantages: group-relative (GRPO, Dr.GRPO), leave-one-out (RLOO) and REINFORCE++ returns.

Notation:
    B sequences = G groups x n samples; a group is the n responses to one prompt, in CONSECUTIVE rows
    (rows ``g * n .. g * n + n - 1``). r_i: (B,) sequence rewards; valid: (B,) bool, False = a response left
    out of the update (a non-finite score), which neither gets an advantage nor enters its group's statistics.
    R response length; rewards r_t, mask m_t: (B, R), m_t True = a real response token.

Sources:
    GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1.2, outcome supervision):
        A_i = (r_i - mean(r_group)) / std(r_group), the same for every token of response i.
    Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", section 3.1):
        A_i = r_i - mean(r_group): no division by the group's std (its question-difficulty bias).
    RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs", eq. 7 / section 3.3):
        A_i = r_i - 1 / (n - 1) * sum_{j != i} r_j = n / (n - 1) * (r_i - mean(r_group)).
    REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", section 3): token returns G_t = sum_{s >= t} gamma^(s - t) r_s of the KL-shaped token rewards,
    then normalised over the global batch (``masked_whiten``, a separate step, as for GAE).

Where this departs from the papers: the std of GRPO is the unbiased (n - 1) one, with ``eps`` added to it
(the paper does not say which; TRL and OpenRLHF use the same); a group with fewer than two valid responses
has no baseline and gets advantage 0 (nothing is learnt from it).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_relative_advantages", "leave_one_out_advantages", "discounted_returns", "token_advantages"]


def _groups(scores: Tensor, group_size: int, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(r, v)``: scores (float64) and validity as ``(G, n)``, invalid scores set to 0."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be (B,), got {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(f"a group estimator needs group_size >= 2 samples per prompt, got {group_size}")
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    v = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    if v.shape != scores.shape:
        raise ValueError(f"valid must be shaped like scores {tuple(scores.shape)}, got {tuple(v.shape)}")
    r = torch.where(v, scores.double(), 0.0)
    return r.view(-1, group_size), v.view(-1, group_size)


def group_relative_advantages(
    scores: Tensor,
    group_size: int,
    scale_by_std: bool = True,
    valid: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO's group-normalised outcome advantage, or Dr.GRPO's mean-centred one (``scale_by_std=False``).

    Args:
        scores: (B,) sequence rewards, B = G x group_size, groups in consecutive rows.
        group_size: n >= 2, responses per prompt.
        scale_by_std: divide by the group's unbiased std plus ``eps`` (GRPO); False = Dr.GRPO.
        valid: (B,) bool, responses that take part (default all).
        eps: added to the std, so a group of equal rewards gives 0, not nan.

    Returns:
        (B,) advantages in the dtype of ``scores``; 0 for invalid responses and for groups with fewer than
        two valid ones. E.g. one group ``[1, 2, 3, 6]``: mean 3, std sqrt(14 / 3) = 2.1602 ->
        ``[-0.9258, -0.4629, 0, 1.3887]``; Dr.GRPO ``[-2, -1, 0, 3]``.

    Raises:
        ValueError: if ``scores`` is not (B,), ``group_size < 2`` or B is not a multiple of it.
    """
    r, v = _groups(scores, group_size, valid)
    count = v.sum(-1, keepdim=True).double()
    mean = r.sum(-1, keepdim=True) / count.clamp(min=1.0)
    centred = torch.where(v, r - mean, 0.0)
    if scale_by_std:
        var = (centred**2).sum(-1, keepdim=True) / (count - 1.0).clamp(min=1.0)
        centred = centred / (var.sqrt() + eps)
    advantages = torch.where(count >= 2, centred, 0.0)
    return advantages.flatten().to(scores.dtype)


def leave_one_out_advantages(scores: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """RLOO: each response's reward minus the mean reward of the other valid responses of its group.

    Args:
        scores: (B,) sequence rewards, B = G x group_size, groups in consecutive rows.
        group_size: n >= 2.
        valid: (B,) bool, responses that take part (default all).

    Returns:
        (B,) advantages in the dtype of ``scores``; 0 for invalid responses and groups with fewer than two
        valid ones. E.g. ``[1, 2, 3, 6]`` -> ``[1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2] = [-8/3, -4/3, 0, 4]``.

    Raises:
        ValueError: as :func:`group_relative_advantages`.
    """
    r, v = _groups(scores, group_size, valid)
    count = v.sum(-1, keepdim=True).double()
    others = (r.sum(-1, keepdim=True) - r) / (count - 1.0).clamp(min=1.0)
    advantages = torch.where(v & (count >= 2), r - others, 0.0)
    return advantages.flatten().to(scores.dtype)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go over real tokens: ``G_t = r_t + gamma * G_{t+1}``, padding skipped (REINFORCE++).

    Args:
        rewards: (B, R) token rewards (``shaped_rewards``: ``-kl_coef * KL_t``, plus the score on the last
            real token), 0 on padding.
        mask: (B, R) bool or 0/1, True = real response token.
        gamma: discount in [0, 1].

    Returns:
        (B, R) returns, 0 on padding, float32 or wider. E.g. rewards ``[-0.02, 0.01, 0.95, pad]``,
        gamma 1 -> ``[0.94, 0.96, 0.95, 0]``.

    Raises:
        ValueError: if the shapes differ or gamma lies outside [0, 1].
    """
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(f"rewards and mask must be (B, R); got {tuple(rewards.shape)}, {tuple(mask.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    mask = mask.bool()
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    running = torch.zeros_like(rewards[:, 0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        columns.append(torch.where(mask[:, t], running, torch.zeros_like(running)))
    return torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(rewards)


def token_advantages(sequence_advantages: Tensor, mask: Tensor) -> Tensor:
    """(B, R): each response's (B,) advantage on every one of its real tokens, 0 on padding."""
    return torch.where(mask.bool(), sequence_advantages.unsqueeze(-1), 0.0).to(sequence_advantages.dtype)
