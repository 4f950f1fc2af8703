"""Running statistics of reward-model scores, and score normalisation and clipping for PPO.

Notation:
    B batch size; scores (B,) are sequence-level reward-model outputs (logit units).
    n, mean, M2: the running count, mean and sum of squared deviations of every score seen;
    var = M2 / n (population variance), std = sqrt(var).

Batch moments are merged into the running ones with the parallel update of Chan, Golub & LeVeque
(1979), which is exact (no drift from the order of batches) and numerically stable:
    delta = mean_b - mean_a,  n = n_a + n_b
    mean  = mean_a + delta * n_b / n
    M2    = M2_a + M2_b + delta^2 * n_a * n_b / n

Normalisation and clipping follow PPO-max (Zheng et al. 2023, "Secrets of RLHF in Large Language
Models Part I: PPO", section 5.3): ``clip((score - mean) / (std + eps), -clip, clip)``. Recommended
order: update the running statistics with the batch first, then normalise it, so that the first
batch is normalised by its own statistics rather than by the (empty) prior.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf_lit.functional.masked import masked_mean, masked_var
from rlhf_lit.functional.policy_gradient import overlong_penalty

__all__ = ["RunningMeanStd", "ScoreShaper", "normalize_scores"]


class RunningMeanStd:
    """Running mean and standard deviation of every score passed to ``update``.

    Args:
        distributed: All-reduce each batch's count, mean and squared deviations over the default
            process group (when initialised) before merging, so every rank holds the same
            statistics of the global batch.

    The state is plain Python numbers (``count`` int, ``mean`` and ``m2`` floats), so
    ``state_dict`` survives ``torch.save`` and restores bit-for-bit. Before any update, ``mean`` is
    0 and ``std`` is 1 (normalising is then the identity up to eps).
    """

    def __init__(self, distributed: bool = False) -> None:
        self.distributed = distributed
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        """Population variance of the scores seen (1.0 before any update)."""
        return self.m2 / self.count if self.count > 0 else 1.0

    @property
    def std(self) -> float:
        """Population standard deviation of the scores seen (1.0 before any update)."""
        return math.sqrt(self.var)

    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        """Merge the moments of the scores ``x`` (any shape, flattened) into the running ones.

        Raises:
            ValueError: If ``x`` contains a non-finite value (it would poison every later update).
        """
        x = x.detach().flatten().to(torch.float64)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("RunningMeanStd.update: scores contain inf or nan")
        batch_count = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
        if self.distributed and dist.is_available() and dist.is_initialized():
            dist.all_reduce(batch_count)
        n_b = int(round(float(batch_count)))
        if n_b == 0:
            return
        ones = torch.ones_like(x, dtype=torch.bool)
        mean_b = float(masked_mean(x, ones, distributed=self.distributed))
        m2_b = float(masked_var(x, ones, unbiased=False, distributed=self.distributed)) * n_b
        n_a, total = self.count, self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / total
        self.m2 += m2_b + delta * delta * n_a * n_b / total
        self.count = total

    def state_dict(self) -> dict[str, Any]:
        """``{"count": int, "mean": float, "m2": float}``."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the statistics saved by ``state_dict``."""
        self.count = int(state_dict["count"])
        self.mean = float(state_dict["mean"])
        self.m2 = float(state_dict["m2"])

    def __repr__(self) -> str:
        return f"RunningMeanStd(count={self.count}, mean={self.mean:.6g}, std={self.std:.6g})"


def normalize_scores(
    scores: Tensor,
    running: RunningMeanStd | None,
    clip: float | None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """Normalise scores with running statistics, then clip them.

    ``(scores - mean) / (std + eps)`` (or ``scores / (std + eps)`` when ``shift_mean=False``),
    then ``clamp(-clip, clip)``. Pure: neither ``scores`` nor ``running`` is modified; the caller
    updates ``running`` with the batch first (see the module docstring).

    Args:
        scores: (B,) reward-model scores.
        running: Running statistics, or None to skip normalisation (clip only).
        clip: Bound c > 0 of the symmetric clip, or None for no clipping.
        shift_mean: Subtract the running mean.
        eps: Added to the standard deviation.

    Returns:
        (B,) new tensor in the dtype of ``scores``.

    Raises:
        ValueError: If ``clip <= 0``, or if a score is inf or nan (clipping would turn +inf into the best
            reward ``+clip``; the message names the indices).
    """
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    finite = torch.isfinite(scores)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        raise ValueError(
            f"normalize_scores: non-finite score(s) at index {bad} ({scores[~finite].tolist()}); clipping "
            "would turn +inf into the best reward"
        )
    out = scores.clone()
    if running is not None:
        centred = out - running.mean if shift_mean else out
        out = centred / (running.std + eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return out


class ScoreShaper:
    """Step 4's shaping of the reward function's scores: ``(B,)`` scores the rewards use: non-finite ones 0,
    minus ``missing_eos_penalty`` without a stop token (only when there is a stop token), plus DAPO's soft
    overlong punishment (``reward.overlong_buffer``; ``functional.policy_gradient.overlong_penalty``), normalised by the
    running statistics (updated with this batch's finite scores, all ranks) and clipped (``reward.normalize``,
    ``reward.clip``; Zheng et al. 2023, section 5.3).

    Args:
        shaping: ``RewardShapingConfig`` (``normalize``, ``clip``, ``missing_eos_penalty``, ``skip_non_finite``).
        stats: the running score statistics (checkpointed by the module).
        has_stop_token: the run has a stop token (else the missing-EOS penalty is not applied).
        max_new_tokens: ``sampling.max_new_tokens`` (the end of the overlong window).
    """

    def __init__(
        self, shaping, stats: RunningMeanStd, has_stop_token: bool, max_new_tokens: int | None = None
    ) -> None:
        self.shaping, self.stats, self.has_stop_token = shaping, stats, has_stop_token
        self.max_new_tokens = max_new_tokens

    def overlong(self, lengths: torch.Tensor | None) -> torch.Tensor | None:
        """``(B,)`` the overlong penalties (<= 0) of responses of ``lengths`` tokens, or None when off."""
        buffer = getattr(self.shaping, "overlong_buffer", None)
        if buffer is None or lengths is None:
            return None
        penalty = self.shaping.overlong_penalty  # None: the function's default, DAPO's 1.0
        factor = {} if penalty is None else {"penalty": penalty}
        return overlong_penalty(lengths, self.max_new_tokens, buffer, **factor)

    def __call__(
        self,
        raw_scores: torch.Tensor,
        finite: torch.Tensor,
        has_stop: torch.Tensor,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shaping = self.shaping
        scores = torch.where(finite, raw_scores, torch.zeros_like(raw_scores))
        if shaping.missing_eos_penalty is not None and self.has_stop_token:
            scores = scores - shaping.missing_eos_penalty * (~has_stop).float()
        penalty = self.overlong(lengths)
        if penalty is not None:
            scores = scores + penalty.to(scores.dtype)
        if shaping.normalize:
            self.stats.update(scores[finite])
        return normalize_scores(scores, self.stats if shaping.normalize else None, shaping.clip)
