"""Checkpoints written atomically: :class:`AtomicCheckpointIO`, the Lightning ``CheckpointIO`` the CLI installs for
every stage (:mod:`rlhf_lit.lightning_cli`). Kept apart from :mod:`rlhf_lit.outputs` so that the export code
(``rlhf_lit.models``) never imports Lightning."""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from rlhf_lit.outputs import _fsync_dir, _pid_alive, write_failure, write_file

__all__ = ["AtomicCheckpointIO", "remove_stale_temporaries"]

log = logging.getLogger("rlhf_lit")
_TEMPORARY = re.compile(r".\.tmp-(\d{1,9})$")  # <file>.tmp-<pid>


def remove_stale_temporaries(folder: str) -> list[str]:
    """Remove the ``<file>.tmp-<pid>`` files in ``folder`` whose process is dead, the part-written checkpoints
    of runs killed mid-write; a live process's file is kept (it may be writing it).

    Processes are looked up on this host; the folder lock (:class:`rlhf_lit.outputs.FolderLock`, host-aware)
    keeps runs of other hosts out of the folder. A file that cannot be removed is left (the save goes on).

    Returns:
        The names removed, sorted; empty when ``folder`` does not exist.
    """
    removed = []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _TEMPORARY.search(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False) or _pid_alive(int(match.group(1))):
            continue
        try:
            os.remove(entry.path)
        except OSError:
            continue
        removed.append(entry.name)
    return sorted(removed)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``save_checkpoint`` is atomic on a kill and a full disk: the checkpoint is
    serialized, written to ``<file>.tmp-<pid>`` in the target folder, fsynced and renamed over ``<file>``.
    The first save into a folder removes the temporary files that killed runs left there
    (:func:`remove_stale_temporaries`), in one log line. Remote (``scheme://``) paths use Lightning's writer.

    Args:
        writer: ``writer(path, data)`` writes the bytes ``data`` to ``path`` (default :func:`write_file`;
            tests pass one that fails part-way).
    """

    def __init__(self, writer: Callable[[str, Any], None] | None = None) -> None:
        super().__init__()
        self.writer = writer or write_file
        self._swept: set[str] = set()  # folders cleared of killed runs' temporary files

    def _sweep(self, folder: str) -> None:
        """Once per folder: remove the temporary files of killed runs, in one log line."""
        if folder in self._swept:
            return
        self._swept.add(folder)
        removed = remove_stale_temporaries(folder)
        if removed:
            names = ", ".join(removed)
            log.info(
                "checkpoint: removed %d temporary file(s) of killed runs from %s: %s",
                len(removed),
                folder,
                names,
            )

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
            self._sweep(folder)
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
