"""Summaries of a sample: the mean and its standard error, with the edge cases defined once; whether tensors
are all finite.

Notation: N values (any shape, flattened).
"""

from __future__ import annotations

import math

import torch

__all__ = ["all_finite", "mean_se"]


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


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when no element of any of ``tensors`` (floating point, any shapes, on one device) is inf or
    nan; True for an empty list, and empty tensors are passed over.

    One pass per tensor: the min and max of each (``torch.aminmax``, which returns nan when a nan is present) are
    all finite exactly when every element is (no sum or square that could overflow). ``torch.isfinite(t).all()``
    reads each tensor several times and writes a mask as large as it: measured on AMD EPYC (family 25 model 1),
    2 threads, quiet, over the 53 gradients (4.3 M values) of the benchmark's 4-layer, 256-wide GPT-2 it took
    6.8-11.6 ms against 0.8-1.2 ms here, and over 16.5 M values 73 ms against 3 ms; checked every optimizer step.
    """
    # the ends stacked per dtype, never cast: in float32 a finite float64 above 3.4e38 would read as inf
    ends: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            ends.setdefault(t.dtype, []).extend(torch.aminmax(t.detach()))
    return all(bool(torch.isfinite(torch.stack(same)).all()) for same in ends.values())
