"""What a run writes besides its logged metrics, as callbacks: the Hugging Face export, PPO's sample table
and PPO's score / KL curves.

The stage modules attach the ones their settings ask for (``configure_callbacks``: ``export_dir``,
``log_samples_every``), so every config writes what it wrote before; each is switched off by its setting
(``export_dir: null``, ``log_samples_every: 0``). A callback of the same class listed under
``trainer.callbacks`` is used instead of the module's default (:func:`unless_configured`).
"""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import Callback

from rlhf_lit import metrics as M
from rlhf_lit.outputs import ExportFolder, staged, write_failure

__all__ = ["HFExport", "PPOCurves", "RolloutSamples", "unless_configured"]


def unless_configured(trainer, callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` less those whose class the trainer already has (the user's own instance wins; Lightning
    would otherwise replace it with the module's)."""
    present = {type(c) for c in getattr(trainer, "callbacks", None) or []}
    return [c for c in callbacks if type(c) not in present]


class HFExport(Callback):
    """At the end of fit, the module writes its model in Hugging Face format (``module.export(folder)``).

    The export folder is one transaction (``rlhf_lit.outputs``): everything written into it during the run (the
    weights, plots, ``eval_results.json``) goes to a temporary sibling folder that is renamed into place when
    the run ends (after every ``on_fit_end`` hook). Under the CLI the run-level transaction does this (and
    refuses a folder holding an earlier export unless ``--overwrite``); outside it (``trainer.fit`` called
    directly), this callback opens one at ``on_fit_start`` that replaces an earlier export whole.
    Every rank calls ``export`` (under FSDP2 a collective: the weights are gathered one FSDP unit at a time); rank 0
    writes.

    Args:
        dirpath: the export folder; default: the module's ``export_dir`` (nothing is written without one).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self._own: ExportFolder | None = None

    def _folder(self, pl_module) -> str | None:
        return self.dirpath or getattr(pl_module, "export_dir", None)

    def on_fit_start(self, trainer, pl_module) -> None:
        folder = self._folder(pl_module)
        if folder and trainer.is_global_zero and staged(folder) == folder:  # no run-level transaction open
            self._own = ExportFolder(folder, overwrite=True)
            self._own.begin()

    def on_fit_end(self, trainer, pl_module) -> None:
        folder = self._folder(pl_module)
        if folder:
            pl_module.export(folder)  # into the staging folder (save_causal_lm writes to staged(folder))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        own, self._own = self._own, None
        if own is not None:
            try:
                own.commit()
            except OSError as err:
                own.abort()
                raise (write_failure(err, own.folder, None, "export") or err) from err

    def on_exception(self, trainer, pl_module, exception) -> None:
        own, self._own = self._own, None
        if own is not None:
            own.abort()


class RolloutSamples(Callback):
    """A markdown table of the first ``num_rows`` prompts, responses and RM scores of a PPO iteration, to
    TensorBoard text (``rollout/samples``) at the first iteration and every ``every`` iterations.

    Reads the module's ``last_rollout`` (``prompt_text``, ``response_text``, ``score`` lists) and ``iteration``.

    Args:
        every: iterations between tables (0 writes none).
        num_rows: rows per table.
    """

    def __init__(self, every: int = 10, num_rows: int = 4) -> None:
        self.every = int(every)
        self.num_rows = int(num_rows)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        iteration = getattr(pl_module, "iteration", 0)
        sample = getattr(pl_module, "last_rollout", None)
        if not (self.every and sample and trainer.is_global_zero):
            return
        if iteration == 1 or iteration % self.every == 0:
            table = samples_table(sample, self.num_rows)
            for logger in trainer.loggers:
                experiment = getattr(logger, "experiment", None)
                if hasattr(experiment, "add_text"):
                    experiment.add_text("rollout/samples", table, global_step=iteration)


def samples_table(sample: dict[str, list], num_rows: int) -> str:
    """``| prompt | response | score |`` rows (cells escaped, the last 300 characters of each)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")[-300:]

    rows = ["| prompt | response | score |", "|---|---|---|"]
    for prompt, response, score in list(zip(sample["prompt_text"], sample["response_text"], sample["score"]))[
        :num_rows
    ]:
        rows.append(f"| {cell(prompt)} | {cell(response)} | {score:.3f} |")
    return "\n".join(rows)


class PPOCurves(Callback):
    """At the end of fit, ``ppo_curves.png`` in the module's export folder: RM score and KL to the reference
    per iteration (the whole run, resumed parts included: the module's ``history``), with the KL budget.

    Args:
        target_kl: draw this KL budget (nats per response) as a dashed line; None draws none.
        filename: the file's name in the export folder.
    """

    def __init__(self, target_kl: float | None = None, filename: str = "ppo_curves.png") -> None:
        self.target_kl = target_kl
        self.filename = filename

    def on_fit_end(self, trainer, pl_module) -> None:
        folder = getattr(pl_module, "export_dir", None)
        history = getattr(pl_module, "history", None)
        if not (folder and history and trainer.is_global_zero):  # one writer
            return
        from rlhf_lit.plots import curves_figure, save_figure

        steps = [h[M.PPO_ITERATION] for h in history]
        series = {
            "RM score (rollout/score_mean)": [h[M.ROLLOUT_SCORE_MEAN] for h in history],
            "KL to reference (rollout/kl_ref, nats)": [h[M.ROLLOUT_KL_REF] for h in history],
        }
        fig = curves_figure(steps, series, "PPO iteration", "PPO: reward-model score and KL per iteration")
        if self.target_kl is not None:
            fig.axes[1].axhline(self.target_kl, color="red", linestyle="--", label="kl.target_kl")
            fig.axes[1].legend()
        save_figure(fig, os.path.join(folder, self.filename))
