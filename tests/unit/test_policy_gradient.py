"""The 2025 policy-gradient family's pure functions, by hand (``rlhf_lit.functional.policy_gradient`` and the
options of ``ppo_policy_loss``): GSPO's sequence ratio, clip-higher, CISPO, the entropy-quantile mask, DAPO's
overlong penalty and dynamic-sampling filter, rollout importance weights at two levels and two modes."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional import ppo_policy_loss
from rlhf_lit.functional.policy_gradient import (
    cispo_policy_loss,
    importance_log_ratio,
    overlong_penalty,
    refill_order,
    rollout_is_weights,
    top_entropy_mask,
    zero_variance_groups,
)


def close(actual, expected, atol=1e-6):
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# ---------------------------------------------------------------- the importance ratio (GSPO)


def test_importance_log_ratio_levels_by_hand():
    logp = torch.tensor([[0.2, -0.4, 9.0], [1.0, 2.0, 3.0], [0.3, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)  # row 1 fully masked
    close(importance_log_ratio(logp, old, mask, "token"), [[0.2, -0.4, 0], [0, 0, 0], [0.3, 0, 0]])
    # sequence: (0.2 - 0.4) / 2 = -0.1 on both tokens of row 0; row 1 has no token: 0 (ratio 1); row 2: 0.3
    seq = importance_log_ratio(logp, old, mask, "sequence")
    close(seq, [[-0.1, -0.1, 0], [0, 0, 0], [0.3, 0, 0]])
    tok = importance_log_ratio(logp, old, mask, "sequence_token")
    close(tok, seq.detach())  # GSPO-token carries the sequence ratio's value
    # gradients: d(sum of row 0's sequence values)/d logp_t = 2 tokens x 1/2 = 1 for both tokens;
    # GSPO-token: each token's own log-prob only, 1 each; the masked position gets none
    (g_seq,) = torch.autograd.grad(seq[0].sum(), logp)
    (g_tok,) = torch.autograd.grad(tok[0, 0], logp)
    close(g_seq, [[1.0, 1.0, 0], [0, 0, 0], [0, 0, 0]])
    close(g_tok, [[1.0, 0, 0], [0, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="importance_sampling_level"):
        importance_log_ratio(logp, old, mask, "sentence")


def test_gspo_clips_the_sequence_ratio_per_sequence():
    # row 0: token ratios e^0.3, e^-0.1 -> s = e^0.1 = 1.10517, A = +1, eps 0.05: clipped at 1.05 for both tokens
    # row 1: one token, s = e^-0.02 = 0.98020, A = -1: inside [0.95, 1.05]: term +0.98020
    logp = torch.tensor([[0.3, -0.1], [-0.02, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, stats = ppo_policy_loss(logp, torch.zeros(2, 2), adv, mask, 0.05, importance_sampling_level="sequence")
    close(loss, (-1.05 - 1.05 + math.exp(-0.02)) / 3)  # token mean over 3 tokens
    close(stats["clipfrac"], 2 / 3)  # both tokens of the clipped sequence
    close(stats["clipfrac_high"], 2 / 3)
    close(stats["clipfrac_low"], 0.0)
    loss.backward()  # row 0 clipped: no gradient; row 1: d(-A s)/d logp = s = 0.98020, over 3 tokens
    close(logp.grad, [[0.0, 0.0], [math.exp(-0.02) / 3, 0.0]])


# ---------------------------------------------------------------- clip-higher (DAPO)


def test_asymmetric_clip_by_hand():
    # eps_low 0.2, eps_high 0.28: (r 1.25, A +1) stays unclipped (-1.25; the symmetric clip would give -1.2);
    # (r 1.5, A +1) -> -1.28; (r 0.7, A -1) -> max(0.7, 0.8) = 0.8 (low side binds); (r 0.9, A -1) -> 0.9
    ratios = torch.tensor([[1.25, 1.5, 0.7, 0.9]])
    logp = torch.log(ratios).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = ppo_policy_loss(logp, torch.zeros(1, 4), adv, mask, 0.2, clip_range_high=0.28)
    close(loss, (-1.25 - 1.28 + 0.8 + 0.9) / 4)
    close(stats["clipfrac_high"], 0.25)  # token 1
    close(stats["clipfrac_low"], 0.25)  # token 2
    close(stats["clipfrac"], 0.5)
    symmetric, sym_stats = ppo_policy_loss(logp, torch.zeros(1, 4), adv, mask, 0.2)
    close(symmetric, (-1.2 - 1.2 + 0.8 + 0.9) / 4)
    close(sym_stats["clipfrac_high"], 0.5)
    with pytest.raises(ValueError, match="clip_range"):
        ppo_policy_loss(logp, torch.zeros(1, 4), adv, mask, 0.2, clip_range_high=0.0)


def test_token_mask_zeroes_terms_but_keeps_the_denominator():
    # terms -1.2, +0.8, -0.5 (see test_losses' policy_case); keep tokens 0 and 2: (-1.2 - 0.5) / 3
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    keep = torch.tensor([[True, False, True]])
    loss, _ = ppo_policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 0.2, token_mask=keep)
    close(loss, (-1.2 - 0.5) / 3)


# ---------------------------------------------------------------- CISPO


def test_cispo_loss_and_gradient_by_hand():
    # eps 0.2 / 0.2: token 0 r 1.5 -> weight 1.2, A +1, logp -1: -1.2 * 1 * -1 = 1.2
    # token 1 r 0.5 -> weight 0.8, A -1, logp -2: -0.8 * -1 * -2 = -1.6; token 2 r 1.1, A +1, logp -0.5:
    # -1.1 * -0.5 = 0.55; token 3 padding. Token mean: (1.2 - 1.6 + 0.55) / 3 = 0.05
    logp = torch.tensor([[-1.0, -2.0, -0.5, 4.0]], requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    log_ratio = importance_log_ratio(logp, old, mask)
    loss, stats = cispo_policy_loss(log_ratio, logp, adv, mask, 0.2, 0.2)
    close(loss, 0.05)
    close(stats["clipfrac_high"], 1 / 3)
    close(stats["clipfrac_low"], 1 / 3)
    close(stats["clipfrac"], 2 / 3)
    loss.backward()  # every real token keeps its gradient -w A / 3, clipped ones included (PPO's would be 0)
    close(logp.grad, [[-1.2 / 3, 0.8 / 3, -1.1 / 3, 0.0]])
    # an asymmetric clip: eps_high 1.0 lets r 1.5 through (weight 1.5): (1.5 - 1.6 + 0.55) / 3
    loss, _ = cispo_policy_loss(log_ratio, logp, adv, mask, 0.2, 1.0)
    close(loss, 0.15)
    with pytest.raises(ValueError, match="> 0"):
        cispo_policy_loss(log_ratio, logp, adv, mask, 0.0, 0.2)


def test_cispo_fully_masked_row_is_zero():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = cispo_policy_loss(logp - 5, logp, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.bool), 0.2, 0.2)
    close(loss, 0.0)
    close(stats["clipfrac"], 0.0)


# ---------------------------------------------------------------- entropy quantile


def test_top_entropy_mask_by_hand():
    entropy = torch.tensor([[0.1, 0.5, 0.9], [0.3, 7.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    # masked entropies sorted: 0.1, 0.3, 0.5, 0.9; the 0.5 quantile: position 1.5 -> 0.4; 7.0 is padding
    assert top_entropy_mask(entropy, mask, 0.5).tolist() == [[False, True, True], [False, False, False]]
    # quantile 0.25: the 0.75 quantile, position 2.25 -> 0.5 + 0.25 * 0.4 = 0.6: only 0.9
    assert top_entropy_mask(entropy, mask, 0.25).tolist() == [[False, False, True], [False, False, False]]
    assert torch.equal(top_entropy_mask(entropy, mask, 1.0), mask)  # off
    empty = torch.zeros(2, 3, dtype=torch.bool)  # a fully masked micro-batch (a filler row)
    assert not top_entropy_mask(entropy, empty, 0.2).any()
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        top_entropy_mask(entropy, mask, 0.0)


# ---------------------------------------------------------------- DAPO: overlong, dynamic sampling


def test_overlong_penalty_by_hand():
    # L_max 10, buffer 4 (window 7..10), penalty 2: 6 -> 0; 7 -> -2 * 1/4; 9 -> -2 * 3/4; 10 -> -2
    close(overlong_penalty(torch.tensor([6, 7, 9, 10]), 10, 4, 2.0), [0.0, -0.5, -1.5, -2.0])
    close(overlong_penalty(torch.tensor([0, 10]), 10, 10), [0.0, -1.0])  # the whole range is the window
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(torch.tensor([1]), 10, 11)


def test_zero_variance_groups_by_hand():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])
    assert zero_variance_groups(scores, 2).tolist() == [True, True, False, False, True, True]
    valid = torch.tensor([True, True, False, True, True, True])  # the middle group keeps one valid score
    assert zero_variance_groups(scores, 2, valid).tolist() == [True] * 6
    assert zero_variance_groups(torch.tensor([0.0, 1.0, 1.0]), 3).tolist() == [False] * 3
    with pytest.raises(ValueError, match="groups"):
        zero_variance_groups(scores, 4)


def test_refill_order_by_hand():
    T, F = True, False
    # round 0 [F, T, T], round 1 [T, F, F]: the informative (0, 0), (1, 1), (1, 2) fill the batch of 3
    rounds, groups = refill_order([torch.tensor([F, T, T]), torch.tensor([T, F, F])], 3)
    assert rounds.tolist() == [0, 1, 1] and groups.tolist() == [0, 1, 2]
    # more informative groups than needed: the last round's extra ones are left out, in group order
    rounds, groups = refill_order([torch.tensor([T, F, T]), torch.tensor([F, F, F])], 3)
    assert rounds.tolist() == [0, 1, 1] and groups.tolist() == [1, 0, 1]
    # the cap is hit with 2 informative groups, (0, 0) and (1, 2): the first flat group, (0, 1), tops up
    rounds, groups = refill_order([torch.tensor([F, T, T]), torch.tensor([T, T, F])], 3)
    assert rounds.tolist() == [0, 1, 0] and groups.tolist() == [0, 2, 1]
    # one round, nothing flat: the batch as it is
    rounds, groups = refill_order([torch.tensor([F, F])], 2)
    assert rounds.tolist() == [0, 0] and groups.tolist() == [0, 1]
    with pytest.raises(ValueError, match="fewer than the 4 asked"):
        refill_order([torch.tensor([F, T, T])], 4)
    with pytest.raises(ValueError, match="at least one round"):
        refill_order([], 1)


# ---------------------------------------------------------------- rollout importance sampling


def test_rollout_is_weights_levels_and_modes_by_hand():
    trainer = torch.log(torch.tensor([[3.0, 0.5, 1.0], [1.5, 1.8, 1.0]]))
    sampler = torch.zeros(2, 3)
    known = torch.tensor([[True, True, True], [True, True, False]])
    mask = torch.tensor([[True, True, False], [True, True, True]])  # row 0's third token is padding
    # token: ratios 3, 0.5 | 1.5, 1.8, unknown -> 1; cap 2
    w, hit = rollout_is_weights(trainer, sampler, known, mask, 2.0, "token", "truncate")
    w_token = [[2.0, 0.5, 1.0], [1.5, 1.8, 1.0]]
    close(w, w_token)
    assert hit.tolist() == [[True, False, False], [False, False, False]]
    w, _ = rollout_is_weights(trainer, sampler, known, mask, 2.0, "token", "mask")
    close(w, [[0.0, 0.5, 1.0], [1.5, 1.8, 1.0]])
    # sequence: products 3 x 0.5 = 1.5 and 1.5 x 1.8 = 2.7 (the unknown token counts 1)
    w, hit = rollout_is_weights(trainer, sampler, known, mask, 2.0, "sequence", "truncate")
    close(w, [[1.5, 1.5, 1.0], [2.0, 2.0, 2.0]])
    assert hit.tolist() == [[False, False, False], [True, True, True]]
    w, _ = rollout_is_weights(trainer, sampler, known, mask, 2.0, "sequence", "mask")
    close(w, [[1.5, 1.5, 1.0], [0.0, 0.0, 0.0]])
    # token / truncate are the defaults (ppo.tis_cap alone); row 0's third token in the mask: ratio 1 / 1
    close(rollout_is_weights(trainer, sampler, known, torch.ones(2, 3, dtype=torch.bool), 2.0)[0], w_token)
    with pytest.raises(ValueError, match=">= 1"):
        rollout_is_weights(trainer, sampler, known, mask, 0.5)
    with pytest.raises(ValueError, match="level"):
        rollout_is_weights(trainer, sampler, known, mask, 2.0, "geometric")
