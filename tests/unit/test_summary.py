"""``functional.summary``: ``mean_se`` (hand-computed means and standard errors, the defined edge cases) and
``all_finite``."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lit.functional.summary import all_finite, mean_se


def test_mean_and_standard_error_by_hand():
    # [1, 2, 3, 6]: mean 3; deviations -2, -1, 0, 3 -> s^2 = (4 + 1 + 0 + 9) / 3 = 14 / 3; SE = sqrt(14/3) / 2
    mean, se = mean_se([1.0, 2.0, 3.0, 6.0])
    assert mean == 3.0 and se == pytest.approx(math.sqrt(14 / 3) / 2, rel=1e-12)
    # [2, 4]: mean 3, s^2 = (1 + 1) / 1 = 2, SE = sqrt(2) / sqrt(2) = 1
    assert mean_se(torch.tensor([2.0, 4.0])) == pytest.approx((3.0, 1.0))


def test_empty_and_single_samples_are_defined():
    mean, se = mean_se([])  # no values: no mean, no error
    assert math.isnan(mean) and math.isnan(se)
    mean, se = mean_se([5.0])  # one value: its mean, but nothing about its spread
    assert mean == 5.0 and math.isnan(se)


def test_more_of_the_same_spread_shrinks_the_error():
    # [0, 1]: s^2 = 0.5, SE = sqrt(0.5 / 2) = 0.5; [0, 1] x 4: s^2 = 8 x 0.25 / 7 = 2/7, SE = sqrt(2/7 / 8) = 0.18898
    assert mean_se([0.0, 1.0])[1] == pytest.approx(0.5)
    assert mean_se([0.0, 1.0] * 4)[1] == pytest.approx(math.sqrt(2 / 7 / 8), rel=1e-12)


def test_every_report_uses_this_one_definition():
    # the demo report, the evaluate command, the length-bias figures and the experiments all import it;
    # a private copy (each once had one, with different n = 0 / n = 1 cases) fails here
    import experiments.constraint_eval as constraint_eval
    import experiments.heldout_rm.callback as heldout_callback
    import experiments.heldout_rm.report as heldout_report
    import rlhf_lit.demo.report as demo_report
    import rlhf_lit.evaluation.report as evaluation_report
    import rlhf_lit.functional.length_bias as length_bias

    for module in (
        constraint_eval,
        heldout_callback,
        heldout_report,
        demo_report,
        evaluation_report,
        length_bias,
    ):
        assert module.mean_se is mean_se, module.__name__
    assert not hasattr(length_bias, "mean_and_se")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_one_non_finite_element_anywhere(dtype, bad):
    # lengths around SIMD widths (8, 16 lanes) and a long one; the bad element at the start, a lane edge, the end
    for n in (1, 7, 16, 17, 4099):
        for i in sorted({0, min(8, n - 1), n - 1}):
            x = torch.arange(n, dtype=torch.float64).to(dtype)
            x[i] = bad
            assert not all_finite([torch.ones(3, dtype=dtype), x]), (n, i)
    x = torch.zeros(40, 30, dtype=dtype).t()  # not contiguous
    x[29, 39] = bad
    assert not all_finite([x])


def test_all_finite_is_true_for_finite_values_at_the_ends_of_the_range_and_for_nothing():
    big = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0])
    tiny = torch.tensor([torch.finfo(torch.float32).tiny / 4])  # subnormal
    assert all_finite([big, tiny, torch.tensor([1.0], dtype=torch.bfloat16)])  # mixed dtypes
    assert all_finite([torch.tensor([1e300, -1e300], dtype=torch.float64), big])  # no cast to a narrower dtype
    assert all_finite([]) and all_finite([torch.empty(0), torch.empty(3, 0)])
    assert not all_finite([torch.empty(0), torch.tensor([math.nan])])
