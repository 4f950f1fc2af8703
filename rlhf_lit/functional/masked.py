"""Statistics over the real tokens of a padded batch: sum, mean, variance, whitening.

Notation:
    B  batch size, R response length (any trailing shape works where noted).
    mask  bool or 0/1 tensor broadcastable to ``values``; True = a real token, False = padding.
    n  the number of real tokens (summed over all ranks when ``distributed=True``).

Padding never enters a statistic: padded entries are replaced by 0 with ``torch.where`` before any
arithmetic, so even ``inf`` or ``nan`` at a padded slot (a critic's output on a pad token, say)
cannot leak into the result. Means and variances are accumulated in float64 and returned in the
dtype of ``values``; the variance is the two-pass form ``sum((x - mean)^2) / n`` rather than
``E[x^2] - E[x]^2``, which cancels catastrophically when ``|mean| >> std``.

With ``distributed=True`` and an initialised default process group, the sums and counts are
all-reduced (SUM) so every rank gets the statistics of the global batch (needed when advantages
are whitened under DDP/FSDP). Without an initialised group the flag is a no-op. The all-reduced
quantities from other ranks are constants for autograd: gradients flow only through this rank's
tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_weighted_mean", "masked_whiten"]


def _dist_active(distributed: bool) -> bool:
    return distributed and dist.is_available() and dist.is_initialized()


def _global_sum(local: Tensor, distributed: bool) -> Tensor:
    """Sum ``local`` over ranks when distributed; the other ranks' share carries no gradient."""
    if not _dist_active(distributed):
        return local
    reduced = local.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return local + (reduced - local.detach())


def _check_mask(values: Tensor, mask: Tensor) -> Tensor:
    if mask.dtype != torch.bool:
        mask = mask.bool()
    try:
        torch.broadcast_shapes(values.shape, mask.shape)
    except RuntimeError as err:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to values of shape {tuple(values.shape)}"
        ) from err
    return mask


