"""Direct preference losses without RL: DPO and its variants on pairs, KTO on unpaired completions.

Notation:
    B batch size (pairs, or unpaired completions for KTO), T sequence length, V vocabulary size.
    ``*_logps``: per-sequence log-probabilities SUMMED over the response tokens (nats), ``(B,)``.
    ``*_lengths``: number of response tokens of each sequence (EOS included), ``(B,)``.
    h: the preference log-ratio ``(logp_c - ref_c) - (logp_r - ref_r)`` (nats).

Every loss acts on a margin ``m = r_c - r_r`` of implicit rewards (``implicit_rewards``): ``m = beta * h``
for ``sigmoid``, ``label_smoothing``, ``robust`` and ``hinge``; per-token averaged log-ratios for ``ipo``;
``beta`` times the average log-prob (no reference) for ``simpo``. The rewards are what TRL logs as
``rewards/chosen`` and ``rewards/rejected`` for the same loss. Per-pair losses are returned ``(B,)``; the
caller takes the mean. Pure functions: nothing is edited in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lit.functional.sequence import gather_logprobs, length_groups
from rlhf_lit.ranges import BETA, LABEL_SMOOTHING, check_value

__all__ = [
    "LOSS_TYPES",
    "PAIRED_LOSS_TYPES",
    "REFERENCE_FREE_LOSS_TYPES",
    "chosen_nll",
    "dpo_loss",
    "implicit_rewards",
    "kto_loss",
    "preference_loss",
    "response_logps",
    "response_logps_from_hidden",
    "response_logps_in_length_groups",
    "response_scoring_mask",
    "reward_accuracy",
]

LossType = Literal["sigmoid", "ipo", "robust", "label_smoothing", "hinge", "simpo", "kto"]
PAIRED_LOSS_TYPES = ("sigmoid", "ipo", "robust", "label_smoothing", "hinge", "simpo")
LOSS_TYPES = (*PAIRED_LOSS_TYPES, "kto")
#: Losses that use no reference model (their rewards come from the policy alone).
REFERENCE_FREE_LOSS_TYPES = ("simpo",)


def response_scoring_mask(prompt_len: Tensor, response_len: Tensor, T: int) -> Tensor:
    """``(B, T - 1)`` bool: True at the logit positions that score a response token.

    Rows are right padded, each with its own prompt length: row ``b`` holds ``P_b`` prompt tokens, then
    ``R_b`` response tokens, then padding. Token ``x[i]`` gets its log-prob from the logits at ``i - 1``
    (docs/layout.md), so the response tokens ``P_b .. P_b + R_b - 1`` are scored by logits ``P_b - 1 ..
    P_b + R_b - 2``; entry ``j`` of the mask is True when token ``j + 1`` is a response token.
    E.g. ``P = [2], R = [2], T = 5``: tokens 2, 3 are the response, so ``[False, True, True, False]``.

    Raises:
        ValueError: if a row has no prompt token, no response token, or overflows T.
    """
    if (
        bool((prompt_len < 1).any())
        or bool((response_len < 1).any())
        or bool((prompt_len + response_len > T).any())
    ):
        raise ValueError("every row needs >= 1 prompt token and >= 1 response token within the T columns")
    token_index = torch.arange(1, T, device=prompt_len.device)[None, :]
    return (token_index >= prompt_len[:, None]) & (token_index < (prompt_len + response_len)[:, None])


def response_logps(
    logits: Tensor, input_ids: Tensor, prompt_len: Tensor, response_len: Tensor
) -> tuple[Tensor, Tensor]:
    """Summed log-probabilities of each row's response tokens, read at the right positions
    (``response_scoring_mask``); prompt and padding positions contribute nothing.

    Args:
        logits: ``(B, T, V)`` model outputs for ``input_ids``.
        input_ids: ``(B, T)`` long.
        prompt_len: ``(B,)`` long, ``P_b >= 1``.
        response_len: ``(B,)`` long, ``R_b >= 1`` and ``P_b + R_b <= T``.

    Returns:
        ``(logps, num_tokens)``: ``(B,)`` float32 sums in nats (<= 0) and ``(B,)`` long counts ``R_b``.

    Raises:
        ValueError: if shapes disagree or a row has no prompt token, no response token, or overflows T.
    """
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be input_ids {tuple(input_ids.shape)} + (V,)")
    mask = response_scoring_mask(prompt_len, response_len, input_ids.shape[1])
    token_logps = gather_logprobs(logits[:, :-1], input_ids[:, 1:])  # (B, T-1): entry j scores token j+1
    logps = torch.where(mask, token_logps, torch.zeros_like(token_logps)).sum(-1)
    return logps, response_len.long()


def response_logps_from_hidden(
    hidden: Tensor, head: Callable[[Tensor], Tensor], input_ids: Tensor, prompt_len: Tensor, response_len: Tensor
) -> Tensor:
    """``response_logps`` from the last hidden states, making vocabulary logits for response positions only.

    The ``N = sum_b R_b`` hidden states that score a response token (``response_scoring_mask``) are
    packed into one ``(N, H)`` tensor and only they go through ``head``: the ``(B, T, V)`` logits of
    prompts and padding are never made, nor their gradient. With DPO's long prompts and a 50k vocabulary
    that tensor and its gradient are most of a step's memory. Equal to ``response_logps(head(hidden), ...)``
    up to float summation order.

    Args:
        hidden: ``(B, T, H)`` last-layer hidden states for ``input_ids``.
        head: maps ``(N, H)`` hidden states to ``(N, V)`` logits (the LM head).
        input_ids: ``(B, T)`` long.
        prompt_len: ``(B,)`` long, ``P_b >= 1``.
        response_len: ``(B,)`` long, ``R_b >= 1`` and ``P_b + R_b <= T``.

    Returns:
        ``(B,)`` float32 sums in nats (<= 0).

    Raises:
        ValueError: if shapes disagree or a row has no prompt token, no response token, or overflows T.
    """
    if hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be input_ids {tuple(input_ids.shape)} + (H,)")
    mask = response_scoring_mask(prompt_len, response_len, input_ids.shape[1])
    return summed_token_logps(hidden[:, :-1][mask], head, input_ids[:, 1:][mask], mask.nonzero()[:, 0], mask.shape[0])


def summed_token_logps(
    scoring_hidden: Tensor, head: Callable[[Tensor], Tensor], targets: Tensor, rows: Tensor, num_rows: int
) -> Tensor:
    """``(num_rows,)`` per-row sums of ``log softmax(head(h))[target]`` over ``N`` scoring positions: ``scoring_hidden``
    ``(N, H)``, ``targets`` ``(N,)`` the tokens they score, ``rows`` ``(N,)`` the row each belongs to. Shared by the
    padded (``response_logps_from_hidden``) and packed (``functional.packing.response_logps_packed``) paths."""
    token_logps = gather_logprobs(head(scoring_hidden)[None], targets[None])[0]  # (N,)
    return torch.zeros(num_rows, dtype=token_logps.dtype, device=token_logps.device).index_add(0, rows, token_logps)


def response_logps_in_length_groups(
    trunk: Callable[[Tensor, Tensor], Tensor],
    head: Callable[[Tensor], Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: Tensor,
    response_len: Tensor,
) -> Tensor:
    """``response_logps_from_hidden`` with the trunk run once per ``length_groups`` group of rows, each group
    cut to its longest row, so padding beyond a group's own width never goes through the model.

    Rows are right padded, so cutting trailing columns changes no real token's hidden state (causal
    attention; positions come from the mask); the values equal one padded forward's up to float summation
    order. A batch of preference pairs is often half padding (HH-RLHF at 256 tokens: 33-67% real tokens per
    batch of 16 rows), which costs activation memory and time in the policy's forward and backward.

    Args:
        trunk: ``(input_ids, attention_mask)`` ``(b, t)`` -> last hidden states ``(b, t, H)``.
        head: the LM head, ``(N, H)`` -> ``(N, V)``.
        input_ids, attention_mask: ``(B, T)``, right padded.
        prompt_len, response_len: ``(B,)`` long, as in ``response_logps_from_hidden``.

    Returns:
        ``(B,)`` float32 sums in nats (<= 0), in the batch's row order; differentiable.

    Raises:
        ValueError: as ``response_logps_from_hidden``.
    """
    lengths = prompt_len + response_len
    groups = length_groups(lengths)
    parts = []
    for rows in groups:
        width = int(lengths[rows].max())
        ids = input_ids[rows, :width]
        hidden = trunk(ids, attention_mask[rows, :width])
        parts.append(response_logps_from_hidden(hidden, head, ids, prompt_len[rows], response_len[rows]))
    return torch.cat(parts)[torch.argsort(torch.cat(groups))]


def _check_beta(beta: float) -> None:
    check_value("beta", beta, BETA)


def implicit_rewards(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    beta: float,
    loss_type: LossType = "sigmoid",
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The implicit rewards ``(r_c, r_r)``, each ``(B,)``, whose difference the loss acts on.

    * ``sigmoid`` / ``label_smoothing`` / ``robust`` / ``hinge``: ``beta * (logp - ref_logp)`` on summed
      log-probs (Rafailov et al. 2023, eq. 5: the reward the policy implies, up to a prompt-only term).
    * ``ipo``: ``beta * (logp - ref_logp) / length``: per-token averaged log-ratios, as Azar et al. 2023 define
      them (TRL averages the same way for ``ipo``).
    * ``simpo``: ``beta * logp / length``, reference-free (Meng et al. 2024, eq. 4); the reference arguments
      may be None and are ignored.

    Raises:
        ValueError: if ``beta <= 0``, a length-normalised loss gets no lengths (or a length < 1), or a loss
            that needs the reference gets None.
    """
    _check_beta(beta)
    if loss_type in ("ipo", "simpo"):
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                f"loss_type {loss_type!r} averages per token: give chosen_lengths and rejected_lengths"
            )
        if bool((chosen_lengths < 1).any()) or bool((rejected_lengths < 1).any()):
            raise ValueError("every response needs at least one token to be averaged over")
    if loss_type == "simpo":
        return (
            beta * policy_chosen_logps / chosen_lengths,
            beta * policy_rejected_logps / rejected_lengths,
        )
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"loss_type {loss_type!r} needs the reference log-probs")
    chosen = policy_chosen_logps - ref_chosen_logps
    rejected = policy_rejected_logps - ref_rejected_logps
    if loss_type == "ipo":
        chosen, rejected = chosen / chosen_lengths, rejected / rejected_lengths
    return beta * chosen, beta * rejected


