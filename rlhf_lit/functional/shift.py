"""How far one sample's distribution sits from a reference: the standardised mean difference.

Used to say when a reward model's calibration (a temperature fitted on its validation pairs) may not
transfer to a new file: when the new file's response lengths or scores have moved far from those of the
validation pairs. Notation: a summary is ``(mean, sd)`` of one quantity (e.g. response length in tokens, or the
uncalibrated score) over a sample.
"""

from __future__ import annotations

import math

import torch


def mean_and_sd(values: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased standard deviation of ``(M,)`` values, in their unit; NaN for M = 0, SD NaN for M = 1.

    Example: [1, 2, 3, 6] gives mean 3 and SD sqrt(((-2)^2 + 1 + 0 + 9) / 3) = sqrt(14 / 3) = 2.1602.
    """
    n = values.numel()
    if n == 0:
        return math.nan, math.nan
    v = values.double().flatten()
    return float(v.mean()), float(v.std(unbiased=True)) if n > 1 else math.nan


def standardized_mean_difference(reference: tuple[float, float], sample: tuple[float, float]) -> float:
    """Cohen's d of ``sample`` against ``reference``: ``(mean_s - mean_r) / sqrt((sd_r^2 + sd_s^2) / 2)``.

    The difference of the means in units of the pooled standard deviation (Cohen 1988, "Statistical Power
    Analysis for the Behavioral Sciences", section 2.2; the pooled SD here weighs both samples equally, as
    their sizes are not part of a summary). |d| = 0.5 is Cohen's "medium" effect.

    Args:
        reference: ``(mean, sd)`` of the reference sample.
        sample: ``(mean, sd)`` of the sample compared with it, in the same unit.

    Returns:
        d (unitless, signed: > 0 when the sample's mean is higher). When both SDs are 0: 0 for equal means,
        +-inf otherwise. NaN if any input is NaN.

    Raises:
        ValueError: if an SD is negative.

    Example: reference (100, 30), sample (130, 40): 30 / sqrt((900 + 1600) / 2) = 30 / 35.355 = 0.8485.
    """
    (m_r, s_r), (m_s, s_s) = reference, sample
    if s_r < 0 or s_s < 0:
        raise ValueError(f"standard deviations must be >= 0, got {s_r} and {s_s}")
    values = (m_r, s_r, m_s, s_s)
    if any(math.isnan(v) for v in values):
        return math.nan
    pooled = math.sqrt((s_r * s_r + s_s * s_s) / 2)
    if pooled == 0:
        return 0.0 if m_s == m_r else math.copysign(math.inf, m_s - m_r)
    return (m_s - m_r) / pooled


def response_summary(
    chosen: torch.Tensor, rejected: torch.Tensor, len_c: torch.Tensor, len_r: torch.Tensor
) -> dict:
    """The distribution a reward model was calibrated on, over all 2N responses of N pairs: ``pairs``,
    ``response_tokens`` and ``score`` (uncalibrated), each ``{"mean", "sd"}``. The export records it
    (``validation_summary`` in ``rlhf_lit.json``) so that ``rlhf-lit evaluate`` can say when a file's
    responses sit far from it (``rlhf_lit.evaluation``)."""
    lengths = mean_and_sd(torch.cat([len_c, len_r]).double())
    scores = mean_and_sd(torch.cat([chosen, rejected]).double())
    return {
        "pairs": int(chosen.numel()),
        "response_tokens": {"mean": lengths[0], "sd": lengths[1]},
        "score": {"mean": scores[0], "sd": scores[1]},
    }
