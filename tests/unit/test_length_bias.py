"""rlhf_lit.functional.length_bias on literal pairs, every expected value worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lit.functional.length_bias import (
    LENGTH_DIFF_BUCKETS,
    length_bias_report,
    length_diff_bucket,
    length_matched,
    length_rule_wins,
    paired_difference,
    relative_length_difference,
    score_length_spearman,
)

# Six pairs. Relative length difference |Lc - Lr| / max:
#   (10, 11) 1/11 = 0.0909 -> matched, bucket 0     (20, 8) 12/20 = 0.6 -> bucket 3
#   (30, 30) 0 -> matched, bucket 0                 (5, 6) 1/6 = 0.1667 -> bucket 1
#   (8, 8) 0 -> matched, bucket 0                   (40, 25) 15/40 = 0.375 -> bucket 2
LEN_C = torch.tensor([10, 20, 30, 5, 8, 40])
LEN_R = torch.tensor([11, 8, 30, 6, 8, 25])
MARGINS = torch.tensor([0.5, -1.0, 2.0, 0.3, -0.2, 1.0])  # correct: 1, 0, 1, 1, 0, 1


def test_relative_difference_matching_and_buckets():
    torch.testing.assert_close(
        relative_length_difference(LEN_C, LEN_R),
        torch.tensor([1 / 11, 0.6, 0.0, 1 / 6, 0.0, 0.375], dtype=torch.float64),
    )
    assert length_matched(LEN_C, LEN_R).tolist() == [True, False, True, False, True, False]
    assert length_diff_bucket(LEN_C, LEN_R).tolist() == [0, 3, 0, 1, 0, 2]
    # the edges: exactly 10% is matched (100 vs 90), just above is not (10 vs 12: 1/6); 0 vs 0 is matched
    assert length_matched(torch.tensor([100, 10, 0]), torch.tensor([90, 12, 0])).tolist() == [
        True,
        False,
        True,
    ]
    # bucket edges are inclusive above: d = 0.25 (4 vs 3) is in 10-25pct, 0.5 (2 vs 1) in 25-50pct
    assert length_diff_bucket(torch.tensor([4, 2, 1]), torch.tensor([3, 1, 0])).tolist() == [1, 2, 3]


def test_bucket_zero_is_exactly_the_length_matched_pairs():
    c, r = torch.meshgrid(torch.arange(0, 60), torch.arange(0, 60), indexing="ij")
    c, r = c.flatten(), r.flatten()
    assert torch.equal(length_diff_bucket(c, r) == 0, length_matched(c, r))


def test_length_rule_credit_gives_ties_half():
    # chosen shorter, longer, equal, shorter, equal, longer
    assert length_rule_wins(LEN_C, LEN_R).tolist() == [0.0, 1.0, 0.5, 0.0, 0.5, 1.0]


def test_paired_difference_and_its_standard_error():
    # d = [0, 1, 0, 1]: mean 0.5; unbiased variance (4 * 0.25) / 3 = 1/3; SE = sqrt(1/3) / 2 = 0.288675
    mean, se = paired_difference(torch.tensor([1.0, 1, 0, 1]), torch.tensor([1.0, 0, 0, 0]))
    assert mean == pytest.approx(0.5) and se == pytest.approx(math.sqrt(1 / 3) / 2)
    # identical scorers: difference 0 with SE 0, however noisy each one is
    assert paired_difference(torch.tensor([1.0, 0, 1]), torch.tensor([1.0, 0, 1])) == (0.0, 0.0)


def test_spearman_with_and_without_ties():
    # ranks [1, 2, 3, 4] vs [1, 3, 2, 4]: sum d^2 = 2, rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert score_length_spearman(
        torch.tensor([1.0, 2, 3, 4]), torch.tensor([10, 30, 20, 40])
    ) == pytest.approx(0.8, abs=1e-5)
    # a tie gets the mean rank: scores [1, 2, 2, 3] -> ranks [1, 2.5, 2.5, 4] against [1, 2, 3, 4]:
    # Pearson of the ranks = 4.5 / sqrt(4.5 * 5) = 0.948683
    assert score_length_spearman(torch.tensor([1.0, 2, 2, 3]), torch.tensor([1, 2, 3, 4])) == pytest.approx(
        0.948683, abs=1e-5
    )
    assert score_length_spearman(torch.tensor([4.0, 3, 2, 1]), torch.tensor([1, 2, 3, 4])) == pytest.approx(
        -1.0, abs=1e-5
    )
    assert math.isnan(score_length_spearman(torch.tensor([1.0]), torch.tensor([1])))


def test_report_on_the_six_pairs():
    report = length_bias_report(MARGINS, LEN_C, LEN_R)
    # accuracy 4/6; SE = sqrt(6/5 * 2/9) / sqrt(6) = 0.210819; the rule: (0 + 1 + .5 + 0 + .5 + 1) / 6 = 0.5
    assert report["accuracy"] == pytest.approx(4 / 6)
    assert report["accuracy_se"] == pytest.approx(math.sqrt(6 / 5 * 2 / 9) / math.sqrt(6))
    assert report["length_rule_accuracy"] == pytest.approx(0.5)
    # pair by pair, correct - rule = [1, -1, .5, 1, -.5, 0]: mean 1/6; squared deviations sum to 10/3, so the
    # unbiased variance is 2/3 and the SE sqrt(2/3) / sqrt(6) = 1/3; z = 0.5
    vs = report["vs_length_rule"]
    assert vs["difference"] == pytest.approx(1 / 6)
    assert vs["se"] == pytest.approx(1 / 3)
    assert vs["z"] == pytest.approx(0.5)
    # matched pairs 0, 2, 4: correct [1, 1, 0] -> 2/3; rule [0, .5, .5] -> 1/3
    matched = report["length_matched"]
    assert matched["pairs"] == 3 and matched["fraction"] == pytest.approx(0.5)
    assert matched["accuracy"] == pytest.approx(2 / 3)
    assert matched["length_rule_accuracy"] == pytest.approx(1 / 3)
    buckets = report["by_length_diff"]
    assert list(buckets) == list(LENGTH_DIFF_BUCKETS)
    assert buckets["0-10pct"] == matched
    # bucket 1: pair 3 (right; the rule wrong); bucket 2: pair 5 (both right); bucket 3: pair 1 (the rule right)
    assert (buckets["10-25pct"]["accuracy"], buckets["10-25pct"]["length_rule_accuracy"]) == (1.0, 0.0)
    assert (buckets["25-50pct"]["accuracy"], buckets["25-50pct"]["length_rule_accuracy"]) == (1.0, 1.0)
    assert (buckets["50-100pct"]["accuracy"], buckets["50-100pct"]["length_rule_accuracy"]) == (0.0, 1.0)
    assert sum(b["pairs"] for b in buckets.values()) == 6
    assert "score_length_spearman" not in report  # no per-response scores given


def test_report_correlates_every_response_score_with_its_length():
    # chosen scores [1, 2, 3] with lengths [1, 2, 3], rejected [4, 5, 6] with lengths [6, 5, 4]: ranks of the
    # scores [1..6] against ranks of the lengths [1, 2, 3, 6, 5, 4]: sum d^2 = 4 + 0 + 4 = 8,
    # rho = 1 - 6 * 8 / (6 * 35) = 0.771429
    chosen, rejected = torch.tensor([1.0, 2, 3]), torch.tensor([4.0, 5, 6])
    report = length_bias_report(
        chosen - rejected, torch.tensor([1, 2, 3]), torch.tensor([6, 5, 4]), chosen, rejected
    )
    assert report["score_length_spearman"] == pytest.approx(1 - 48 / 210, abs=1e-5)


def test_an_empty_bucket_reports_nan_not_an_error():
    report = length_bias_report(torch.tensor([1.0, -1.0]), torch.tensor([10, 10]), torch.tensor([10, 10]))
    assert report["by_length_diff"]["50-100pct"]["pairs"] == 0
    assert math.isnan(report["by_length_diff"]["50-100pct"]["accuracy"])
    assert report["length_matched"]["accuracy"] == 0.5


def test_z_when_the_paired_difference_has_no_noise():
    # the reward model and the rule give the same credit on every pair: no difference, z = 0
    same = length_bias_report(torch.tensor([1.0, 1.0]), torch.tensor([10, 20]), torch.tensor([5, 4]))
    assert same["vs_length_rule"] == {"difference": 0.0, "se": 0.0, "z": 0.0}
    # right on every pair where the rule is wrong on every pair: d = [1, 1], an exact win
    win = length_bias_report(torch.tensor([1.0, 1.0]), torch.tensor([5, 4]), torch.tensor([10, 20]))
    assert win["vs_length_rule"]["z"] == math.inf


def test_a_change_length_explains_is_told_apart_from_one_it_does_not():
    from rlhf_lit.functional.length_bias import length_adjusted_change, within_group_slope

    before, len_before = torch.tensor([1.0, 2, 3]), torch.tensor([10, 20, 30])
    # within each policy the score rises 0.1 per token: S_xy = 20 + 20, S_xx = 200 + 200 -> slope 0.1
    assert within_group_slope([before, before + 2], [len_before, len_before]) == pytest.approx(0.1)
    # better at the same lengths: change 2, all of it beyond length
    better = length_adjusted_change(before, before + 2, len_before, len_before)
    assert better["change"] == pytest.approx(2.0) and better["change_se"] == 0.0
    assert better["length_part"] == 0.0 and better["adjusted_change"] == pytest.approx(2.0)
    # 10 tokens longer and scored along the same line: change 1 = 0.1 * 10, nothing left once length is out
    longer = length_adjusted_change(before, before + 1, len_before, len_before + 10)
    assert longer["change"] == pytest.approx(1.0) and longer["length_part"] == pytest.approx(1.0)
    assert longer["adjusted_change"] == pytest.approx(0.0, abs=1e-12)
    # lengths that never vary within a policy carry no length effect: slope 0
    assert within_group_slope([before], [torch.tensor([5, 5, 5])]) == 0.0


def test_report_on_one_pair():
    """One validation pair (a reward run with val_size=1): every value that one pair defines, NaN for the
    spreads it does not (an SE needs 2 values). Margin -0.5 (wrong); lengths 10 vs 14: d = 4/14 = 0.286, the
    25-50pct bucket, not length-matched; the rule credits the longer (rejected) one: 0."""
    chosen, rejected = torch.tensor([0.2]), torch.tensor([0.7])
    report = length_bias_report(chosen - rejected, torch.tensor([10]), torch.tensor([14]), chosen, rejected)
    assert (report["accuracy"], report["length_rule_accuracy"]) == (0.0, 0.0)
    assert math.isnan(report["accuracy_se"]) and math.isnan(report["length_rule_accuracy_se"])
    vs = report["vs_length_rule"]
    assert vs["difference"] == 0.0 and math.isnan(vs["se"]) and math.isnan(vs["z"])
    assert report["length_matched"]["pairs"] == 0 and report["length_matched"]["fraction"] == 0.0
    assert math.isnan(report["length_matched"]["accuracy"])
    assert report["by_length_diff"]["25-50pct"] == {
        "pairs": 1,
        "fraction": 1.0,
        "accuracy": 0.0,
        "length_rule_accuracy": 0.0,
    }
    # two responses: scores [0.2, 0.7] against lengths [10, 14], the same order: rho = 1 (torchmetrics' eps)
    assert report["score_length_spearman"] == pytest.approx(1.0, abs=1e-4)
