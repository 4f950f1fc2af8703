"""Outputs as transactions: one writer per folder, nothing half-written, nothing of two runs mixed.

* :class:`FolderLock` — a run locks its export folder and its log/checkpoint folder with a lock file created
  with ``O_EXCL`` (``.<name>.rlhf_lit.lock`` beside the folder: pid, host, start time). A second run on the same
  folder is refused with one line naming the other run; a lock whose process is dead (on this host) is stale and
  taken over.
* :class:`ExportFolder` — an export is written into a temporary sibling (``.<name>.partial-<pid>-*``) and
  renamed into place when complete, so a kill or a full disk at any moment leaves the previous complete export
  (or none), never a half one. A folder that already holds files is refused unless ``overwrite``; with it, the
  earlier export is replaced whole at the commit (its files are never mixed with the new run's).
  While a transaction is open, :func:`staged` maps any path inside the export folder to the staging folder:
  every writer of the export (weights, reward head, ``eval_results.json``, plots) calls it.
* :class:`rlhf_lit.checkpoint_io.AtomicCheckpointIO` — Lightning's checkpoint writer, writing ``<file>.tmp-<pid>`` in the target
  folder, fsync, then ``os.replace``. Lightning's own ``_atomic_save`` (lightning 2.6.6,
  ``lightning/fabric/utilities/cloud_io.py``) goes through an fsspec transaction whose temporary file is made
  by ``tempfile.mkstemp()`` in the system temp folder and moved with ``shutil.move``: when that folder is on
  another file system (a tmpfs ``/tmp``), the move is a copy into the final path, which a kill interrupts
  half-way; it also needs the checkpoint's size free in ``/tmp``, never fsyncs, and leaves the temporary file
  behind when killed. Not atomic on a kill in general.
* A write that fails for lack of space or permission becomes :class:`OutputError` (a user error: one line
  naming the folder and the bytes needed, exit 2); :func:`check_free_space` refuses before training when the
  estimated export plus a 10% safety margin (:data:`FREE_SPACE_MARGIN`) does not fit.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from rlhf_lit.errors import UserError

log = logging.getLogger(__name__)

__all__ = [
    "ExportFolder",
    "FolderLock",
    "OutputError",
    "check_free_space",
    "checkpoint_folders",
    "holds_files",
    "replace_file",
    "staged",
    "write_failure",
]

# the errors of a full or unwritable disk (EFBIG: a file-size limit, e.g. ulimit -f)
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
# the free space an export must leave beside its estimate: the estimate omits the file system's blocks and metadata
FREE_SPACE_MARGIN = 1.1
_STAGING: dict[str, str] = {}  # open transactions: absolute export folder -> its staging folder


class OutputError(UserError, OSError):
    """An output folder that cannot be written: locked by another run, holding an earlier export, full or
    read-only. The message names the folder (and the other run, or the bytes needed)."""


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "an unknown number of bytes"
    exact, size = int(n), float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            return f"{exact} bytes" if exact < 1024 else f"{size:.1f} {unit} ({exact} bytes)"
    return f"{exact} bytes"  # pragma: no cover


def write_failure(err: OSError, folder: str, needed: int | None, what: str = "output") -> OutputError | None:
    """The :class:`OutputError` for a write that failed for lack of space or permission, else None."""
    if err.errno not in DISK_ERRNOS:
        return None
    free = _free_bytes(folder)
    reason = os.strerror(err.errno).lower() if err.errno else "write failed"
    return OutputError(
        f"cannot write the {what} to {folder}: {reason} (needs about {_fmt_bytes(needed)}, "
        f"{_fmt_bytes(free)} free); free space or choose another folder -- the last complete {what} is untouched"
    )


def _free_bytes(folder: str) -> int | None:
    path = os.path.abspath(folder)
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def check_free_space(
    folder: str, needed: int | None, what: str = "export", margin: float = FREE_SPACE_MARGIN
) -> None:
    """Refuse before training when ``folder``'s file system has less than ``margin * needed`` bytes free.

    Raises:
        OutputError: naming the folder, the bytes needed, the margin applied (and the bytes it asks for) and
            the bytes free.
    """
    free = _free_bytes(folder)
    if needed is None or free is None or free >= margin * needed:
        return
    raise OutputError(
        f"{folder}: not enough free space for the {what} (needs about {_fmt_bytes(needed)} plus a "
        f"{round((margin - 1) * 100)}% safety margin, {_fmt_bytes(int(margin * needed))} in all; "
        f"{_fmt_bytes(free)} free); free space or choose another folder"
    )


def holds_files(folder: str) -> bool:
    """True if ``folder`` exists and holds any file or folder."""
    return os.path.isdir(folder) and any(os.scandir(folder))


# ---------------------------------------------------------------------------------------------------- locks


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child not yet reaped is a zombie: dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class FolderLock:
    """An exclusive lock on ``folder`` for one run: the file ``<parent>/.<name>.rlhf_lit.lock``.

    Args:
        folder: the folder to lock (need not exist).
        role: what the folder is, for the message (``export_dir``, ``log/checkpoint folder``).
    """

    def __init__(self, folder: str, role: str = "folder") -> None:
        self.folder = os.path.normpath(folder)
        self.role = role
        parent, name = os.path.split(os.path.abspath(self.folder))
        self.path = os.path.join(parent, f".{name}.rlhf_lit.lock")
        self.held = False

    def read(self) -> dict[str, Any] | None:
        """The lock file's record, or None if it is missing or unreadable."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _stale(self, info: dict[str, Any] | None) -> bool:
        if info is None:  # half-written by a process killed between create and write, or gone meanwhile
            try:
                return time.time() - os.path.getmtime(self.path) > 10
            except OSError:
                return True
        return info.get("host") == socket.gethostname() and not _pid_alive(int(info.get("pid", -1)))

    def acquire(self) -> FolderLock:
        """Take the lock; a stale lock (dead process on this host) is taken over.

        Raises:
            OutputError: another live run holds it (one line naming its pid, host and start time), or the
                folder's parent cannot be written.
        """
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError as err:
            raise (write_failure(err, self.folder, None, "lock") or err) from err
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.read()
                if not self._stale(info):
                    raise OutputError(
                        f"{self.role} {self.folder} is in use by another run (pid {info.get('pid')} on "
                        f"{info.get('host')}, started {info.get('started')}); wait for it, stop it, or choose "
                        f"another folder (lock: {self.path})"
                    ) from None
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            except OSError as err:
                raise (write_failure(err, self.folder, None, "lock") or err) from err
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self.held = True
            return self
        raise OutputError(f"{self.role} {self.folder}: could not take the lock {self.path}")

    def release(self) -> None:
        """Remove the lock file if this process holds it."""
        if self.held:
            info = self.read()
            if info is None or info.get("pid") == os.getpid():
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
            self.held = False

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------------------------------------------- export folders