def preference_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    beta: float,
    loss_type: LossType = "sigmoid",
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> Tensor:
    """Per-pair losses ``(B,)`` from implicit rewards (``implicit_rewards``); ``m = r_c - r_r``.

    * ``sigmoid``: ``-log sigmoid(m)`` (DPO, Rafailov et al. 2023, eq. 7). TRL's ``sigmoid`` agrees.
    * ``label_smoothing`` (conservative DPO, cDPO; Mitchell 2023): labels flipped with probability eps,
      ``(1 - eps) * -log sigmoid(m) + eps * -log sigmoid(-m)``. TRL's ``sigmoid`` with ``label_smoothing``
      agrees.
    * ``robust`` (Chowdhury et al. 2024, eq. 9, an unbiased loss under label noise eps):
      ``((1 - eps) * -log sigmoid(m) - eps * -log sigmoid(-m)) / (1 - 2 eps)``. TRL's ``robust`` agrees. Not
      bounded below: it can go negative when m < 0 is confidently learned for a presumed-flipped label.
    * ``hinge``: ``relu(1 - m)`` (SLiC-style, Zhao et al. 2023 with delta = 1/beta). TRL's ``hinge`` agrees.
    * ``ipo``: ``(m / beta - 1 / (2 beta))^2 = (h - 1/(2 beta))^2`` with h from per-token averaged log-ratios
      (Azar et al. 2023, eq. 17). TRL's ``ipo`` agrees (it averages per token too).
    * ``simpo``: ``-log sigmoid(m - gamma)`` with the length-normalised, reference-free rewards and target
      margin gamma (Meng et al. 2024, eq. 6). TRL (``CPOTrainer`` with ``loss_type="simpo"``) agrees.

    Args:
        chosen_rewards, rejected_rewards: ``(B,)`` implicit rewards.
        beta: > 0; used by ``ipo`` (the rewards already carry it for the other losses).
        label_smoothing: eps in [0, 0.5): the assumed label-flip rate of ``label_smoothing`` and ``robust``.
        gamma: SimPO's target reward margin (reward units), >= 0 in the paper.

    Raises:
        ValueError: for an unknown ``loss_type``, ``beta <= 0``, eps outside [0, 0.5), or eps > 0 with a loss
            that does not use it.
    """
    _check_beta(beta)
    check_value("label_smoothing", label_smoothing, LABEL_SMOOTHING)
    if label_smoothing > 0 and loss_type not in ("label_smoothing", "robust"):
        raise ValueError(f"label_smoothing is used by 'label_smoothing' and 'robust' only, not {loss_type!r}")
    margin = chosen_rewards - rejected_rewards
    if loss_type == "sigmoid":
        return -F.logsigmoid(margin)
    if loss_type == "label_smoothing":
        eps = label_smoothing
        return -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
    if loss_type == "robust":
        eps = label_smoothing
        return (-(1 - eps) * F.logsigmoid(margin) + eps * F.logsigmoid(-margin)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return torch.relu(1 - margin)
    if loss_type == "ipo":
        return (margin / beta - 1 / (2 * beta)) ** 2
    if loss_type == "simpo":
        return -F.logsigmoid(margin - gamma)
    raise ValueError(f"unknown paired loss_type {loss_type!r}; choose one of {PAIRED_LOSS_TYPES}")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    beta: float,
    loss_type: LossType = "sigmoid",
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``implicit_rewards`` then ``preference_loss``: ``(losses, chosen_rewards, rejected_rewards)``, each
    ``(B,)``; the rewards are detached (for logging). All inputs ``(B,)``, log-probs summed in nats."""
    chosen, rejected = implicit_rewards(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta,
        loss_type,
        chosen_lengths,
        rejected_lengths,
    )
    losses = preference_loss(chosen, rejected, beta, loss_type, label_smoothing, gamma)
    return losses, chosen.detach(), rejected.detach()


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """KTO on unpaired completions (Ethayarajh et al. 2024, eq. 8): per-row losses, rewards and the baseline.

    With the log-ratio ``r = logp - ref_logp`` of each completion and the baseline ``z0``:
    desirable rows lose ``lambda_D * (1 - sigmoid(beta * (r - z0)))``, undesirable rows
    ``lambda_U * (1 - sigmoid(beta * (z0 - r)))`` (the paper's ``lambda_y - v(x, y)``).

    **The baseline z0** is the batch mean of ``r`` over ALL the batch's own completions, detached, clamped at
    0: ``z0 = max(0, mean_b r_b)``. The paper estimates ``KL(pi_theta || pi_ref)`` from mismatched
    prompt/completion pairs of the batch, which needs an extra forward per batch and is undefined for B = 1
    (a rotation of one row is the row itself) and was NaN in peers for a batch without mismatched pairs.
    The batch's own completions need no extra forward, are defined for every B >= 1 (odd sizes alike),
    whatever the mix of desirable and undesirable rows (only desirable, only undesirable), and the mean of
    B >= 1 finite numbers is never NaN. Like the paper's estimate it is a batch-level constant with no
    gradient; the clamp keeps it a KL-like (non-negative) quantity as in the paper. Where this departs from
    TRL: TRL's ``KTOTrainer`` computes z0 from completions shifted by one row (mismatched pairs, an extra
    forward), all-gathered over processes; here it is per process. The loss formula given z0 agrees with
    TRL's (its mean over all rows, desirable and undesirable together).

    Args:
        policy_logps, ref_logps: ``(B,)`` summed log-probs (nats) of each completion.
        desirable: ``(B,)`` bool, True = a desirable completion.
        beta: > 0.
        desirable_weight, undesirable_weight: lambda_D, lambda_U >= 0 (the paper suggests
            ``lambda_D n_D / (lambda_U n_U)`` in [1, 4/3]).

    Returns:
        ``(losses (B,), rewards (B,) = beta * r detached, z0 (scalar, detached))``.

    Raises:
        ValueError: if ``beta <= 0``, a weight is negative, or the batch is empty.
    """
    _check_beta(beta)
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError("desirable_weight and undesirable_weight must be >= 0")
    if policy_logps.numel() == 0:
        raise ValueError("KTO needs at least one completion")
    logratios = policy_logps - ref_logps
    z0 = logratios.detach().mean().clamp(min=0)
    desirable = desirable.bool()
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - z0)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratios)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)
    return losses, (beta * logratios).detach(), z0


def reward_accuracy(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """Fraction of pairs whose chosen reward is higher; a tie counts 1/2 (a fresh adapter, with every reward
    0, scores 0.5, not 0.0 as with TRL's strict ``>``). Scalar float in [0, 1]."""
    wins = (chosen_rewards > rejected_rewards).float() + 0.5 * (chosen_rewards == rejected_rewards).float()
    return wins.mean()


def chosen_nll(chosen_logps: Tensor, chosen_lengths: Tensor) -> Tensor:
    """Negative log-likelihood of the chosen responses per token (nats): ``-sum_b logp_b / sum_b R_b``, the
    token mean over the batch (the ``nll_coef`` term that keeps the chosen log-prob from falling; OpenRLHF's
    ``nll_loss_coef``, RPO of Pang et al. 2024).

    Raises:
        ValueError: if the batch has no response tokens.
    """
    total = chosen_lengths.sum()
    if int(total) < 1:
        raise ValueError("the chosen responses hold no tokens")
    return -chosen_logps.sum() / total
