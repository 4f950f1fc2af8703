"""PPO's periodic resumable checkpoint (``ppo.checkpoint_every``): Lightning's ``ModelCheckpoint`` keeping only
``last.ckpt``, written every N PPO iterations.

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

from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["IterationCheckpoint", "periodic_checkpoint"]


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
