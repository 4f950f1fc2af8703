"""The demo's evaluation-only gold scorer as a PPO callback (``rlhf_lit.data.demo_task.gold_score``)."""

from __future__ import annotations

import json
import os

from lightning.pytorch.callbacks import Callback

from rlhf_lit.data.demo_task import gold_score
from rlhf_lit.metrics import (
    DEMO_GOLD_SCORE,
    MONITOR_OVEROPTIMIZATION,
    PPO_ITERATION,
    ROLLOUT_KL_REF,
    ROLLOUT_SCORE_MEAN,
)
from rlhf_lit.outputs import replace_file

__all__ = ["GoldScoreCallback"]


class GoldScoreCallback(Callback):
    """Logs the gold score of each PPO iteration's samples (evaluation only) and writes a history file.

    The score also goes into the iteration's record in ``PPOModule.history``, where the reward-hacking
    monitor (``RewardHackingMonitor``, run after this callback) reads it as a held-out signal.

    Args:
        history_file: JSON file with one record per iteration (iteration, gold score, RM score, KL, the
            monitor's over-optimisation flag); default: ``history.json`` in the trainer's ``default_root_dir``.
    """

    def __init__(self, history_file: str | None = None) -> None:
        self.history_file = history_file

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sample = getattr(pl_module, "last_rollout", None)
        if not sample or not trainer.is_global_zero:
            return
        gold = [gold_score(p, r) for p, r in zip(sample["prompt_text"], sample["response_text"])]
        pl_module.history[-1][DEMO_GOLD_SCORE] = sum(gold) / len(gold)
        for logger in trainer.loggers:
            logger.log_metrics({DEMO_GOLD_SCORE: sum(gold) / len(gold)}, step=pl_module.iteration)

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        records = [
            {
                "iteration": int(h[PPO_ITERATION]),
                "gold_score": h.get(DEMO_GOLD_SCORE),
                "rm_score": h[ROLLOUT_SCORE_MEAN],
                "kl": h[ROLLOUT_KL_REF],
                "overoptimization": bool(h.get(MONITOR_OVEROPTIMIZATION)),
            }
            for h in pl_module.history
        ]
        path = self.history_file or os.path.join(trainer.default_root_dir, "history.json")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        replace_file(path, json.dumps(records, indent=1))