def _moments(values: Tensor, mask: Tensor, distributed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Return (n, mean, sum of squared deviations) over real tokens, all float64 0-dim tensors."""
    mask = _check_mask(values, mask)
    x = torch.where(mask, values.to(torch.float64), 0.0)
    mask = mask.expand_as(x)
    n = _global_sum(mask.sum().to(torch.float64), distributed)
    mean = _global_sum(x.sum(), distributed) / n.clamp(min=1.0)
    sq_dev = torch.where(mask, (x - mean) ** 2, 0.0)  # second pass, about the global mean
    return n, mean, _global_sum(sq_dev.sum(), distributed)


def masked_sum(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``values`` over real tokens.

    Args:
        values: Float tensor, e.g. (B, R).
        mask: Bool or 0/1 tensor broadcastable to ``values``; True = real token.
        dim: Dimension(s) to reduce; None reduces everything to a 0-dim tensor.

    Returns:
        The masked sum, in the dtype of ``values``; 0 where every entry is padding.

    Raises:
        ValueError: If ``mask`` does not broadcast to ``values``.
    """
    mask = _check_mask(values, mask)
    x = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(
    values: Tensor,
    mask: Tensor,
    dim: int | tuple[int, ...] | None = None,
    distributed: bool = False,
) -> Tensor:
    """Mean of ``values`` over real tokens (a token-level mean, not a mean of row means).

    Args:
        values: Float tensor, e.g. (B, R).
        mask: Bool or 0/1 tensor broadcastable to ``values``; True = real token.
        dim: Dimension(s) to reduce, e.g. ``-1`` for a per-row mean of shape (B,); None reduces
            everything to a 0-dim tensor.
        distributed: All-reduce the sum and the count over the default process group, so the mean
            is over the real tokens of every rank. Only with ``dim=None``.

    Returns:
        The masked mean in the dtype of ``values``. A fully masked row (or tensor) gives 0, never NaN.

    Raises:
        ValueError: If ``mask`` does not broadcast, or if ``distributed`` is combined with ``dim``.
    """
    if distributed and dim is not None:
        raise ValueError("masked_mean(distributed=True) reduces over all tokens; pass dim=None")
    mask = _check_mask(values, mask)
    total = masked_sum(values.to(torch.float64), mask, dim)
    count = mask.expand(torch.broadcast_shapes(values.shape, mask.shape)).to(torch.float64)
    count = count.sum() if dim is None else count.sum(dim=dim)
    total = _global_sum(total, distributed)
    count = _global_sum(count, distributed)
    return (total / count.clamp(min=1.0)).to(values.dtype)


def masked_weighted_mean(values: Tensor, mask: Tensor, weights: Tensor | None = None) -> Tensor:
    """``sum(w * x) / sum(w)`` over real tokens: a loss aggregation other than the plain token mean.

    Args:
        values: Float tensor, e.g. per-token losses (B, R).
        mask: Bool or 0/1, broadcastable to ``values``; True = real token.
        weights: Non-negative weights shaped like ``values`` (e.g. ``1 / length`` of each token's response
            for a mean of per-response means); None = :func:`masked_mean`.

    Returns:
        0-dim tensor in the dtype of ``values``; 0 when no real token has weight. E.g. values
        ``[[1, 3], [5, pad]]``, weights ``[[0.5, 0.5], [1, 0]]`` -> (0.5 + 1.5 + 5) / 2 = 3.5 (the token mean
        is 3).
    """
    if weights is None:
        return masked_mean(values, mask)
    mask = _check_mask(values, mask)
    w = torch.where(mask, weights.to(torch.float64), 0.0)
    total = (w * torch.where(mask, values.to(torch.float64), 0.0)).sum()
    return (total / w.sum().clamp(min=torch.finfo(torch.float64).tiny)).to(values.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True, distributed: bool = False) -> Tensor:
    """Variance of ``values`` over all real tokens.

    Args:
        values: Float tensor, e.g. (B, R).
        mask: Bool or 0/1 tensor broadcastable to ``values``; True = real token.
        unbiased: Divide by ``n - 1`` (Bessel's correction) instead of ``n``.
        distributed: Use the real tokens of every rank (see the module docstring).

    Returns:
        0-dim tensor in the dtype of ``values``. 0 when ``n <= 1`` (where the unbiased estimate
        would be NaN).

    Raises:
        ValueError: If ``mask`` does not broadcast to ``values``.
    """
    n, _, sq_dev = _moments(values, mask, distributed)
    denom = n - 1.0 if unbiased else n
    var = torch.where(n > 1, sq_dev / denom.clamp(min=1.0), torch.zeros_like(sq_dev))
    return var.to(values.dtype)


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    unbiased: bool = True,
    eps: float = 1e-8,
    distributed: bool = False,
) -> Tensor:
    """Standardise ``values`` with the mean and variance of the real tokens.

    ``(x - mean) * rsqrt(var + eps)``, or ``x * rsqrt(var + eps)`` when ``shift_mean=False``
    (scale only: the mean is neither removed nor added back).

    Args:
        values: Float tensor, e.g. advantages (B, R).
        mask: Bool or 0/1 tensor broadcastable to ``values``; True = real token.
        shift_mean: Subtract the mean. False keeps the sign and offset of every token.
        unbiased: Use the unbiased variance (``n - 1``), as PPO implementations usually do.
        eps: Added to the variance before the reciprocal square root.
        distributed: Use the statistics of the real tokens of every rank.

    Returns:
        Tensor shaped like ``values`` (same dtype); padded positions are 0. With ``n <= 1`` the
        variance is undefined and the scale factor is 1: a single real token whitens to 0
        (``shift_mean=True``) or is returned unchanged (``shift_mean=False``), never NaN.

    Raises:
        ValueError: If ``mask`` does not broadcast to ``values``.
    """
    mask = _check_mask(values, mask)
    n, mean, sq_dev = _moments(values, mask, distributed)
    denom = n - 1.0 if unbiased else n
    var = sq_dev / denom.clamp(min=1.0)
    scale = torch.where(n > 1, torch.rsqrt(var + eps), torch.ones_like(var))
    x = values.to(torch.float64)
    out = (x - mean) * scale if shift_mean else x * scale
    return torch.where(mask, out, 0.0).to(values.dtype)
