"""Length-controlled reward modelling: terms that keep a reward model from scoring length.

A reward model trained on preference data where the chosen response is usually the longer one learns length
(Singhal et al. 2023, "A Long Way to Go: Investigating Length Correlations in RLHF"). Three remedies, each a
pure function here and a switch of ``RewardModule``:

* :func:`length_balance_weights`: per-pair loss weights so that the pairs whose chosen response is longer and
  those whose chosen response is shorter weigh the same in a batch (the length balancing of the preference
  data that Singhal et al. 2023 try, done as re-weighting within a batch instead of re-sampling the data);
* :func:`pearson_correlation` of the scores with the response lengths over the batch, whose absolute value
  is a decorrelation penalty (the ``|rho(r_Q, L)|`` term of the length loss of Chen et al. 2024, "ODIN:
  Disentangled Reward Mitigates Hacking in RLHF", applied here to a single head);
* :func:`head_orthogonality`: ODIN's orthogonality loss ``|W_Q^T W_L|`` between its quality head and its
  length head (the length head's own term is ``-rho(r_L, L)``, again :func:`pearson_correlation`).

Notation: B pairs; ``len_chosen``, ``len_rejected`` ``(B,)`` response lengths (tokens); ``scores`` and
``lengths`` ``(M,)`` over the M = 2B responses of a batch.
"""

from __future__ import annotations

import torch


def length_balance_weights(len_chosen: torch.Tensor, len_rejected: torch.Tensor) -> torch.Tensor:
    """``(B,)`` float weights giving the chosen-longer and the chosen-shorter pairs the same total weight.

    With ``n_L`` pairs whose chosen response is longer and ``n_S`` shorter, those pairs get
    ``(n_L + n_S) / (2 n_L)`` and ``(n_L + n_S) / (2 n_S)``: each group then weighs ``(n_L + n_S) / 2`` and the
    weights still sum to B. Pairs of equal lengths keep weight 1. When either group is empty nothing can be
    balanced and every weight is 1.

    Example: lengths (10, 5), (8, 4), (6, 3), (2, 9): n_L = 3, n_S = 1 -> [2/3, 2/3, 2/3, 2] (sum 4).
    """
    longer, shorter = len_chosen > len_rejected, len_chosen < len_rejected
    n_longer, n_shorter = int(longer.sum()), int(shorter.sum())
    weights = torch.ones(len_chosen.shape, dtype=torch.float32, device=len_chosen.device)
    if n_longer == 0 or n_shorter == 0:
        return weights
    both = n_longer + n_shorter
    weights = torch.where(longer, torch.full_like(weights, both / (2 * n_longer)), weights)
    return torch.where(shorter, torch.full_like(weights, both / (2 * n_shorter)), weights)


def pearson_correlation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of ``(M,)`` x and y, differentiable in both: ``sum(dx * dy) / sqrt(sum(dx^2) *
    sum(dy^2))`` with ``d`` the deviation from the mean. 0 (with zero gradient) when either side is constant
    or M < 2.

    Example: x = [1, 2, 3], y = [2, 4, 7]: dx = [-1, 0, 1], dy = [-2.333, -0.333, 2.667];
    sum(dx dy) = 5, sum(dx^2) = 2, sum(dy^2) = 12.667 -> 5 / sqrt(25.333) = 0.9934.
    """
    x, y = x.float().flatten(), y.float().flatten()
    if x.numel() < 2:
        return x.sum() * 0.0
    dx, dy = x - x.mean(), y - y.mean()
    sxx, syy = (dx * dx).sum(), (dy * dy).sum()
    constant = (sxx <= 0) | (syy <= 0)
    denominator = torch.where(constant, torch.ones_like(sxx), sxx * syy).sqrt()
    return torch.where(constant, torch.zeros_like(sxx), (dx * dy).sum() / denominator)


def head_orthogonality(quality_weight: torch.Tensor, length_weight: torch.Tensor) -> torch.Tensor:
    """``|w_Q . w_L|`` of two linear heads' ``(1, H)`` (or ``(H,)``) weights: ODIN's orthogonality loss
    (Chen et al. 2024), 0 when the two heads read orthogonal directions of the pooled state.

    Example: [1, 2, 0] and [2, -1, 5]: |2 - 2 + 0| = 0; [1, 2, 0] and [1, 1, 1]: 3.
    """
    return (quality_weight.flatten().float() * length_weight.flatten().float()).sum().abs()
