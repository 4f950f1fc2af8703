"""Length-bias diagnostics of a reward model on preference pairs.

Preference data rewards length (human raters and the models that collected HH-RLHF favour longer helpful
answers), so a reward model can score well by measuring length alone (Singhal et al. 2023, "A Long Way to
Go: Investigating Length Correlations in RLHF"). These functions separate the two: the pairs whose
responses have about the same length, accuracy by how much the lengths differ, the rank correlation of the
score with length, and "the longer response wins" on exactly the same pairs.

Notation: N pairs; ``len_chosen``, ``len_rejected`` ``(N,)`` response lengths (tokens, any unit that is the
same for both sides); ``margins`` ``(N,)`` = r_chosen - r_rejected. A pair's **relative length difference**
is ``|L_c - L_r| / max(L_c, L_r)`` (0 when both are 0), in [0, 1]. Torch only (torchmetrics' functional
Spearman is torch code).
"""

from __future__ import annotations

import math

import torch
from torchmetrics.functional import spearman_corrcoef

from rlhf_lit.functional.summary import mean_se

# Upper edges of the relative-length-difference buckets; the first bucket is the length-matched pairs.
LENGTH_DIFF_EDGES: tuple[float, ...] = (0.1, 0.25, 0.5)
LENGTH_DIFF_BUCKETS: tuple[str, ...] = ("0-10pct", "10-25pct", "25-50pct", "50-100pct")
LENGTH_MATCH_TOLERANCE = 0.1


def relative_length_difference(len_chosen: torch.Tensor, len_rejected: torch.Tensor) -> torch.Tensor:
    """``(N,)`` float ``|L_c - L_r| / max(L_c, L_r)``, 0 where both lengths are 0.

    Example: lengths (10, 11), (20, 10), (0, 0) give ``[1/11, 0.5, 0]``.
    """
    c, r = len_chosen.double(), len_rejected.double()
    longer = torch.maximum(c, r)
    return torch.where(longer > 0, (c - r).abs() / longer.clamp(min=1e-12), torch.zeros_like(longer))


def length_matched(
    len_chosen: torch.Tensor, len_rejected: torch.Tensor, tolerance: float = LENGTH_MATCH_TOLERANCE
) -> torch.Tensor:
    """``(N,)`` bool: the pairs whose responses differ in length by at most ``tolerance`` (a fraction of the
    longer one): ``|L_c - L_r| <= tolerance * max(L_c, L_r)``. Example: (10, 11) and (100, 90) are matched
    at 0.1, (10, 12) is not."""
    c, r = len_chosen.double(), len_rejected.double()
    return (c - r).abs() <= tolerance * torch.maximum(c, r) + 1e-9


def length_diff_bucket(
    len_chosen: torch.Tensor, len_rejected: torch.Tensor, edges: tuple[float, ...] = LENGTH_DIFF_EDGES
) -> torch.Tensor:
    """``(N,)`` long bucket index of each pair's relative length difference d: bucket 0 is ``d <= edges[0]``
    (the length-matched pairs), bucket k is ``edges[k-1] < d <= edges[k]``, the last is ``d > edges[-1]``.
    Example with the default edges: d = 0.05, 0.1, 0.2, 0.3, 0.9 give ``[0, 0, 1, 2, 3]``."""
    d = relative_length_difference(len_chosen, len_rejected)
    # the same 1e-9 slack as length_matched, so bucket 0 is exactly the length-matched pairs
    return torch.bucketize(d - 1e-9, torch.tensor(edges, dtype=d.dtype), right=False)


def pair_correct(margins: torch.Tensor) -> torch.Tensor:
    """``(N,)`` float 1 where r_chosen > r_rejected, else 0 (a tie counts as wrong)."""
    return (margins > 0).double()


def pair_credit(margins: torch.Tensor) -> torch.Tensor:
    """``(N,)`` float credit of a scorer on each pair: 1 where r_chosen > r_rejected, 0.5 on a tie (a coin flip,
    in expectation, as ``length_rule_wins`` credits equal lengths), 0 where r_chosen < r_rejected. Its mean is
    the accuracy with ties counted 1/2. Example: margins [0.3, 0.0, -1.0] give ``[1, 0.5, 0]``."""
    m = margins.double()
    return (m > 0).double() + 0.5 * (m == 0).double()


def length_rule_wins(len_chosen: torch.Tensor, len_rejected: torch.Tensor) -> torch.Tensor:
    """``(N,)`` float credit of "the longer response wins": 1 if the chosen one is longer, 0 if shorter,
    0.5 for equal lengths (a coin flip, in expectation)."""
    c, r = len_chosen.double(), len_rejected.double()
    return (c > r).double() + 0.5 * (c == r).double()


