"""Per-token KL estimates between policy and reference, and the shaped PPO token rewards.

Notation:
    B batch size, R response length.
    logprobs, ref_logprobs: (B, R) natural-log probabilities of the *sampled* tokens under the
        policy (at rollout time) and under the frozen reference, both at the sampling temperature.
    log_ratio = logprobs - ref_logprobs; KL values are in nats per token.
    beta = kl_coef.

Estimators of KL(policy || reference) from one sample x ~ policy (Schulman 2020, "Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html), with r = ref_prob / policy_prob:
    k1 = -log r = log_ratio                       unbiased, can be negative on a single token
    k2 = 0.5 * (log r)^2                          biased, >= 0, low variance
    k3 = (r - 1) - log r                          unbiased, >= 0
    abs = |log r|                                 not an estimator of KL; a >= 0 penalty
All four are exactly 0 when policy == reference.

The log-ratio is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` = [-20, 20] nats before any estimator
is applied (verl clamps its k3 input to the same range): a token the reference finds e^-100 times less
likely than the policy would otherwise give k3 = e^100 (inf in float32) and poison every reward, advantage
and weight downstream. A per-token log-ratio of 20 nats is already far outside any healthy run (a whole
response's KL budget is a few nats), so the clamp changes nothing there; a NaN stays NaN (it is an error
upstream, not a large number).

Token rewards (Ziegler et al. 2019, eq. 2; Ouyang et al. 2022, eq. 2): ``r_t = -beta * KL_t`` on
every real response token, plus the sequence score on the last real token; padding gets 0. The papers
write the penalty for the whole sequence; spreading it over tokens follows OpenAI's
lm-human-preferences code, which the PPO implementations in the field copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_lit.functional.sequence import last_real_index

__all__ = ["KL_ESTIMATORS", "LOG_RATIO_CLAMP", "kl_per_token", "shaped_rewards"]

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
LOG_RATIO_CLAMP = 20.0  # nats per token; see the module docstring


def kl_per_token(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str = "k1",
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP,
) -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    Args:
        logprobs: (B, R) policy log-probs of the sampled tokens, nats.
        ref_logprobs: (B, R) reference log-probs of the same tokens, nats.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"`` (see the module docstring).
        log_ratio_clamp: clamp ``logprobs - ref_logprobs`` to ``[-c, c]`` nats first (default 20, so
            every estimate is finite: k3 <= e^20 - 21 ~ 4.9e8); None disables the clamp.

    Returns:
        (B, R) KL estimate in nats per token. Padded positions are not masked here (the caller
        masks); e.g. policy ``[-1, -2]``, reference ``[-1.5, -1]``: k1 ``[0.5, -1]``,
        k3 ``[0.106531, 0.718282]`` (docs/pitfalls.md: KL estimators); log-ratio -100: k1 -20, k3 e^20 - 21.

    Raises:
        ValueError: If ``estimator`` is unknown, the shapes differ or ``log_ratio_clamp <= 0``.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"shape mismatch: logprobs {tuple(logprobs.shape)} vs ref {tuple(ref_logprobs.shape)}"
        )
    if log_ratio_clamp is not None and log_ratio_clamp <= 0:
        raise ValueError(f"log_ratio_clamp must be > 0, got {log_ratio_clamp}")
    log_ratio = logprobs - ref_logprobs
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # exp(ref - logp) - 1 - (ref - logp); expm1 keeps precision when the ratio is near 1
        return torch.expm1(-log_ratio) + log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def shaped_rewards(
    scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Per-token PPO rewards: KL penalty on every real token plus the score on the last one.

    Args:
        scores: (B,) sequence scores from the reward model (already normalised/clipped if wanted).
        kl: (B, R) per-token KL estimate in nats (``kl_per_token``); values at padding are ignored,
            even if non-finite.
        mask: (B, R) bool or 0/1, True = real response token (left or right padding).
        kl_coef: beta >= 0, the KL penalty coefficient (float or 0-dim tensor).

    Returns:
        ``(rewards, non_score_rewards)``, both (B, R) in the dtype of ``kl``:
        ``non_score_rewards = -kl_coef * kl`` on real tokens and 0 on padding (negative where the
        policy is more likely than the reference under k1); ``rewards`` adds ``scores`` at
        ``last_real_index(mask)``, e.g. KL ``[0.2, -0.1, 0.5, pad]``, beta 0.1, score 1 ->
        ``[-0.02, 0.01, 0.95, 0]`` (docs/pitfalls.md: score slot, GAE over padding).

    Raises:
        ValueError: If shapes disagree or a row has no real token.
    """
    if kl.shape != mask.shape or scores.shape != kl.shape[:1]:
        raise ValueError(
            f"expected scores (B,), kl and mask (B, R); got {tuple(scores.shape)}, "
            f"{tuple(kl.shape)}, {tuple(mask.shape)}"
        )
    mask = mask.bool()
    non_score = torch.where(mask, -kl_coef * kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    last = last_real_index(mask).unsqueeze(-1)
    rewards = non_score.scatter_add(-1, last, scores.to(non_score.dtype).unsqueeze(-1))
    return rewards, non_score
