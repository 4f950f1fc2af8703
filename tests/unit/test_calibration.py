"""Temperature scaling, pairwise calibration inputs, ECE and reliability bins."""

import math

import pytest
import torch
from torch.testing import assert_close
from torchmetrics.functional.classification import binary_calibration_error

from rlhf_lit.functional import (
    binary_nll,
    expected_calibration_error,
    fit_temperature,
    pairwise_calibration_inputs,
    reliability_bins,
)


def close(actual, expected, atol=1e-6):
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


def synthetic(t_true: float, n: int = 20000, seed: int = 0):
    """True margins z ~ N(0, 3^2), labels ~ Bernoulli(sigmoid(z)), model logits z * T_true."""
    gen = torch.Generator().manual_seed(seed)
    z = 3.0 * torch.randn(n, generator=gen)
    labels = torch.bernoulli(torch.sigmoid(z), generator=gen)
    return z * t_true, labels


# ---------------------------------------------------------------- fit_temperature


def test_fit_temperature_hand_case():
    # all logits 1, three of four labels 1: the NLL is minimal where sigmoid(1/T) = 0.75,
    # i.e. 1/T = ln 3, T = 1/ln 3 = 0.910239
    logits, labels = torch.ones(4), torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert fit_temperature(logits, labels) == pytest.approx(1 / math.log(3), rel=1e-9)
    # doubling the logits doubles T: 2/ln 3 = 1.820478
    assert fit_temperature(2 * logits, labels) == pytest.approx(2 / math.log(3), rel=1e-9)


@pytest.mark.parametrize("t_true", [0.5, 2.5])
def test_fit_temperature_recovers_known_temperature(t_true):
    logits, labels = synthetic(t_true)
    assert fit_temperature(logits, labels) == pytest.approx(t_true, rel=0.05)


def test_fit_temperature_property_is_a_minimum_of_the_nll():
    logits, labels = synthetic(2.5, n=4000, seed=1)
    t = fit_temperature(logits, labels)
    best = binary_nll(logits, labels, t)
    for other in (t * 1.05, t / 1.05, 1.0):
        assert best < binary_nll(logits, labels, other)


def test_fit_temperature_bounds_and_errors():
    # separable and right: sharpening always helps -> the lower bound
    assert fit_temperature(torch.tensor([2.0, -2.0]), torch.tensor([1.0, 0.0])) == 1e-2
    # anti-correlated: the best positive T is as flat as allowed -> the upper bound
    assert fit_temperature(torch.tensor([2.0, -2.0]), torch.tensor([0.0, 1.0]), max_temperature=50.0) == 50.0
    with pytest.raises(ValueError, match="empty"):
        fit_temperature(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fit_temperature(torch.ones(2), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="min_temperature"):
        fit_temperature(torch.ones(2), torch.ones(2), min_temperature=2.0, max_temperature=1.0)


# ---------------------------------------------------------------- pairwise inputs


def test_pairwise_calibration_inputs_both_orderings():
    probs, labels = pairwise_calibration_inputs(torch.tensor([0.0, math.log(3)]))
    # sigmoid(0) = 0.5, sigmoid(ln 3) = 3/4; then the reversed pairs 1 - p
    close(probs, [0.5, 0.75, 0.5, 0.25])
    assert labels.tolist() == [1, 1, 0, 0]
    probs_t, _ = pairwise_calibration_inputs(torch.tensor([0.0, 2 * math.log(3)]), temperature=2.0)
    close(probs_t, [0.5, 0.75, 0.5, 0.25])
    with pytest.raises(ValueError, match="temperature"):
        pairwise_calibration_inputs(torch.zeros(2), temperature=0.0)


# ---------------------------------------------------------------- ECE and reliability bins

PROBS = torch.tensor([0.85, 0.85, 0.85, 0.85, 0.25, 0.25])
LABELS = torch.tensor([1, 1, 1, 0, 0, 1])


def test_ece_hand_computed():
    # bin 8 [0.8, 0.9): 4 items, conf 0.85, acc 3/4 -> 4/6 * 0.10 = 0.066667
    # bin 2 [0.2, 0.3): 2 items, conf 0.25, acc 1/2 -> 2/6 * 0.25 = 0.083333
    close(expected_calibration_error(PROBS, LABELS, n_bins=10), 0.15)


def test_reliability_bins_hand_computed():
    conf, acc, counts = reliability_bins(PROBS, LABELS, n_bins=10)
    close(counts, [0, 0, 2, 0, 0, 0, 0, 0, 4, 0])
    close(conf[[2, 8]], [0.25, 0.85])
    close(acc[[2, 8]], [0.5, 0.75])
    assert torch.isnan(conf[counts == 0]).all() and torch.isnan(acc[counts == 0]).all()


def test_perfect_calibration_has_zero_ece():
    probs, labels = torch.full((4,), 0.5), torch.tensor([1, 0, 1, 0])
    close(expected_calibration_error(probs, labels), 0.0)


def _ece_from_bins(probs, labels, n_bins):
    conf, acc, counts = reliability_bins(probs, labels, n_bins)
    seen = counts > 0
    return (counts[seen] / counts.sum() * (acc[seen] - conf[seen]).abs()).sum()


@pytest.mark.parametrize("n_bins", [5, 10, 15])
def test_reliability_bins_reproduce_ece(n_bins):
    gen = torch.Generator().manual_seed(n_bins)
    probs = torch.rand(500, generator=gen)
    probs[:12] = torch.tensor([0.0, 1.0, 1.0, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.6, 0.4, 0.8])  # edges
    labels = torch.bernoulli(probs, generator=gen).long()
    ece = expected_calibration_error(probs, labels, n_bins)
    assert_close(_ece_from_bins(probs, labels, n_bins), ece, atol=1e-6, rtol=0)
    # away from p == 1.0 the wrapper is torchmetrics unchanged
    inner = probs < 1
    assert_close(
        expected_calibration_error(probs[inner], labels[inner], n_bins),
        binary_calibration_error(probs[inner], labels[inner], n_bins=n_bins, norm="l1"),
    )


def test_probability_one_goes_into_the_last_bin():
    _, acc, counts = reliability_bins(torch.tensor([1.0, 0.95]), torch.tensor([1, 0]), n_bins=10)
    assert counts[-1] == 2 and acc[-1] == 0.5
    # both in the last bin: conf 0.975, acc 0.5 -> ECE 0.475
    close(expected_calibration_error(torch.tensor([1.0, 0.95]), torch.tensor([1, 0])), 0.475)


def test_temperature_scaling_lowers_ece_on_overconfident_margins():
    margins, _ = synthetic(3.0, n=4000, seed=2)  # an overconfident RM: margins 3x too large
    gen = torch.Generator().manual_seed(3)
    wins = torch.bernoulli(torch.sigmoid(margins / 3.0), generator=gen)  # 1: chosen really wins
    margins = torch.where(wins.bool(), margins, -margins)  # orient each pair chosen-first
    logits, labels = torch.cat([margins, -margins]), torch.cat([torch.ones(4000), torch.zeros(4000)])
    t = fit_temperature(logits, labels)
    before = expected_calibration_error(*pairwise_calibration_inputs(margins))
    after = expected_calibration_error(*pairwise_calibration_inputs(margins, t))
    assert t == pytest.approx(3.0, rel=0.1)
    assert after < 0.5 * before


def test_ece_rejects_non_binary_labels():
    with pytest.raises(ValueError, match="0 or 1"):
        expected_calibration_error(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"\(N,\)"):
        reliability_bins(torch.tensor([0.5, 0.5]), torch.tensor([1]))
