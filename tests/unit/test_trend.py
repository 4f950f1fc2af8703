"""linear_trend: hand-computed slopes and standard errors."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lit.functional.trend import linear_trend


def test_slope_and_standard_error_by_hand():
    # x = [0, 1, 2], x_mean 1, dx = [-1, 0, 1], Sxx = 2; y = [1, 2, 4], y_mean 7/3
    # slope = (-1 * (1 - 7/3) + 1 * (4 - 7/3)) / 2 = (4/3 + 5/3) / 2 = 1.5
    # fitted = 7/3 + 1.5 * dx = [5/6, 7/3, 23/6]; residuals [1/6, -1/3, 1/6]; SSE = 1/36 + 1/9 + 1/36 = 1/6
    # s^2 = SSE / (n - 2) = 1/6; se = sqrt(1/6 / 2) = 0.288675
    slope, se = linear_trend(torch.tensor([1.0, 2.0, 4.0]))
    assert slope == pytest.approx(1.5)
    assert se == pytest.approx(math.sqrt(1 / 12))


def test_a_falling_series_has_a_negative_slope_and_a_line_has_no_error():
    slope, se = linear_trend(torch.tensor([3.0, 2.0, 1.0, 0.0]))
    assert slope == pytest.approx(-1.0)
    assert se == pytest.approx(0.0, abs=1e-12)


def test_noise_around_a_flat_line_is_not_a_trend():
    # [0, 1, 0, 1, 0, 1]: dx = [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5], Sxx = 17.5, y - 0.5 = -+0.5 alternating:
    # Sxy = 1.25 - 0.75 + 0.25 + 0.25 - 0.75 + 1.25 = 1.5 -> slope = 1.5 / 17.5 = 0.0857, smaller than its se
    slope, se = linear_trend(torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]))
    assert slope == pytest.approx(1.5 / 17.5)
    assert abs(slope / se) < 1.0


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan"), 2.0])])
def test_short_or_non_finite_series_are_refused(bad):
    with pytest.raises(ValueError):
        linear_trend(bad)