def staged(path: str) -> str:
    """``path`` inside the staging folder when it lies in an export folder whose transaction is open, else
    ``path`` unchanged. Every writer of export files calls it."""
    absolute = os.path.abspath(path)
    for final, staging in _STAGING.items():
        if absolute == final:
            return staging
        if absolute.startswith(final + os.sep):
            return os.path.join(staging, os.path.relpath(absolute, final))
    return path


def _default_modes(folder: str) -> None:
    """Give ``folder`` and everything in it the modes a plain ``mkdir`` / ``open`` gives under the process's
    umask: the staging folder comes from ``mkdtemp`` (0700) and some writers create private (0600) files, so a
    committed export would otherwise be unreadable to the user's group on a shared machine."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _remove(path: str) -> None:
    """Remove a folder tree, or a symbolic link itself (``shutil.rmtree`` refuses a link, and with
    ``ignore_errors`` would leave it in silence); nothing if ``path`` is gone."""
    if os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ExportFolder:
    """An export written as one transaction: into a temporary sibling, renamed into place when complete.

    Use ``check()`` before training (refuses a folder holding an earlier export unless ``overwrite``),
    ``begin()`` to open (from then on :func:`staged` redirects writes into the staging folder), ``commit()``
    when every file is written, ``abort()`` on failure (the staging folder is removed; an earlier export stays
    as it was). ``write(fn)`` does all three around ``fn(staging_folder)``.

    Args:
        folder: the export folder.
        overwrite: replace an earlier export in ``folder`` (whole, at the commit) instead of refusing.
        needed_bytes: the estimated size of the export, for messages (None: unknown).
        option: the setting the refusal message tells the user to add.
    """

    def __init__(
        self,
        folder: str,
        overwrite: bool = False,
        needed_bytes: int | None = None,
        option: str = "--overwrite",
    ) -> None:
        self.folder = os.path.normpath(folder)
        self.final = os.path.abspath(self.folder)
        self.overwrite = overwrite
        self.needed_bytes = needed_bytes
        self.option = option
        self.staging: str | None = None

    @property
    def _target(self) -> str:
        """The folder the commit replaces: ``final``, or the folder it points to when ``final`` is a symbolic
        link (resolved now: the link is kept, the export lands in its target, staged beside the target so the
        rename stays on one file system). Writers still name paths under ``final``; :func:`staged` maps them."""
        return os.path.realpath(self.final)

    @property
    def _parent(self) -> str:
        return os.path.dirname(self._target)

    @property
    def _name(self) -> str:
        return os.path.basename(self._target)

    def check(self) -> None:
        """Refuse a folder that already holds files (an earlier export), unless ``overwrite``.

        Raises:
            OutputError: one line naming the folder and ``option``.
        """
        if not self.overwrite and holds_files(self.final):
            what = (
                "an earlier export" if os.path.exists(os.path.join(self.final, "rlhf_lit.json")) else "files"
            )
            raise OutputError(
                f"export_dir {self.folder} already holds {what}; add {self.option} to replace it (the earlier "
                "files are removed when the new export is complete), or choose another export_dir"
            )

    def _leftovers(self, kind: str) -> list[str]:
        prefix = f".{self._name}.{kind}-"
        try:
            return [os.path.join(self._parent, e) for e in os.listdir(self._parent) if e.startswith(prefix)]
        except FileNotFoundError:
            return []

    def recover(self) -> None:
        """Clean up after a run killed mid-export (call while holding the folder's lock): partial staging
        folders are removed; an earlier export moved aside by a commit that was killed between its two
        renames is moved back."""
        for partial in self._leftovers("partial"):
            shutil.rmtree(partial, ignore_errors=True)
        for old in self._leftovers("old"):
            if not os.path.lexists(self._target):
                os.replace(old, self._target)
            else:
                _remove(old)

    def begin(self) -> str:
        """Create the staging folder and redirect writes into it; returns its path."""
        import tempfile

        self.recover()
        try:
            os.makedirs(self._parent, exist_ok=True)
            self.staging = tempfile.mkdtemp(prefix=f".{self._name}.partial-{os.getpid()}-", dir=self._parent)
        except OSError as err:
            raise (write_failure(err, self.folder, self.needed_bytes, "export") or err) from err
        _STAGING[self.final] = self.staging
        return self.staging

    def commit(self) -> None:
        """Make the staged export the folder's content: fsync, move an earlier export aside, rename the
        staging folder into place, remove the earlier export. A staging folder left empty (no writer ran)
        changes nothing."""
        staging = self.staging
        if staging is None:
            return
        _STAGING.pop(self.final, None)
        self.staging = None
        if not holds_files(staging):
            shutil.rmtree(staging, ignore_errors=True)
            return
        _default_modes(staging)
        _fsync_tree(staging)
        target, parent, name = self._target, self._parent, self._name
        old = None
        if os.path.lexists(target):
            old = os.path.join(parent, f".{name}.old-{os.getpid()}")
            _remove(old)
            os.replace(target, old)
        os.replace(staging, target)
        _fsync_dir(parent)
        if old is not None:
            _remove(old)

    def abort(self) -> None:
        """Remove the staging folder; the folder keeps what it held before."""
        if self.staging is not None:
            _STAGING.pop(self.final, None)
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    def write(self, fn: Callable[[str], Any]) -> Any:
        """``fn(staging_folder)`` as one transaction: committed if it returns, aborted if it raises. A write
        failing for lack of space or permission is raised as :class:`OutputError`.

        Raises:
            OutputError: the folder is full or unwritable (the earlier export is untouched).
        """
        self.begin()
        try:
            result = fn(self.staging)
            self.commit()
        except OSError as err:
            self.abort()
            failure = write_failure(err, self.folder, self.needed_bytes, "export")
            if failure is None:
                raise
            raise failure from err
        except BaseException:
            self.abort()
            raise
        return result


# ------------------------------------------------------------------------------------------------ checkpoints


def write_file(path: str, data) -> None:
    """Write ``data`` (bytes-like) to ``path`` and fsync it (the default writer of ``rlhf_lit.checkpoint_io.AtomicCheckpointIO``)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: str, data: str | bytes, what: str = "output") -> None:
    """Write a whole small output file (a report, a history, a table) so that ``path`` always holds either its
    previous content or all of ``data``, never a part: a temporary sibling (``.<name>.tmp-<pid>``), fsync,
    then ``os.replace``. A full disk or any error mid-write leaves the previous file and removes the temporary
    one; a kill -9 leaves the previous file and, at most, that hidden temporary sibling.

    Raises:
        OutputError: the disk is full or the folder is not writable (one line naming the folder and ``what``
            was written).
        OSError: any other write failure.
    """
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    raw = data.encode() if isinstance(data, str) else data
    try:
        write_file(tmp, raw)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        failure = write_failure(err, folder, len(raw), what)
        if failure is None:
            raise
        raise failure from err
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# ------------------------------------------------------------------------------------------------- one run


