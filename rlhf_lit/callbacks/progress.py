"""A progress bar that names the stage (``[sft] epoch 0``, ``[ppo] iterations``, ``[kto] epoch 0``: the stage table's
``label`` and ``progress``, :mod:`rlhf_lit.stages`) and where its export went."""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import TQDMProgressBar

from rlhf_lit.outputs import holds_files, staged

__all__ = ["StageProgressBar"]


def _stage(pl_module):
    """The module's entry of the stage table (:mod:`rlhf_lit.stages`), or None for another LightningModule."""
    from rlhf_lit.stages import find_stage

    return find_stage(type(pl_module))


def _label(pl_module) -> str:
    stage = _stage(pl_module)
    return stage.label(dict(pl_module.hparams)) if stage is not None else type(pl_module).__name__


class StageProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, with the stage in its description (``[sft] epoch 0``, ``[ppo] iterations``).

    PPO's bar counts iterations (one prompt batch each) and shows ``iter`` (an integer), ``score`` and
    ``kl``. After fit, one line names the stage's export folder (absolute path).
    """

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        stage = _stage(pl_module)
        iterations = stage is not None and stage.progress == "iterations"
        total = getattr(getattr(pl_module, "ppo", None), "total_iterations", None)
        if iterations and total:
            remaining = total - pl_module.iteration
            self.train_progress_bar.reset(
                min(self.total_train_batches, remaining, _max_steps_left(trainer, pl_module))
            )
        what = "iterations" if iterations else f"epoch {trainer.current_epoch}"
        self.train_progress_bar.set_description(f"[{_label(pl_module)}] {what}")

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        if "iter" in metrics:
            metrics["iter"] = int(round(float(metrics["iter"])))
        return metrics

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """Close the open bars, so their line ends before the CLI prints the error (``rlhf-lit: error: ...``
        then starts a line of its own, also under ``2>&1``)."""
        for bar in (self._train_progress_bar, self._val_progress_bar):
            if bar is not None and not bar.disable:
                bar.close()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        # after every on_fit_end hook, the modules' and the export callbacks': the export is written by now
        super().teardown(trainer, pl_module, stage)
        export_dir = getattr(pl_module, "export_dir", None)
        # under the CLI the export is still in its staging folder here, renamed into place after the run
        if stage == "fit" and trainer.is_global_zero and export_dir and holds_files(staged(export_dir)):
            print(f"[{_label(pl_module)}] done; Hugging Face export: {os.path.abspath(export_dir)}")


def _max_steps_left(trainer, pl_module) -> float:
    """PPO iterations left before ``trainer.max_steps`` (optimizer steps: ``ppo_epochs`` x minibatches per
    iteration; the CLI accepts only whole iterations), or infinity without a ``max_steps``."""
    if trainer.max_steps is None or trainer.max_steps < 0:
        return float("inf")
    per_iteration = pl_module.optimizer_steps_per_iteration()
    return -(-(trainer.max_steps - trainer.global_step) // per_iteration)
