"""Reward-model calibration: temperature scaling, expected calibration error, reliability bins.

Notation:
    N number of examples; margins (N,) are reward differences ``r_chosen - r_rejected`` in logits.
    logits (N,), labels (N,) in {0, 1}; probs (N,) in [0, 1]; T the temperature (> 0).
    M = n_bins equal-width bins over [0, 1]; bin k holds ``k/M <= p < (k+1)/M``.

Temperature scaling (Guo et al. 2017, "On Calibration of Modern Neural Networks", section 4.2)
fits one scalar T on held-out data by minimising the negative log-likelihood of
``sigmoid(logit / T)``; it changes confidence, never the ranking (accuracy is unchanged). For a
Bradley–Terry reward model the logit of "chosen beats rejected" is the margin; a pair is fed in both
orderings (``pairwise_calibration_inputs``) so the probabilities cover [0, 1] symmetrically.

ECE (Naeini et al. 2015; Guo et al. 2017, eq. 3) is ``sum_k (n_k / N) |acc_k - conf_k|``. We
delegate it to torchmetrics and bin the reliability diagram the same way, with one departure from
torchmetrics: a probability of exactly 1.0 (a float32 sigmoid of a margin above ~17) goes into the
last bin, where torchmetrics would put it in an extra (M+1)-th bin of its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "TEMPERATURE_BOUNDS",
    "fit_temperature",
    "pairwise_calibration_inputs",
    "expected_calibration_error",
    "reliability_bins",
    "binary_nll",
]


# The interval fit_temperature searches; a fitted T on either end is reported as unreliable.
TEMPERATURE_BOUNDS = (1e-2, 1e2)


def _check_pairs(x: Tensor, labels: Tensor, name: str, binary: bool = True) -> None:
    if x.dim() != 1 or x.shape != labels.shape:
        raise ValueError(f"{name} and labels must both be (N,); got {tuple(x.shape)}, {tuple(labels.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty")
    if binary and not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError("labels must be 0 or 1")
    if not binary and bool(((labels < 0) | (labels > 1)).any()):
        raise ValueError("labels must lie in [0, 1]")


def fit_temperature(
    logits: Tensor, labels: Tensor, min_temperature: float = 1e-2, max_temperature: float = 1e2
) -> float:
    """Temperature T minimising the mean binary cross-entropy of ``sigmoid(logits / T)``.

    The loss is convex in ``s = 1 / T`` (softplus of a linear function), so its derivative in s,
    ``mean(logits * (sigmoid(s * logits) - labels))``, is increasing and has at most one root.
    We find it by bisection over ``log T`` in float64 (deterministic, 200 halvings at most) instead
    of the L-BFGS of Guo et al. 2017; if the root lies outside the bounds the nearer bound is
    returned (e.g. ``max_temperature`` when the logits carry no information about the labels).

    Args:
        logits: (N,) uncalibrated logits, e.g. reward margins of held-out pairs.
        labels: (N,) targets in {0, 1} (soft targets in [0, 1] also work).
        min_temperature: Lower bound, > 0.
        max_temperature: Upper bound, > ``min_temperature``.

    Returns:
        The fitted temperature as a Python float; divide logits by it.

    Raises:
        ValueError: On shape mismatch, empty input, labels outside [0, 1] or invalid bounds.
    """
    _check_pairs(logits, labels, "logits", binary=False)
    if not 0 < min_temperature < max_temperature:
        raise ValueError(
            f"need 0 < min_temperature < max_temperature, got {min_temperature}, {max_temperature}"
        )
    z = logits.detach().to(torch.float64).cpu()
    y = labels.detach().to(torch.float64).cpu()

    def slope(log_t: float) -> float:  # d loss / d s at s = exp(-log_t); decreasing in log_t
        return float((z * (torch.sigmoid(z * math.exp(-log_t)) - y)).mean())

    lo, hi = math.log(min_temperature), math.log(max_temperature)
    if slope(lo) <= 0:  # loss still falling at the smallest T: the optimum is at or below it
        return min_temperature
    if slope(hi) >= 0:  # loss still falling as T grows
        return max_temperature
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if slope(mid) > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return math.exp(0.5 * (lo + hi))


def pairwise_calibration_inputs(margins: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Probabilities and labels of both orderings of every preference pair.

    ``p = sigmoid(margin / T)`` labelled 1 ("chosen beats rejected"), then ``1 - p`` (computed as
    ``sigmoid(-margin / T)``) labelled 0 ("rejected beats chosen").

    Args:
        margins: (N,) reward margins ``r_chosen - r_rejected``.
        temperature: T > 0 from ``fit_temperature``.

    Returns:
        ``(probs, labels)``: probs (2N,) float; labels (2N,) long, the first N ones then N zeros.

    Raises:
        ValueError: If ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = margins.detach().float().flatten() / temperature
    probs = torch.cat([torch.sigmoid(scaled), torch.sigmoid(-scaled)])
    n = scaled.numel()
    labels = torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)]).to(probs.device)
    return probs, labels


def _below_one(probs: Tensor) -> Tensor:
    """Map p == 1.0 to the largest float below 1, so that it falls into the last bin."""
    probs = probs.detach().float() if not probs.is_floating_point() else probs.detach()
    one = torch.ones((), dtype=probs.dtype, device=probs.device)
    return torch.minimum(probs, torch.nextafter(one, torch.zeros_like(one)))


def expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int = 10) -> Tensor:
    """Expected calibration error (L1) with ``n_bins`` equal-width bins.

    Thin wrapper over ``torchmetrics.functional.classification.binary_calibration_error``
    (``norm="l1"``), after moving p == 1.0 into the last bin (see the module docstring).

    Args:
        probs: (N,) predicted probabilities of label 1, in [0, 1].
        labels: (N,) labels in {0, 1}.
        n_bins: M, number of bins.

    Returns:
        0-dim tensor in [0, 1].

    Raises:
        ValueError: On shape mismatch, empty input or labels other than 0 and 1.
    """
    _check_pairs(probs, labels, "probs")
    # imported here: torchmetrics takes seconds to import and is only needed for this metric
    from torchmetrics.functional.classification import binary_calibration_error

    return binary_calibration_error(_below_one(probs), labels.long(), n_bins=n_bins, norm="l1")


def reliability_bins(probs: Tensor, labels: Tensor, n_bins: int = 10) -> tuple[Tensor, Tensor, Tensor]:
    """Per-bin mean confidence, accuracy and count for a reliability diagram.

    Bins are those of ``expected_calibration_error``, so
    ``sum_k counts_k / N * |accuracy_k - mean_confidence_k|`` (over non-empty bins) equals the ECE.

    Args:
        probs: (N,) predicted probabilities of label 1, in [0, 1].
        labels: (N,) labels in {0, 1}.
        n_bins: M, number of bins.

    Returns:
        ``(mean_confidence, accuracy, counts)``, each (M,): the mean of ``probs`` and the fraction of
        label 1 in each bin (NaN for an empty bin, so plots leave a gap), and the count (float).

    Raises:
        ValueError: On shape mismatch, empty input or labels other than 0 and 1.
    """
    _check_pairs(probs, labels, "probs")
    conf = _below_one(probs)
    # the same boundaries and bucketing as torchmetrics' _binning_bucketize
    boundaries = torch.linspace(0, 1, n_bins + 1, dtype=conf.dtype, device=conf.device)
    index = (torch.bucketize(conf, boundaries, right=True) - 1).clamp(0, n_bins - 1)
    counts = torch.zeros(n_bins, dtype=conf.dtype, device=conf.device).index_add(
        0, index, torch.ones_like(conf)
    )
    conf_sum = torch.zeros_like(counts).index_add(0, index, conf)
    hits = torch.zeros_like(counts).index_add(0, index, labels.to(conf.dtype))
    empty = counts == 0
    nan = torch.full_like(counts, float("nan"))
    mean_confidence = torch.where(empty, nan, conf_sum / counts.clamp(min=1))
    accuracy = torch.where(empty, nan, hits / counts.clamp(min=1))
    return mean_confidence, accuracy, counts


def binary_nll(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """Mean binary cross-entropy of ``sigmoid(logits / T)`` against ``labels`` (N,), in nats (0-dim).

    The objective ``fit_temperature`` minimises; log it before and after calibration.
    """
    return F.binary_cross_entropy_with_logits(logits.float() / temperature, labels.float())
