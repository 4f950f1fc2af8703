"""Direct preference losses (rlhf_lit.functional.preference), pinned on one batch of 3 pairs by hand.

The batch (beta = 0.5), log-probs summed over the response (nats):
    policy chosen  [-4, -6, -5]   reference chosen   [-5, -5, -5]   chosen lengths   [2, 4, 5]
    policy rejected[-6, -5, -5]   reference rejected [-5, -5, -5]   rejected lengths [4, 2, 5]
    chosen log-ratio [1, -1, 0], rejected log-ratio [-1, 0, 0], so h = [2, -1, 0] and m = beta * h = [1, -0.5, 0].
L(m) = -log sigmoid(m) = log(1 + e^-m): L(1) = 0.3132616875, L(-0.5) = 0.9740769842, L(0) = log 2 = 0.6931471806.
A useful identity: L(-m) - L(m) = m.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional.preference import (
    chosen_nll,
    dpo_loss,
    implicit_rewards,
    kto_loss,
    preference_loss,
    response_logps,
    response_logps_from_hidden,
    response_logps_in_length_groups,
    response_scoring_mask,
    reward_accuracy,
)
from rlhf_lit.functional.sequence import length_groups

BETA = 0.5
PC = torch.tensor([-4.0, -6.0, -5.0])
PR = torch.tensor([-6.0, -5.0, -5.0])
RC = torch.tensor([-5.0, -5.0, -5.0])
RR = torch.tensor([-5.0, -5.0, -5.0])
LC = torch.tensor([2, 4, 5])
LR = torch.tensor([4, 2, 5])
L1, LM05, L0 = 0.3132616875182229, 0.9740769841801067, 0.6931471805599453


def _loss(loss_type, pc=PC, pr=PR, rc=RC, rr=RR, **kw):
    losses, _, _ = dpo_loss(pc, pr, rc, rr, BETA, loss_type, LC, LR, **kw)
    return losses


# --------------------------------------------------------------------------- sigmoid (DPO)
def test_sigmoid_hand_values():
    assert_close(_loss("sigmoid"), torch.tensor([L1, LM05, L0]))


def test_sigmoid_rewards_are_beta_times_the_log_ratios():
    _, chosen, rejected = dpo_loss(PC, PR, RC, RR, BETA, "sigmoid")
    assert_close(chosen, torch.tensor([0.5, -0.5, 0.0]))  # 0.5 * [1, -1, 0]
    assert_close(rejected, torch.tensor([-0.5, 0.0, 0.0]))  # 0.5 * [-1, 0, 0]


def test_sigmoid_edge_equal_policy_and_reference_gives_log2():
    assert_close(_loss("sigmoid", pc=RC, pr=RR), torch.full((3,), math.log(2)))


def test_sigmoid_decreases_in_the_margin():
    chosen = torch.linspace(-8, 2, 11)
    losses = _loss(
        "sigmoid",
        pc=chosen,
        pr=torch.full((11,), -5.0),
        rc=torch.full((11,), -5.0),
        rr=torch.full((11,), -5.0),
    )
    assert bool((losses[1:] < losses[:-1]).all())


# --------------------------------------------------------------------------- cDPO (label_smoothing)
def test_label_smoothing_hand_values():
    # (1 - eps) L(m) + eps L(-m) = L(m) + eps * m with eps = 0.1:
    # 0.3132616875 + 0.1 = 0.4132616875; 0.9740769842 - 0.05 = 0.9240769842; log 2 + 0
    assert_close(
        _loss("label_smoothing", label_smoothing=0.1), torch.tensor([0.4132616875, 0.9240769842, L0])
    )


def test_label_smoothing_edge_eps_zero_is_dpo():
    assert_close(_loss("label_smoothing", label_smoothing=0.0), _loss("sigmoid"))


def test_label_smoothing_is_minimal_at_a_finite_margin():
    # d/dm [(1-eps) L(m) + eps L(-m)] = 0 at e^m = (1 - eps) / eps: m* = log 9 for eps = 0.1
    eps, best = 0.1, math.log(9.0)
    m = torch.tensor([best - 0.1, best, best + 0.1])
    losses = preference_loss(m, torch.zeros(3), BETA, "label_smoothing", label_smoothing=eps)
    assert losses[1] < losses[0] and losses[1] < losses[2]


# --------------------------------------------------------------------------- robust DPO
def test_robust_hand_values():
    # ((1-eps) L(m) - eps L(-m)) / (1 - 2 eps) = L(m) - eps m / (1 - 2 eps) = L(m) - 0.125 m for eps = 0.1:
    # 0.3132616875 - 0.125 = 0.1882616875; 0.9740769842 + 0.0625 = 1.0365769842; log 2
    assert_close(_loss("robust", label_smoothing=0.1), torch.tensor([0.1882616875, 1.0365769842, L0]))


def test_robust_edge_eps_zero_is_dpo():
    assert_close(_loss("robust"), _loss("sigmoid"))


def test_robust_is_unbiased_under_label_flips():
    # Chowdhury et al. 2024: averaged over a flip with probability eps, the robust loss is the clean DPO loss
    eps = 0.2
    m = torch.tensor([-2.0, 0.3, 1.7])
    robust = preference_loss(m, torch.zeros(3), BETA, "robust", label_smoothing=eps)
    flipped = preference_loss(torch.zeros(3), m, BETA, "robust", label_smoothing=eps)
    assert_close((1 - eps) * robust + eps * flipped, preference_loss(m, torch.zeros(3), BETA, "sigmoid"))


# --------------------------------------------------------------------------- hinge
def test_hinge_hand_values():
    # relu(1 - m): 1 - 1 = 0; 1 + 0.5 = 1.5; 1 - 0 = 1
    assert_close(_loss("hinge"), torch.tensor([0.0, 1.5, 1.0]))


def test_hinge_edge_exactly_at_the_margin_is_zero_with_no_gradient():
    chosen = torch.tensor([1.0], requires_grad=True)
    loss = preference_loss(chosen, torch.zeros(1), BETA, "hinge")
    loss.sum().backward()
    assert loss.item() == 0.0 and chosen.grad.item() == 0.0


def test_hinge_is_zero_beyond_the_margin_and_linear_below():
    m = torch.tensor([-1.0, 0.0, 0.5, 1.0, 3.0])
    assert_close(preference_loss(m, torch.zeros(5), BETA, "hinge"), torch.tensor([2.0, 1.0, 0.5, 0.0, 0.0]))


# --------------------------------------------------------------------------- IPO
def test_ipo_hand_values_average_per_token():
    # chosen log-ratio / length: [1/2, -1/4, 0/5] = [0.5, -0.25, 0]; rejected: [-1/4, 0/2, 0/5] = [-0.25, 0, 0]
    # h = [0.75, -0.25, 0]; 1 / (2 beta) = 1; (h - 1)^2 = [0.0625, 1.5625, 1.0]
    assert_close(_loss("ipo"), torch.tensor([0.0625, 1.5625, 1.0]))


def test_ipo_edge_one_token_responses_equal_the_summed_form():
    one = torch.ones(3, dtype=torch.long)
    losses, _, _ = dpo_loss(PC, PR, RC, RR, BETA, "ipo", one, one)
    # h = [2, -1, 0] summed = averaged; (h - 1)^2 = [1, 4, 1]
    assert_close(losses, torch.tensor([1.0, 4.0, 1.0]))


def test_ipo_is_minimal_at_h_equal_one_over_two_beta_and_ignores_length_scaling():
    h = torch.tensor([0.5, 1.0, 1.5])  # 1 / (2 * 0.5) = 1
    losses = preference_loss(BETA * h, torch.zeros(3), BETA, "ipo")
    assert losses[1] == 0 and losses[0] > 0 and losses[2] > 0
    # doubling every length and every log-prob gives the same per-token ratios, so the same loss
    doubled, _, _ = dpo_loss(2 * PC, 2 * PR, 2 * RC, 2 * RR, BETA, "ipo", 2 * LC, 2 * LR)
    assert_close(doubled, _loss("ipo"))


# --------------------------------------------------------------------------- SimPO
def test_simpo_hand_values():
    # r_c = beta * logp / len = 0.5 * [-4/2, -6/4, -5/5] = [-1, -0.75, -0.5]
    # r_r = 0.5 * [-6/4, -5/2, -5/5] = [-0.75, -1.25, -0.5]; m = [-0.25, 0.5, 0]; m - gamma (0.2) = [-0.45, 0.3, -0.2]
    # log(1 + e^0.45) = 0.9432489460, log(1 + e^-0.3) = 0.5543552445, log(1 + e^0.2) = 0.7981388694
    assert_close(_loss("simpo", gamma=0.2), torch.tensor([0.9432489460, 0.5543552445, 0.7981388694]))


def test_simpo_edge_needs_lengths_but_no_reference():
    losses, chosen, _ = dpo_loss(PC, PR, None, None, BETA, "simpo", LC, LR, gamma=0.2)
    assert_close(chosen, torch.tensor([-1.0, -0.75, -0.5]))
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(PC, PR, None, None, BETA, "simpo")


def test_simpo_is_independent_of_the_reference():
    other = _loss("simpo", rc=torch.tensor([-1.0, -20.0, 3.0]), rr=torch.tensor([-9.0, 0.0, -2.0]), gamma=0.2)
    assert torch.equal(other, _loss("simpo", gamma=0.2))


# --------------------------------------------------------------------------- KTO
# policy [-3.5, -6, -4], reference [-5, -5, -5]: r = [1.5, -1, 1]; desirable [T, F, T]; beta 0.5;
# z0 = max(0, mean r) = max(0, 1.5 / 3) = 0.5; lambda_D = 1, lambda_U = 1.5
KP = torch.tensor([-3.5, -6.0, -4.0])
KR = torch.tensor([-5.0, -5.0, -5.0])
KD = torch.tensor([True, False, True])


def test_kto_hand_values():
    losses, rewards, z0 = kto_loss(KP, KR, KD, BETA, desirable_weight=1.0, undesirable_weight=1.5)
    # desirable 1: 1 - sigmoid(0.5 * (1.5 - 0.5)) = sigmoid(-0.5) = 1 / (1 + e^0.5) = 0.3775406688
    # undesirable: 1.5 * (1 - sigmoid(0.5 * (0.5 + 1))) = 1.5 / (1 + e^0.75) = 1.5 * 0.3208213008 = 0.4812319512
    # desirable 3: 1 - sigmoid(0.5 * (1 - 0.5)) = 1 / (1 + e^0.25) = 0.4378234991
    assert_close(losses, torch.tensor([0.3775406688, 0.4812319512, 0.4378234991]))
    assert_close(rewards, torch.tensor([0.75, -0.5, 0.5]))  # beta * r
    assert_close(z0, torch.tensor(0.5))


@pytest.mark.parametrize("desirable", [[True], [False], [True, True, True], [False, False, False]])
def test_kto_edge_batch_of_one_or_of_one_kind_is_finite(desirable):
    n = len(desirable)
    policy = torch.tensor([-7.0, -2.0, -4.0][:n])  # r = [-2, 3, 1][:n]
    losses, _, z0 = kto_loss(policy, torch.full((n,), -5.0), torch.tensor(desirable), BETA)
    assert torch.isfinite(losses).all() and torch.isfinite(z0)
    # z0 = max(0, mean r): B = 1 -> max(0, -2) = 0; B = 3 -> max(0, 2 / 3)
    assert_close(z0, torch.tensor(0.0 if n == 1 else 2.0 / 3.0))
    # B = 1: r = -2, z0 = 0: desirable 1 - sigmoid(-1) = 0.7310585786; undesirable 1 - sigmoid(1) = 0.2689414214
    if n == 1:
        assert_close(losses, torch.tensor([0.7310585786 if desirable[0] else 0.2689414214]))


def test_kto_baseline_carries_no_gradient_between_rows():
    policy = KP.clone().requires_grad_(True)
    losses, _, _ = kto_loss(policy, KR, KD, BETA)
    (grad,) = torch.autograd.grad(losses[0], policy)
    assert grad[0] != 0 and grad[1] == 0 and grad[2] == 0


# --------------------------------------------------------------------------- rewards, accuracy, NLL, log-probs
def test_accuracy_counts_ties_as_half():
    # pair 1 wins (0.5 > -0.5), pair 2 loses (-0.5 < 0), pair 3 ties (0 = 0): (1 + 0 + 0.5) / 3 = 0.5
    chosen, rejected = implicit_rewards(PC, PR, RC, RR, BETA)
    assert_close(reward_accuracy(chosen, rejected), torch.tensor(0.5))
    assert_close(reward_accuracy(torch.zeros(4), torch.zeros(4)), torch.tensor(0.5))  # a fresh adapter


def test_chosen_nll_is_a_token_mean():
    # -(-4 - 6 - 5) / (2 + 4 + 5) = 15 / 11
    assert_close(chosen_nll(PC, LC), torch.tensor(15.0 / 11.0))
    with pytest.raises(ValueError):
        chosen_nll(PC, torch.zeros(3, dtype=torch.long))


def test_response_logps_reads_each_rows_response_at_the_previous_positions():
    # V = 2, logits at position i are [0, i], every token is 1: logp(token at i + 1) = -log(1 + e^-i)
    T = 5
    logits = torch.stack([torch.zeros(T), torch.arange(T, dtype=torch.float)], -1).expand(2, T, 2)
    ids = torch.ones(2, T, dtype=torch.long)
    # row 0: P = 2, R = 2 -> tokens 2, 3 scored at positions 1, 2: -(log(1 + e^-1) + log(1 + e^-2)) = -0.4401896986
    # row 1: P = 3, R = 2 -> positions 2, 3: -(log(1 + e^-2) + log(1 + e^-3)) = -0.1755153626
    logps, n = response_logps(logits, ids, torch.tensor([2, 3]), torch.tensor([2, 2]))
    assert_close(logps, torch.tensor([-0.4401896986, -0.1755153626]))
    assert n.tolist() == [2, 2]
    with pytest.raises(ValueError):  # P + R > T
        response_logps(logits, ids, torch.tensor([4, 3]), torch.tensor([2, 2]))


def test_response_scoring_mask_marks_the_positions_before_each_response_token():
    # P = [2, 3], R = [2, 1], T = 5: row 0 scores tokens 2, 3 at positions 1, 2; row 1 token 3 at position 2
    mask = response_scoring_mask(torch.tensor([2, 3]), torch.tensor([2, 1]), 5)
    assert mask.tolist() == [[False, True, True, False], [False, False, True, False]]
    for prompt_len, response_len in (([0, 3], [2, 1]), ([2, 3], [0, 1]), ([2, 3], [2, 3])):
        with pytest.raises(ValueError):  # no prompt token / no response token / 3 + 3 > T
            response_scoring_mask(torch.tensor(prompt_len), torch.tensor(response_len), 5)


def test_logps_from_hidden_equal_the_full_logits_path_and_the_head_sees_response_rows_only():
    gen = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 7, 4, 11
    hidden = torch.randn(B, T, H, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=gen, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    prompt_len, response_len = torch.tensor([1, 3, 2]), torch.tensor([2, 4, 1])
    seen = []

    def head(h):
        seen.append(tuple(h.shape))
        return h @ weight.T

    packed = response_logps_from_hidden(hidden, head, ids, prompt_len, response_len)
    assert seen == [(7, H)]  # 2 + 4 + 1 response tokens, not B * (T - 1) = 18 positions
    full, _ = response_logps(hidden @ weight.T, ids, prompt_len, response_len)
    assert_close(packed, full, atol=1e-12, rtol=1e-12)
    g_packed = torch.autograd.grad(packed.sum(), (hidden, weight))
    g_full = torch.autograd.grad(full.sum(), (hidden, weight))
    for a, b in zip(g_packed, g_full):
        assert_close(a, b, atol=1e-12, rtol=1e-12)
    # the hidden states of prompt and padding positions get no gradient
    assert g_packed[0][0, 2:].abs().sum() == 0 and g_packed[1].abs().sum() > 0


def test_length_groups_keep_each_row_within_the_fill_of_its_groups_longest():
    # longest first: 10 starts a group, 9 >= 0.9 * 10 joins it, 5 < 9 starts one, 4 < 0.9 * 5 another
    groups = length_groups(torch.tensor([5, 10, 9, 4]))
    assert [g.tolist() for g in groups] == [[1, 2], [0], [3]]
    # equal lengths stay in one group, in row order; fill = 0.5 puts 6 with 10 but not 4
    assert [g.tolist() for g in length_groups(torch.tensor([3, 3, 3]))] == [[0, 1, 2]]
    assert [g.tolist() for g in length_groups(torch.tensor([4, 10, 6]), fill=0.5)] == [[1, 2], [0]]
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fill"):
            length_groups(torch.tensor([1, 2]), fill=bad)


def test_logps_in_length_groups_equal_one_padded_forward_and_never_see_a_groups_extra_padding():
    """A causal toy trunk (a running mean of embeddings, so every position depends on all earlier ones):
    the grouped path gives the padded path's values and gradients, in row order, while each trunk call is
    only as wide as its group's longest row."""
    gen = torch.Generator().manual_seed(1)
    V, H = 13, 5
    emb = torch.randn(V, H, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=gen, requires_grad=True)
    prompt_len, response_len = torch.tensor([2, 1, 3, 2]), torch.tensor([1, 6, 4, 1])  # lengths 3, 7, 7, 3
    T = 9
    ids = torch.randint(1, V, (4, T), generator=gen)
    mask = (torch.arange(T)[None] < (prompt_len + response_len)[:, None]).long()
    ids = ids * mask  # right padding with id 0
    widths = []

    def trunk(input_ids, attention_mask):
        widths.append(tuple(input_ids.shape))
        x = emb[input_ids] * attention_mask[..., None]
        return x.cumsum(1) / torch.arange(1, input_ids.shape[1] + 1, dtype=x.dtype)[None, :, None]

    def head(h):
        return h @ weight.T

    grouped = response_logps_in_length_groups(trunk, head, ids, mask, prompt_len, response_len)
    assert widths == [(2, 7), (2, 3)]  # rows 1, 2 cut to 7 columns, rows 0, 3 to 3 (the batch is 9 wide)
    padded = response_logps_from_hidden(trunk(ids, mask), head, ids, prompt_len, response_len)
    assert_close(grouped, padded, atol=1e-12, rtol=1e-12)
    for a, b in zip(
        torch.autograd.grad(grouped.sum(), (emb, weight)), torch.autograd.grad(padded.sum(), (emb, weight))
    ):
        assert_close(a, b, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="within the T columns"):  # a row longer than the batch
        response_logps_in_length_groups(trunk, head, ids, mask, prompt_len, response_len + 3)


@pytest.mark.parametrize("bad", [0.0, -0.1])
def test_beta_must_be_positive(bad):
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(PC, PR, RC, RR, bad)
    with pytest.raises(ValueError, match="beta"):
        kto_loss(KP, KR, KD, bad)


def test_label_smoothing_is_refused_where_unused():
    with pytest.raises(ValueError, match="label_smoothing"):
        _loss("hinge", label_smoothing=0.1)
