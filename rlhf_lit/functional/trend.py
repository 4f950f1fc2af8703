"""Trend statistics of a per-iteration series: the least-squares slope and its standard error.

Used by the reward-hacking monitor (``rlhf_lit.callbacks.RewardHackingMonitor``) to decide whether the
reward-model score rises while a held-out signal falls over the last few PPO iterations.

Notation: ``y`` (n,) values at iterations ``x = 0 .. n-1``. Ordinary least squares,
``slope = sum((x - x_mean) (y - y_mean)) / sum((x - x_mean)^2)``; with residuals ``e`` and
``s^2 = sum(e^2) / (n - 2)``, ``se(slope) = s / sqrt(sum((x - x_mean)^2))`` (any statistics textbook, e.g.
Wasserman 2004, "All of Statistics", section 13.1). ``t = slope / se`` is the slope in standard errors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["linear_trend"]


def linear_trend(y: Tensor) -> tuple[float, float]:
    """Least-squares slope of ``y`` against its index, and the slope's standard error.

    Args:
        y: (n,) a series, one value per iteration (float; n >= 3).

    Returns:
        ``(slope, se)`` in units of ``y`` per iteration. ``se`` is 0 when the points lie exactly on a line
        (then ``slope / se`` is +-inf for a non-zero slope, or nan for a flat series: callers compare it
        with a threshold, which nan fails). E.g. ``[1, 2, 4]``: slope 1.5, residuals ``[1/6, -1/3, 1/6]``,
        ``s^2 = 1/6``, ``se = sqrt(1/6) / sqrt(2) = 0.288675``.

    Raises:
        ValueError: If ``y`` is not 1-D with at least 3 values, or holds a non-finite value.
    """
    if y.dim() != 1 or y.numel() < 3:
        raise ValueError(f"linear_trend needs a 1-D series of at least 3 values, got shape {tuple(y.shape)}")
    y = y.detach().to(torch.float64)
    if not bool(torch.isfinite(y).all()):
        raise ValueError("linear_trend: the series holds inf or nan")
    n = y.numel()
    x = torch.arange(n, dtype=torch.float64)
    dx = x - x.mean()
    sxx = float((dx * dx).sum())
    slope = float((dx * (y - y.mean())).sum()) / sxx
    residuals = y - (y.mean() + slope * dx)
    s2 = float((residuals * residuals).sum()) / (n - 2)
    return slope, math.sqrt(max(s2, 0.0) / sxx)