def paired_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Mean of ``a_i - b_i`` and its paired standard error: the comparison of two scorers on the SAME items
    (e.g. a reward model's correctness against the length rule's credit, pair by pair). Pairing removes the
    between-item variance, so the error is far smaller than that of two independent accuracies when the two
    agree on most items. Example: a = [1, 1, 0, 1], b = [1, 0, 0, 0]: d = [0, 1, 0, 1], mean 0.5,
    SE = sqrt(1/3) / 2 = 0.2887."""
    return mean_se(a.double() - b.double())


def score_length_spearman(scores: torch.Tensor, lengths: torch.Tensor) -> float:
    """Spearman rank correlation of ``(M,)`` scores with ``(M,)`` lengths (ties get their mean rank;
    ``torchmetrics.functional.spearman_corrcoef``). Near +1: the score mostly measures length. NaN for fewer
    than 2 values; 0 when either side is constant."""
    if scores.numel() < 2:
        return math.nan
    return float(spearman_corrcoef(scores.double().flatten(), lengths.double().flatten()))


def length_bias_report(
    margins: torch.Tensor,
    len_chosen: torch.Tensor,
    len_rejected: torch.Tensor,
    chosen_scores: torch.Tensor | None = None,
    rejected_scores: torch.Tensor | None = None,
) -> dict:
    """Every length diagnostic of one set of pairs, as plain floats.

    Args:
        margins: ``(N,)`` r_chosen - r_rejected.
        len_chosen, len_rejected: ``(N,)`` response lengths.
        chosen_scores, rejected_scores: ``(N,)`` the scores themselves, for the score-length correlation
            (over all 2N responses); without them it is left out.

    Returns:
        ``accuracy`` and ``length_rule_accuracy`` (with standard errors), ``vs_length_rule`` (the paired
        difference, its SE and the difference in SEs, ``z``; 0 when the two agree on every pair, +-inf for
        a difference without paired noise, NaN for one pair), ``length_matched`` (``pairs``, ``fraction``,
        ``accuracy``, ``length_rule_accuracy``), ``by_length_diff`` (the same per bucket of
        ``LENGTH_DIFF_BUCKETS``) and ``score_length_spearman``.
    """
    correct = pair_correct(margins)
    rule = length_rule_wins(len_chosen, len_rejected)
    acc, acc_se = mean_se(correct)
    rule_acc, rule_se = mean_se(rule)
    diff, diff_se = paired_difference(correct, rule)
    if math.isnan(diff_se):
        z = math.nan
    elif diff_se > 0:
        z = diff / diff_se
    else:  # the two agree on every pair (no paired noise): 0, or an exact win / loss
        z = 0.0 if diff == 0 else math.copysign(math.inf, diff)
    n = margins.numel()

    def subset(keep: torch.Tensor) -> dict:
        k = int(keep.sum())
        return {
            "pairs": k,
            "fraction": k / n if n else math.nan,
            "accuracy": mean_se(correct[keep])[0],
            "length_rule_accuracy": mean_se(rule[keep])[0],
        }

    buckets = length_diff_bucket(len_chosen, len_rejected)
    report = {
        "accuracy": acc,
        "accuracy_se": acc_se,
        "length_rule_accuracy": rule_acc,
        "length_rule_accuracy_se": rule_se,
        "vs_length_rule": {"difference": diff, "se": diff_se, "z": z},
        "length_matched": subset(length_matched(len_chosen, len_rejected)),
        "by_length_diff": {name: subset(buckets == i) for i, name in enumerate(LENGTH_DIFF_BUCKETS)},
    }
    if chosen_scores is not None and rejected_scores is not None:
        report["score_length_spearman"] = score_length_spearman(
            torch.cat([chosen_scores, rejected_scores]), torch.cat([len_chosen, len_rejected])
        )
    return report


def within_group_slope(values: list[torch.Tensor], lengths: list[torch.Tensor]) -> float:
    """The common slope of ``value ~ a_g + b * length`` fitted by least squares with one intercept per group
    (analysis of covariance): ``b = sum_g S_xy(g) / sum_g S_xx(g)`` over groups g of ``(M_g,)`` tensors, with
    ``S_xy(g)`` the sum of products of the deviations from group g's means. A slope fitted across groups
    would also take up any difference between them (a policy that got both longer and better); this one
    is the length effect within a group only. 0 when no group's lengths vary.

    Example: groups ([1, 2, 3] at lengths [10, 20, 30]) and ([3, 4, 5] at [10, 20, 30]): 40 / 400 = 0.1.
    """
    sxy = sxx = 0.0
    for v, x in zip(values, lengths):
        v, x = v.double(), x.double()
        dx = x - x.mean()
        sxy += float((dx * (v - v.mean())).sum())
        sxx += float((dx * dx).sum())
    return sxy / sxx if sxx > 0 else 0.0


def length_adjusted_change(
    before: torch.Tensor, after: torch.Tensor, len_before: torch.Tensor, len_after: torch.Tensor
) -> dict:
    """How a score changed between two policies on the same K prompts, and how much of it length explains.

    Args:
        before, after: ``(K,)`` scores of the two policies' responses, pairs i on the same prompt.
        len_before, len_after: ``(K,)`` their response lengths.

    Returns:
        ``change`` and ``change_se`` (the paired mean of ``after - before`` and its SE), ``slope`` (score per
        length unit, ``within_group_slope`` of the two policies), ``length_part`` (``slope`` times the mean
        length change) and ``adjusted_change`` / ``adjusted_change_se`` (the paired mean of
        ``(after - slope * len_after) - (before - slope * len_before)``: the change that the length change
        does not explain, the slope taken as known).
    """
    slope = within_group_slope([before, after], [len_before, len_after])
    change, change_se = paired_difference(after, before)
    dlen = (len_after.double() - len_before.double()).mean()
    adjusted, adjusted_se = paired_difference(
        after.double() - slope * len_after.double(), before.double() - slope * len_before.double()
    )
    return {
        "change": change,
        "change_se": change_se,
        "slope": slope,
        "length_part": slope * float(dlen),
        "adjusted_change": adjusted,
        "adjusted_change_se": adjusted_se,
    }