def _names_its_folder(err: BaseException) -> bool:
    """True if ``err`` is, or was raised from, an :class:`OutputError`: a writer that named its own folder (a
    reference cache, a checkpoint), which the run's failure must not blame on the export folder."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OutputError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def disk_errno(err: BaseException) -> int | None:
    """The errno of a full or unwritable disk behind ``err`` (an ``OSError``, or a library error that only
    carries the message, e.g. safetensors' ``SafetensorError: No space left on device``), else None."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_ERRNOS:
            return current.errno
        text = str(current)
        for code in DISK_ERRNOS - {errno.EPERM, errno.EACCES}:
            if os.strerror(code) in text:
                return code
        current = current.__cause__ or current.__context__
    return None


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


def is_first_process() -> bool:
    """True unless a launcher's environment says this process is not global rank 0 (Lightning's subprocess
    launcher, torchrun, SLURM, MPI). Only that process locks the folders and writes the export."""
    return all(os.environ.get(name, "0") in ("", "0") for name in RANK_VARIABLES)


def checkpoint_folders(config: dict[str, Any]) -> list[str]:
    """Where a parsed ``fit`` config's run keeps its checkpoints: the folder ``rlhf_lit.callbacks.checkpoints``
    keeps ``last.ckpt`` in (PPO: ``trainer.default_root_dir``; other stages: its ``checkpoints/``), and every
    ``ModelCheckpoint`` ``dirpath`` of ``trainer.callbacks``."""
    trainer = config.get("trainer") or {}
    root = trainer.get("default_root_dir")
    folders = [root, os.path.join(root, "checkpoints")] if root else []
    for callback in trainer.get("callbacks") or []:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("ModelCheckpoint"):
            dirpath = (callback.get("init_args") or {}).get("dirpath")
            if dirpath:
                folders.append(str(dirpath))
    return folders


class RunOutputs:
    """The outputs of one ``fit`` run: the locks on its export folder and its log/checkpoint folders, and the
    export transaction. Opened before any model loads, closed after the run.

    Args:
        export_dir: the module's ``export_dir`` (None: no export).
        log_dirs: the log/checkpoint folders to lock (``trainer.default_root_dir``, ``ModelCheckpoint``'s
            ``dirpath``).
        overwrite: replace an earlier export instead of refusing, and delete an earlier run's checkpoints in
            ``checkpoint_dirs`` instead of refusing.
        export_bytes: the export's estimated size (free-space check and messages), None if unknown.
        checkpoint_dirs: the folders where this run will keep its checkpoints (empty for a resumed run, which
            writes beside the checkpoint it resumes from by design, or one without checkpointing). A ``*.ckpt``
            file already there belongs to an earlier run: a fresh run would save beside it (Lightning names its
            own ``last-v1.ckpt``) and ``--ckpt_path last`` would then pick whichever is newer, so the two runs'
            checkpoints would mix. ``open`` refuses it, naming ``--ckpt_path last`` and ``--overwrite``.
    """

    def __init__(
        self,
        export_dir: str | None,
        log_dirs: list[str],
        overwrite: bool = False,
        export_bytes: int | None = None,
        checkpoint_dirs: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.export = ExportFolder(export_dir, overwrite, export_bytes) if export_dir else None
        self.export_bytes = export_bytes
        self.overwrite = overwrite
        self.checkpoint_dirs = list(checkpoint_dirs)
        seen: set[str] = set()
        self.locks = []
        for folder, role in [(d, "log/checkpoint folder") for d in log_dirs] + (
            [(export_dir, "export_dir")] if export_dir else []
        ):
            key = os.path.abspath(folder)
            if key not in seen:
                seen.add(key)
                self.locks.append(FolderLock(folder, role))

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        overwrite: bool = False,
        estimate_bytes: Callable[[dict[str, Any]], int | None] | None = None,
    ) -> RunOutputs:
        """From a parsed ``fit`` config (plain dicts, as ``check_config`` reads it); ``estimate_bytes`` maps the
        model's ``backbone`` settings to the export's size in bytes (None: no free-space check), e.g.
        ``rlhf_lit.models.architecture.estimate_export_bytes``."""
        model = config.get("model") or {}
        init = (model.get("init_args") or {}) if isinstance(model, dict) else {}
        trainer = config.get("trainer") or {}
        log_dirs = [trainer["default_root_dir"]] if trainer.get("default_root_dir") else []
        for callback in trainer.get("callbacks") or []:
            if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("ModelCheckpoint"):
                dirpath = (callback.get("init_args") or {}).get("dirpath")
                if dirpath:
                    log_dirs.append(str(dirpath))
        export_dir = init.get("export_dir")
        backbone = init.get("backbone")
        export_bytes = (
            estimate_bytes(backbone)
            if estimate_bytes is not None and export_dir and isinstance(backbone, dict)
            else None
        )
        checkpoint_dirs = []
        if not config.get("ckpt_path") and trainer.get("enable_checkpointing") is not False:
            checkpoint_dirs = checkpoint_folders(config)
        return cls(export_dir, log_dirs, overwrite, export_bytes, checkpoint_dirs)

    def earlier_checkpoints(self) -> list[str]:
        """The ``*.ckpt`` files already in ``checkpoint_dirs`` (sorted paths)."""
        found: set[str] = set()
        for folder in self.checkpoint_dirs:
            if os.path.isdir(folder):
                found.update(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".ckpt"))
        return sorted(found)

    def _check_checkpoints(self) -> None:
        earlier = self.earlier_checkpoints()
        if not earlier:
            return
        if not self.overwrite:
            names = ", ".join(os.path.basename(p) for p in earlier[:3]) + (
                ", ..." if len(earlier) > 3 else ""
            )
            raise OutputError(
                f"{os.path.dirname(earlier[0])} holds checkpoints of an earlier run ({names}): resume it with "
                "--ckpt_path last, or add --overwrite to start afresh there (its checkpoints are deleted)"
            )
        for path in earlier:
            os.remove(path)
        log.warning(
            "--overwrite: deleted %d checkpoint(s) of an earlier run: %s", len(earlier), ", ".join(earlier)
        )

    def open(self) -> None:
        """Take the locks, refuse a folder holding an earlier export or an earlier run's checkpoints (unless
        overwrite: then those checkpoints are deleted now) or without room for the export, and open the export
        transaction.

        Raises:
            OutputError: one line naming the folder (and the other run, or the bytes needed).
        """
        try:
            for lock in self.locks:
                lock.acquire()
            if self.export is not None:
                self.export.recover()
                try:  # an ended run's export is named first (resuming it would be refused), with its checkpoints
                    self.export.check()
                except OutputError as err:
                    earlier = self.earlier_checkpoints()
                    if not earlier:
                        raise
                    raise OutputError(
                        f"{err}; {os.path.dirname(earlier[0])} also holds that run's checkpoints, which "
                        "--overwrite deletes (another export_dir alone would be refused for them)"
                    ) from err
                check_free_space(self.export.folder, self.export_bytes)
            self._check_checkpoints()
            if self.export is not None:
                self.export.begin()
        except BaseException:
            self.close(ok=False)
            raise

    def failure(self, err: BaseException) -> OutputError | None:
        """The one-line error for a write that failed for lack of space or permission, else None."""
        code = disk_errno(err)
        if code is None or _names_its_folder(err):
            return None
        folder = (
            self.export.folder if self.export is not None else (self.locks[0].folder if self.locks else ".")
        )
        return write_failure(OSError(code, os.strerror(code)), folder, self.export_bytes, "export")

    def close(self, ok: bool) -> None:
        """Commit the export (``ok``) or drop it, then release the locks."""
        try:
            if self.export is not None:
                if ok:
                    try:
                        self.export.commit()
                    except OSError as err:
                        self.export.abort()
                        raise (self.failure(err) or err) from err
                else:
                    self.export.abort()
        finally:
            for lock in reversed(self.locks):
                lock.release()
