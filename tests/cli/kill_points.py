"""A test-only Lightning callback that kills its own process with SIGKILL at a chosen point of a fit.

Given to a real ``rlhf-lit fit`` through the command line (``--trainer.callbacks+=tests.cli.kill_points.KillAt``
and its ``init_args``), so nothing in the package is patched and the killed run is the run a user starts.
``tests/cli/test_kill_resume.py`` draws the points from a seeded RNG.

Phases (``batch`` counts this run's training batches from 1: a PPO iteration, an SFT / reward batch):

* ``sampling`` -- during batch ``batch``'s rollout: at the ``count``-th forward of the policy's input embedding
  with gradients off (each generated token is one; PPO scores the rollout after that, also without gradients).
* ``update`` -- during batch ``batch``'s update: right after its ``count``-th backward (a micro-batch), so the
  gradients of part of a minibatch exist and no optimizer step of it has been taken.
* ``checkpoint`` -- during the ``count``-th checkpoint write of the run: once ``fraction`` of the checkpoint's bytes
  are on disk (the temporary file of ``rlhf_lit.checkpoint_io.AtomicCheckpointIO``, whose ``writer`` it wraps).
"""

from __future__ import annotations

import os
import signal
from typing import Literal

import torch
from lightning.pytorch.callbacks import Callback


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(Callback):
    """SIGKILL this process at one point of the fit (see the module docstring).

    Args:
        phase: ``sampling``, ``update`` or ``checkpoint``.
        batch: the training batch (1-based, counted in this run) in which to kill (``sampling``, ``update``).
        count: which forward (``sampling``), backward (``update``) or checkpoint write (``checkpoint``), from 1.
        fraction: ``checkpoint``: the share of the checkpoint's bytes written before the kill, in [0, 1).
    """

    def __init__(
        self,
        phase: Literal["sampling", "update", "checkpoint"],
        batch: int = 1,
        count: int = 1,
        fraction: float = 0.5,
    ) -> None:
        self.phase, self.batch, self.count, self.fraction = phase, batch, count, fraction
        self.batches_started, self.seen, self._hook = 0, 0, None

    # ------------------------------------------------------------------ checkpoint
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.phase != "checkpoint":
            return
        from rlhf_lit.checkpoint_io import AtomicCheckpointIO

        io = trainer.strategy.checkpoint_io
        assert isinstance(io, AtomicCheckpointIO), type(io)
        inner = io.writer

        def writer(path: str, data) -> None:
            self.seen += 1
            if self.seen < self.count:
                return inner(path, data)
            with open(path, "wb") as f:  # the temporary file, part-written
                f.write(bytes(data[: int(len(data) * self.fraction)]))
                f.flush()
                os.fsync(f.fileno())
            _die()

        io.writer = writer

    # ------------------------------------------------------------------ sampling and update
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches_started += 1
        self.seen = 0 if self.phase != "checkpoint" else self.seen
        if self.phase == "sampling" and self.batches_started == self.batch:
            embedding = next(m for m in pl_module.modules() if isinstance(m, torch.nn.Embedding))

            def hook(module, args) -> None:
                if not torch.is_grad_enabled():
                    self.seen += 1
                    if self.seen == self.count:
                        _die()

            self._hook = embedding.register_forward_pre_hook(hook)

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.phase == "update" and self.batches_started == self.batch:
            self.seen += 1
            if self.seen == self.count:
                _die()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


# ---------------------------------------------------------------------------------------------- launching
def run_main(args: list[str], log: str) -> None:
    """``rlhf_lit.cli.main(args)`` -- what the ``rlhf-lit`` console script runs -- in this (child) process,
    from the repository root, one thread, its output to ``log``; exits with main's status."""
    import sys

    from tests.conftest import REPO_ROOT

    os.chdir(REPO_ROOT)
    out = open(log, "w", buffering=1)  # noqa: SIM115 - open until this process ends
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out
    sys.argv = ["rlhf-lit", *args]
    torch.set_num_threads(1)
    from rlhf_lit.cli import main

    code = 0
    try:
        main(args)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - an internal error: its traceback into the log, status 1
        import traceback

        traceback.print_exc()
        code = 1
    out.flush()
    os._exit(code)
