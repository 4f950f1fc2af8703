"""PPO's reward-hacking monitor: the RM score's trend against held-out signals, and the score-KL frontier."""

from __future__ import annotations

import logging
import math
import os

import torch
from lightning.pytorch.callbacks import Callback

from rlhf_lit import metrics as M
from rlhf_lit.functional.trend import linear_trend

log = logging.getLogger("rlhf_lit")


def _in_se(change: float, se: float) -> float:
    """``change / se``; +-inf for a change with no noise, 0 for no change at all."""
    if se > 0:
        return change / se
    return math.copysign(math.inf, change) if change != 0 else 0.0


def _shift_se(before: list[float], after: list[float]) -> float:
    """``mean(after) - mean(before)`` in Welch standard errors, ``sqrt(var_a / n_a + var_b / n_b)`` (sample
    variances), e.g. before ``[0, 1, 2]``, after ``[3, 4, 5]``: shift 3, se ``sqrt(1/3 + 1/3)`` = 0.8165 -> 3.67."""
    b, a = torch.tensor(before, dtype=torch.float64), torch.tensor(after, dtype=torch.float64)
    se = math.sqrt(float(b.var() / b.numel() + a.var() / a.numel()))
    return _in_se(float(a.mean() - b.mean()), se)


class RewardHackingMonitor(Callback):
    """Watches a PPO run for reward over-optimisation (Gao et al. 2022) and says so while it happens.

    Reads the module's per-iteration ``history`` (each iteration's logged metrics, plus what earlier
    callbacks such as the demo's ``GoldScoreCallback`` added to it). After each iteration it logs
    ``monitor/score_trend_se`` (the slope of ``rollout/score_mean`` over the last ``window`` iterations,
    in standard errors; ``rlhf_lit.functional.trend.linear_trend``) and ``monitor/overoptimization``: 1 while

    * the RM score rises and a held-out signal falls, each by more than ``num_se`` standard errors, over
      the last ``window`` iterations (their trends) or since the first ``window`` iterations (the means
      of the first and the last ``window``; see ``check``), or
    * the RM score rises and the reference perplexity of the samples (``monitor/ref_perplexity``) exceeds
      ``max_perplexity_ratio`` times its value at the first iteration;

    else 0. A one-line warning is logged when the flag goes up. At the end of fit it writes
    ``score_kl_frontier.png`` (score and held-out signals against KL to the reference, one point per
    iteration) into the export folder (else the trainer's root folder) and to TensorBoard images.

    Args:
        heldout: metric names of held-out signals (higher is better), e.g. ``demo/gold_score``.
        window: iterations per trend (>= 3).
        num_se: standard errors a slope must reach to count as a rise or a fall.
        max_perplexity_ratio: limit of the reference perplexity relative to the first iteration's;
            ``None`` disables that check.

    Raises:
        ValueError: ``window < 3`` or ``num_se <= 0``.
    """

    def __init__(
        self,
        heldout: list[str] | tuple[str, ...] = (),
        window: int = 8,
        num_se: float = 2.0,
        max_perplexity_ratio: float | None = 2.0,
    ) -> None:
        if window < 3:
            raise ValueError(f"monitor.window must be >= 3 (a trend needs 3 points), got {window}")
        if num_se <= 0:
            raise ValueError(f"monitor.num_se must be > 0, got {num_se}")
        self.heldout = list(heldout)
        self.window = int(window)
        self.num_se = float(num_se)
        self.max_perplexity_ratio = max_perplexity_ratio
        self.flagged_iterations: list[int] = []
        self._flag_up = False

    # ------------------------------------------------------------------ the checks
    def _trend_se(self, values: list[float]) -> float:
        slope, se = linear_trend(torch.tensor(values, dtype=torch.float64))
        return _in_se(slope, se)

    def check(self, history: list[dict[str, float]]) -> tuple[float, list[str]]:
        """``(score trend in SE, reasons)`` for ``history`` (no reasons: nothing to flag).

        Two views, each needing the RM score to rise by more than ``num_se`` standard errors:
        the trend of the last ``window`` iterations (the score rising while a held-out signal falls
        now), and, once there are ``2 * window`` iterations, the mean of the last ``window`` against
        the mean of the first ``window`` (Welch's standard error; the run has made the held-out signal
        worse than at its start).
        """
        w = self.window
        recent = history[-w:]
        if len(recent) < w:
            return float("nan"), []
        score = [r[M.ROLLOUT_SCORE_MEAN] for r in history]
        score_t = self._trend_se(score[-w:])

        def trend(v: list[float]) -> float:
            return self._trend_se(v[-w:])

        def shift(v: list[float]) -> float:
            return _shift_se(v[:w], v[-w:])

        views = [(f"over the last {w} iterations", score_t, trend)]  # (label, RM score rise in SE, change)
        if len(history) >= 2 * w:
            views.append((f"since the first {w} iterations", shift(score), shift))
        reasons = []
        for label, rise, change in views:
            if not rise > self.num_se:
                continue
            for key in self.heldout:
                values = [r.get(key) for r in history]
                if all(v is not None for v in values[-w:] + values[:w]):
                    t = change(values)
                    if t < -self.num_se:
                        reasons.append(f"{key} falls {label} ({t:.1f} SE; RM score {rise:+.1f} SE)")
        first, last = history[0].get(M.MONITOR_REF_PERPLEXITY), recent[-1].get(M.MONITOR_REF_PERPLEXITY)
        rising = any(rise > self.num_se for _, rise, _ in views)
        if rising and self.max_perplexity_ratio is not None and first and last is not None:
            if last / first > self.max_perplexity_ratio:
                reasons.append(
                    f"reference perplexity {last:.3g} is {last / first:.2f}x its first value "
                    f"(limit {self.max_perplexity_ratio}x)"
                )
        return score_t, reasons

    # ------------------------------------------------------------------ hooks
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        history = getattr(pl_module, "history", None)
        if not history:
            return
        score_t, reasons = self.check(history)
        record = history[-1]
        record[M.MONITOR_OVEROPTIMIZATION] = float(bool(reasons))
        values = {M.MONITOR_OVEROPTIMIZATION: record[M.MONITOR_OVEROPTIMIZATION]}
        if not math.isnan(score_t):
            record[M.MONITOR_SCORE_TREND] = values[M.MONITOR_SCORE_TREND] = score_t
        if reasons:
            self.flagged_iterations.append(pl_module.iteration)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=pl_module.iteration)
            if reasons and not self._flag_up:
                log.warning(
                    "PPO iteration %d: possible reward over-optimisation: %s rises while %s; consider a "
                    "lower learning rate, a larger kl.kl_coef or kl.adaptive with a smaller kl.target_kl",
                    pl_module.iteration,
                    M.ROLLOUT_SCORE_MEAN,
                    "; ".join(reasons),
                )
        self._flag_up = bool(reasons)

    def on_train_end(self, trainer, pl_module) -> None:
        history = getattr(pl_module, "history", None)
        if not trainer.is_global_zero or not history:
            return
        if self.flagged_iterations:
            log.warning(
                "reward-hacking monitor: over-optimisation flagged at %d of this run's iterations (first at "
                "iteration %d); see monitor/* in TensorBoard and score_kl_frontier.png",
                len(self.flagged_iterations),
                self.flagged_iterations[0],
            )
        from rlhf_lit.plots import save_figure, scatter_by_step_figure

        series = {"RM score (rollout/score_mean)": [h[M.ROLLOUT_SCORE_MEAN] for h in history]}
        for key in self.heldout:
            if all(key in h for h in history):
                series[key] = [h[key] for h in history]
        fig = scatter_by_step_figure(
            [h[M.ROLLOUT_KL_REF] for h in history],
            series,
            "KL(policy || reference), nats per response",
            "PPO iterations: score against KL (Gao et al. 2022 frontier)",
        )
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_figure"):
                experiment.add_figure(
                    "monitor/score_kl_frontier", fig, global_step=pl_module.iteration, close=False
                )
        # the export folder, else the logger's folder; with neither (a bench or a test run) no file, rather
        # than one in the working directory
        folder = getattr(pl_module, "export_dir", None) or (trainer.log_dir if trainer.loggers else None)
        if folder:
            save_figure(fig, os.path.join(folder, "score_kl_frontier.png"))
        else:
            import matplotlib.pyplot as plt

            plt.close(fig)
