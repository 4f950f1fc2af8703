"""Where a ``fit`` keeps its resumable ``last.ckpt``, so ``--ckpt_path last`` finds it, and the line that says so
when it finds none.

PPO (``ppo.checkpoint_every``): Lightning's ``ModelCheckpoint`` keeping only ``last.ckpt``, written every N PPO
iterations (:class:`IterationCheckpoint`). SFT, reward and DPO/KTO (the stages that count epochs): Lightning's
default checkpoint (the latest one, at its default cadence) plus ``last.ckpt``, in
``<trainer.default_root_dir>/checkpoints`` instead of the logger's ``version_N`` folder
(:func:`run_folder_checkpoint`): a resumed run gets a new ``version_N``, where Lightning would look for ``last``
and find nothing.

Why a subclass: ``ModelCheckpoint(every_n_train_steps=...)`` counts optimizer steps, and a PPO iteration makes
``ppo_epochs x minibatches`` of them, fewer when a step with a non-finite gradient norm is skipped
(``rlhf_lit.rl.update``); after one skip a step cadence would never again fall on an iteration's end. This
one counts iterations (``module.iteration``) and leaves everything else, the atomic write included
(``rlhf_lit.checkpoint_io.AtomicCheckpointIO`` under the CLI), to Lightning.

Where it goes: ``<trainer.default_root_dir>/last.ckpt``, the run's own folder (not the logger's ``version_N``,
which a resumed run would not share), so ``--ckpt_path last`` finds it. The CLI adds it to the
trainer when the trainer is built (Lightning resolves ``last`` before ``fit`` attaches a module's own
callbacks); a module used from Python adds it in ``configure_callbacks``. Both ask :func:`periodic_checkpoint`.
"""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["IterationCheckpoint", "missing_last_note", "periodic_checkpoint", "run_folder_checkpoint"]


class IterationCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(save_last=True, save_top_k=0)`` written after every ``every_n_iterations``-th PPO
    iteration (one training batch each; the module's ``iteration`` counter).

    Args:
        every_n_iterations: iterations between checkpoints (>= 1).
        dirpath: the folder of ``last.ckpt``.
    """

    def __init__(self, every_n_iterations: int, dirpath: str) -> None:
        if every_n_iterations < 1:
            raise ValueError(f"every_n_iterations must be >= 1, got {every_n_iterations}")
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=1)
        self.every_n_iterations = every_n_iterations

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if getattr(pl_module, "iteration", 0) % self.every_n_iterations == 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def periodic_checkpoint(every: int | None, trainer) -> list[IterationCheckpoint]:
    """The checkpoint callback ``ppo.checkpoint_every = every`` asks of ``trainer``, as a list (empty for none).

    None when ``every`` is unset, when the trainer runs anything but ``fit``, when it has no checkpoint callback
    at all (``enable_checkpointing: false``), or when it already has one that keeps a ``last.ckpt`` (an
    ``IterationCheckpoint``, or the user's ``ModelCheckpoint(save_last=...)``): those settings win.
    """
    callbacks = list(getattr(trainer, "checkpoint_callbacks", None) or [])
    if not every or not callbacks or any(getattr(c, "save_last", None) for c in callbacks):
        return []
    if getattr(getattr(trainer, "state", None), "fn", None) not in (None, "fit"):
        return []  # validate, test, predict: nothing is written (and the checkpoint's own callbacks stay)
    return [IterationCheckpoint(every, trainer.default_root_dir)]


def run_folder_checkpoint(trainer) -> list[ModelCheckpoint]:
    """The checkpoint of an SFT, reward or DPO ``fit`` whose config names no ``ModelCheckpoint``, as a list (empty
    for none): Lightning's default (the latest checkpoint, ``epoch=E-step=S.ckpt``, at its default cadence) with
    ``save_last``, in ``<trainer.default_root_dir>/checkpoints``.

    None when the trainer has no checkpoint callback (``enable_checkpointing: false``) or already has one with
    ``save_last`` or a ``dirpath``: those settings win. Lightning's own default (no ``dirpath``) is the one
    it replaces.
    """
    callbacks = list(getattr(trainer, "checkpoint_callbacks", None) or [])
    if not callbacks or any(getattr(c, "save_last", None) or getattr(c, "dirpath", None) for c in callbacks):
        return []
    return [ModelCheckpoint(dirpath=os.path.join(trainer.default_root_dir, "checkpoints"), save_last=True)]


def missing_last_note(trainer, subcommand: str = "fit") -> str | None:
    """The one line to print when ``ckpt_path="last"`` will find no checkpoint (Lightning then warns and starts
    from the beginning, by design: ``last`` may stand in a config from the first run on); None when it will find
    one.

    Looks where Lightning looks (``trainer.checkpoint_callbacks``' ``last*.ckpt``, an ``OnExceptionCheckpoint``'s
    file), and names those folders. Uses ``ModelCheckpoint._find_last_checkpoints`` (private; Lightning 2.6), the
    function Lightning's own ``last`` look-up calls, so the two cannot disagree.
    """
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    then = (
        "training starts from the beginning"
        if subcommand == "fit"
        else f"{subcommand} uses the untrained model"
    )
    callbacks = [
        c for c in getattr(trainer, "checkpoint_callbacks", None) or [] if isinstance(c, ModelCheckpoint)
    ]
    on_exception = [c for c in trainer.callbacks if isinstance(c, OnExceptionCheckpoint)]
    if not callbacks and not on_exception:
        return (
            "--ckpt_path last: checkpointing is off (trainer.enable_checkpointing: false), so no run of this config "
            f"writes a last.ckpt; {then}"
        )
    found = {c.ckpt_path for c in on_exception}
    for callback in callbacks:
        found |= callback._find_last_checkpoints(trainer)
    if any(path and os.path.exists(path) for path in found):
        return None
    folders = [_shown(c.dirpath) if c.dirpath else "this run's new logger folder" for c in callbacks]
    folders += [_shown(c.ckpt_path) for c in on_exception]
    return f"--ckpt_path last: no last checkpoint in {', '.join(folders)}; {then}"


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
