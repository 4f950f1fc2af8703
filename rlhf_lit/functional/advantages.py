"""Generalised advantage estimation over padded token sequences, and the critic's fit.

Notation:
    B batch size, R response length; t indexes response tokens (actions).
    rewards r_t, values V_t, mask m_t: (B, R); m_t True = a real response token.
    gamma: discount, gae_lambda: GAE lambda.

GAE (Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", eq. 16, truncated at the end of the episode):
    delta_t = r_t + gamma * V_{t+1} - V_t          with V = 0 after the last real token
    A_t     = delta_t + gamma * gae_lambda * A_{t+1}
    returns = A + V                                   (the critic's regression target, TD(lambda))

Where this departs from the textbook recursion: padding positions are *skipped*, not treated as
steps. A padded position contributes no reward and no value, and the recursion carries A and V
across it to the previous real token (so an interior or left-padded mask works too). Whatever the
critic outputs at a padded slot (9.9, 100, 1e6, nan) cannot change a real token's advantage
(docs/pitfalls.md: GAE over padding). ``gae`` does not whiten; ``masked_whiten`` does, as a separate step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_lit.functional.masked import masked_var

__all__ = ["gae", "explained_variance"]


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, gae_lambda: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimates and returns, skipping padding.

    The loop runs backwards over R with (B,)-shaped tensor operations; no gradient is needed
    (call it on detached rollout tensors).

    Args:
        rewards: (B, R) per-token rewards (``shaped_rewards``), 0 on padding.
        values: (B, R) critic values of the same positions as the actions; padded entries ignored.
        mask: (B, R) bool or 0/1, True = real response token.
        gamma: Discount factor in [0, 1].
        gae_lambda: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, both (B, R), 0 at padded positions; float32 (float64 if an
        input is float64), so bf16 critic outputs are accumulated in float32.
        E.g. rewards ``[-0.02, 0.01, 0.95, 0]``, values ``[0.5, 0.4, 0.6, pad]``, gamma 1,
        lambda 0.95 -> advantages ``[0.395375, 0.5425, 0.35, 0]`` (docs/pitfalls.md: GAE over padding).

    Raises:
        ValueError: If the shapes differ or gamma / gae_lambda lie outside [0, 1].
    """
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must all be (B, R); got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= gae_lambda <= 1.0):
        raise ValueError(f"gamma and gae_lambda must lie in [0, 1]; got {gamma}, {gae_lambda}")
    mask = mask.bool()
    dtype = torch.promote_types(torch.promote_types(values.dtype, rewards.dtype), torch.float32)
    rewards, values = rewards.to(dtype), values.to(dtype)
    zero = torch.zeros_like(values[:, 0])
    next_value, next_advantage = zero, zero  # V_{t+1} and A_{t+1} of the next *real* token
    columns = []
    for t in reversed(range(values.shape[1])):
        real = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = torch.where(real, delta + gamma * gae_lambda * next_advantage, zero)
        next_advantage = torch.where(real, advantage, next_advantage)
        next_value = torch.where(real, values[:, t], next_value)
        columns.append(advantage)
    advantages = torch.stack(columns[::-1], dim=1) if columns else torch.zeros_like(values)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """How much of the return's variance the critic explains: ``1 - Var(R - V) / Var(R)``.

    Over real tokens only. 1 is a perfect critic, 0 is no better than a constant, negative is worse
    than a constant (the usual PPO diagnostic, as logged by CleanRL and OpenAI baselines).

    Args:
        values: (B, R) critic values.
        returns: (B, R) GAE returns (``gae``).
        mask: (B, R) bool or 0/1, True = real token.

    Returns:
        0-dim float tensor. By our convention it is 0 when ``Var(returns) == 0`` (including fewer
        than two real tokens), where the ratio is undefined; baselines returns NaN there instead.
    """
    var_returns = masked_var(returns.double(), mask)
    var_error = masked_var((returns - values).double(), mask)
    safe = var_returns.clamp(min=torch.finfo(torch.float64).tiny)
    ev = torch.where(var_returns > 0, 1.0 - var_error / safe, torch.zeros_like(var_returns))
    return ev.to(values.dtype)
