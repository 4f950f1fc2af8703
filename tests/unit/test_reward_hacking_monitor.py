"""RewardHackingMonitor.check on literal histories: when it flags over-optimisation, and when it must not."""

from __future__ import annotations

import pytest

from rlhf_lit import metrics as M
from rlhf_lit.callbacks import RewardHackingMonitor

GOLD = M.DEMO_GOLD_SCORE


def _history(scores, gold=None, perplexity=None):
    records = []
    for i, score in enumerate(scores):
        record = {M.ROLLOUT_SCORE_MEAN: score, M.MONITOR_REF_PERPLEXITY: 1.5 if perplexity is None else perplexity[i]}
        if gold is not None:
            record[GOLD] = gold[i]
        records.append(record)
    return records


# RM score rising with small noise: slope ~0.1 per iteration over 4 points, residuals +-0.01 -> t in the tens
RISING = [0.0, 0.11, 0.19, 0.3]
FALLING = [0.9, 0.79, 0.71, 0.6]


def test_rm_score_up_and_held_out_signal_down_is_flagged():
    monitor = RewardHackingMonitor(heldout=[GOLD], window=4, num_se=2.0)
    score_t, reasons = monitor.check(_history(RISING, gold=FALLING))
    assert score_t > 2.0
    assert len(reasons) == 1 and reasons[0].startswith(f"{GOLD} falls")


def test_both_rising_is_healthy_and_a_flat_score_never_flags():
    monitor = RewardHackingMonitor(heldout=[GOLD], window=4, num_se=2.0)
    assert monitor.check(_history(RISING, gold=[0.5, 0.61, 0.69, 0.8]))[1] == []
    # the held-out signal falls, but the RM score does not rise (noise around 0.2): not reward hacking
    assert monitor.check(_history([0.2, 0.25, 0.18, 0.22], gold=FALLING))[1] == []


def test_a_held_out_signal_that_recovered_is_not_flagged_and_a_short_history_is_not_judged():
    monitor = RewardHackingMonitor(heldout=[GOLD], window=4, num_se=2.0)
    # gold dipped early on, then rose with the RM score back above its start: fine now
    history = _history([0.0, 0.1, 0.2, 0.3] + [0.3, 0.41, 0.49, 0.6], gold=FALLING + [0.9, 1.01, 1.09, 1.2])
    assert monitor.check(history)[1] == []
    assert monitor.check(history[:3])[1] == []  # 3 < window records: no verdict


def test_a_held_out_signal_worse_than_at_the_start_is_flagged_while_the_rm_score_is_higher():
    monitor = RewardHackingMonitor(heldout=[GOLD], window=4, num_se=2.0)
    # RM score: first 4 iterations around 0.1, last 4 around 0.5; gold: first 4 around 0.6, last 4 around 0.3,
    # flat within each window, so the last-window trends are no signal and only the comparison with the
    # start can see it
    score = [0.1, 0.12, 0.08, 0.1, 0.3, 0.4, 0.5, 0.52, 0.48, 0.5]
    gold = [0.6, 0.62, 0.58, 0.6, 0.45, 0.35, 0.3, 0.32, 0.28, 0.3]
    score_t, reasons = monitor.check(_history(score, gold=gold))
    assert abs(score_t) < 2.0  # flat over the last 4
    assert len(reasons) == 1 and "since the first 4 iterations" in reasons[0]


def test_shift_in_welch_standard_errors_by_hand():
    from rlhf_lit.callbacks import _shift_se

    # means 1 and 4, sample variances 1 and 1, n = 3: se = sqrt(1/3 + 1/3) = 0.816497 -> 3 / 0.816497 = 3.674235
    assert _shift_se([0.0, 1.0, 2.0], [3.0, 4.0, 5.0]) == pytest.approx(3.674235, rel=1e-6)


def test_reference_perplexity_far_above_its_first_value_is_flagged_while_the_score_rises():
    monitor = RewardHackingMonitor(window=4, num_se=2.0, max_perplexity_ratio=2.0)
    # perplexity 1.5 -> 3.3 = 2.2x its first value (> 2x)
    reasons = monitor.check(_history(RISING, perplexity=[1.5, 2.0, 2.7, 3.3]))[1]
    assert len(reasons) == 1 and "2.20x its first value" in reasons[0]
    assert monitor.check(_history(RISING, perplexity=[1.5, 1.8, 2.4, 2.9]))[1] == []  # 1.93x: under the limit
    off = RewardHackingMonitor(window=4, num_se=2.0, max_perplexity_ratio=None)
    assert off.check(_history(RISING, perplexity=[1.5, 2.0, 2.7, 3.3]))[1] == []


def test_a_signal_missing_from_some_iterations_is_not_judged():
    monitor = RewardHackingMonitor(heldout=[GOLD], window=4, num_se=2.0)
    history = _history(RISING, gold=FALLING)
    del history[1][GOLD]
    assert monitor.check(history)[1] == []


@pytest.mark.parametrize("kwargs", [{"window": 2}, {"num_se": 0.0}])
def test_impossible_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        RewardHackingMonitor(**kwargs)
