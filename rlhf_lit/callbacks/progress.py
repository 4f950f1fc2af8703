"""A progress bar that names the stage (``[sft] epoch 0``, ``[ppo] iterations``) and where its export went."""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import TQDMProgressBar

__all__ = ["StageProgressBar"]

_STAGES = {"SFTModule": "sft", "RewardModule": "reward", "DPOModule": "dpo", "PPOModule": "ppo"}


def _stage(pl_module) -> str:
    return _STAGES.get(type(pl_module).__name__, type(pl_module).__name__)


class StageProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, with the stage in its description (``[sft] epoch 0``, ``[ppo] iterations``).

    PPO's bar counts iterations (one prompt batch each) and shows ``iter`` (an integer), ``score`` and
    ``kl``. After fit, one line names the stage's export folder (absolute path).
    """

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        stage = _stage(pl_module)
        if stage == "ppo" and pl_module.ppo.total_iterations:
            remaining = pl_module.ppo.total_iterations - pl_module.iteration
            self.train_progress_bar.reset(
                min(self.total_train_batches, remaining, _max_steps_left(trainer, pl_module))
            )
        what = "iterations" if stage == "ppo" else f"epoch {trainer.current_epoch}"
        self.train_progress_bar.set_description(f"[{stage}] {what}")

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        if "iter" in metrics:
            metrics["iter"] = int(round(float(metrics["iter"])))
        return metrics

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # after every on_fit_end hook, the modules' and the export callbacks': the export is written by now
        super().teardown(trainer, pl_module, stage)
        export_dir = getattr(pl_module, "export_dir", None)
        if stage == "fit" and trainer.is_global_zero and export_dir and os.path.isdir(export_dir):
            print(f"[{_stage(pl_module)}] done; Hugging Face export: {os.path.abspath(export_dir)}")


def _max_steps_left(trainer, pl_module) -> float:
    """PPO iterations left before ``trainer.max_steps`` (optimizer steps: ``ppo_epochs`` x minibatches per
    iteration; the CLI accepts only whole iterations), or infinity without a ``max_steps``."""
    if trainer.max_steps is None or trainer.max_steps < 0:
        return float("inf")
    per_iteration = pl_module.optimizer_steps_per_iteration()
    return -(-(trainer.max_steps - trainer.global_step) // per_iteration)
