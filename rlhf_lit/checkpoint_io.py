"""Checkpoints written atomically: :class:`AtomicCheckpointIO`, the Lightning ``CheckpointIO`` the CLI installs for
every stage (:mod:`rlhf_lit.lightning_cli`). Kept apart from :mod:`rlhf_lit.outputs` so that the export code
(``rlhf_lit.models``) never imports Lightning."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from rlhf_lit.outputs import _fsync_dir, write_failure, write_file

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` is atomic on a kill and a full disk: the checkpoint is
    serialized, written to ``<file>.tmp-<pid>`` in the target folder, fsynced and renamed over ``<file>``.
    Remote (``scheme://``) paths use Lightning's writer.

    Args:
        writer: ``writer(path, data)`` writes the bytes ``data`` to ``path`` (default :func:`write_file`;
            tests pass one that fails part-way).
    """

    def __init__(self, writer: Callable[[str, Any], None] | None = None) -> None:
        super().__init__()
        self.writer = writer or write_file

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        path = str(path)
        if "://" in path:
            return super().save_checkpoint(checkpoint, path, storage_options)
        import torch

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getbuffer()
        folder = os.path.dirname(os.path.abspath(path))
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            os.makedirs(folder, exist_ok=True)
            self.writer(tmp, data)
            os.replace(tmp, path)
        except OSError as err:
            try:
                os.remove(tmp)
            except OSError:
                pass
            failure = write_failure(err, folder, len(data), "checkpoint")
            if failure is None:
                raise
            raise failure from err
        _fsync_dir(folder)
        return None
