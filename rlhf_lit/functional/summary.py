"""Summaries of a sample: the mean and its standard error, with the edge cases defined once.

Notation: N values (any shape, flattened).
"""

from __future__ import annotations

import math

import torch

__all__ = ["mean_se"]


def mean_se(values: torch.Tensor | list[float]) -> tuple[float, float]:
    """The mean of N values and its standard error ``s / sqrt(N)``, with ``s`` the sample (Bessel-corrected,
    ``N - 1``) standard deviation (any statistics textbook, e.g. Wasserman 2004, "All of Statistics", 6.3).

    Edge cases: N = 0 gives ``(nan, nan)`` (no mean); N = 1 gives ``(x, nan)`` (one value says nothing about
    its spread). Non-finite values propagate. E.g. ``[1, 2, 3, 6]``: mean 3, s^2 = (4 + 1 + 0 + 9) / 3, so
    SE = sqrt(14 / 3) / 2 = 1.0801.
    """
    x = torch.as_tensor(values, dtype=torch.float64).flatten()
    n = x.numel()
    if n == 0:
        return math.nan, math.nan
    mean = float(x.mean())
    if n == 1:
        return mean, math.nan
    return mean, float(x.std(unbiased=True)) / math.sqrt(n)
