"""Outputs as transactions, piece by piece (rlhf_lit.outputs): locks, staged exports, atomic checkpoints,
write failures injected through the writers the classes take (no production code patched)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from rlhf_lit.checkpoint_io import AtomicCheckpointIO
from rlhf_lit.errors import UserError
from rlhf_lit.outputs import (
    ExportFolder,
    FolderLock,
    OutputError,
    RunOutputs,
    check_free_space,
    disk_errno,
    replace_file,
    staged,
)


def failing_writer(limit: int):
    """A ``writer(path, data)`` that writes the first ``limit`` bytes, then fails as a full disk does."""

    def write(path, data):
        with open(path, "wb") as f:
            f.write(bytes(data)[:limit])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    return write


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_refuses_a_second_holder_naming_it(tmp_path):
    folder = tmp_path / "run"
    first = FolderLock(str(folder), "export_dir").acquire()
    with pytest.raises(OutputError) as err:
        FolderLock(str(folder), "export_dir").acquire()
    message = str(err.value)
    assert f"pid {os.getpid()}" in message and "started 20" in message and str(folder) in message
    assert "\n" not in message
    first.release()
    FolderLock(str(folder)).acquire().release()  # free again
    assert not os.path.exists(first.path)


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    lock = FolderLock(str(tmp_path / "run"))
    with open(lock.path, "w") as f:
        json.dump({"pid": dead_pid(), "host": os.uname().nodename, "started": "2026-01-01T00:00:00+00:00"}, f)
    lock.acquire()
    assert lock.read()["pid"] == os.getpid()
    lock.release()


def test_lock_of_a_live_process_on_another_host_is_kept(tmp_path):
    lock = FolderLock(str(tmp_path / "run"))
    with open(lock.path, "w") as f:
        json.dump({"pid": dead_pid(), "host": "another-host", "started": "2026-01-01T00:00:00+00:00"}, f)
    with pytest.raises(OutputError, match="another-host"):
        lock.acquire()


def write_export(folder: str, payload: bytes) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.bin"), "wb") as f:
        f.write(payload)
    with open(os.path.join(folder, "rlhf_lit.json"), "w") as f:
        json.dump({"kind": "policy", "size": len(payload)}, f)


def read_export(folder: str) -> bytes:
    with open(os.path.join(folder, "rlhf_lit.json")) as f:
        size = json.load(f)["size"]
    with open(os.path.join(folder, "model.bin"), "rb") as f:
        data = f.read()
    assert len(data) == size
    return data


def test_full_disk_mid_export_leaves_the_previous_export_whole(tmp_path):
    folder = str(tmp_path / "hf")
    ExportFolder(folder).write(lambda staging: write_export(staging, b"old" * 100))

    def fails_part_way(staging):
        with open(os.path.join(staging, "model.bin"), "wb") as f:
            f.write(b"new" * 10)
        failing_writer(7)(os.path.join(staging, "rlhf_lit.json"), b'{"kind": "policy"}')

    with pytest.raises(OutputError) as err:
        ExportFolder(folder, overwrite=True, needed_bytes=4096).write(fails_part_way)
    assert isinstance(err.value, UserError)
    assert folder in str(err.value) and "4.0 KiB" in str(err.value)
    assert read_export(folder) == b"old" * 100  # the earlier export, complete
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no staging folder left behind


def test_a_report_write_past_a_full_disk_keeps_the_previous_report_and_no_temporary(tmp_path):
    """``replace_file`` (reports, histories, tables): a write cut short by the disk (a 64-byte file-size limit:
    EFBIG, as a full disk gives ENOSPC) leaves the earlier complete file and one user-error line."""
    path = tmp_path / "report.json"
    replace_file(str(path), '{"gain": 1}')
    assert path.read_text() == '{"gain": 1}' and sorted(os.listdir(tmp_path)) == ["report.json"]
    script = (
        "import resource, signal, sys\n"
        "from rlhf_lit.outputs import OutputError, replace_file\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))\n"
        "try:\n"
        "    replace_file(sys.argv[1], 'x' * 1000)\n"
        "except OutputError as err:\n"
        "    print(err)\n"
        "    sys.exit(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert str(tmp_path) in done.stdout and "last complete output is untouched" in done.stdout
    assert path.read_text() == '{"gain": 1}'  # the earlier report, whole
    assert sorted(os.listdir(tmp_path)) == ["report.json"]  # no temporary file left
    replace_file(str(path), b"\x00\x01")  # bytes too, replacing the whole file
    assert path.read_bytes() == b"\x00\x01"


def test_a_reused_folder_is_refused_or_replaced_whole(tmp_path):
    folder = str(tmp_path / "hf")
    ExportFolder(folder).write(
        lambda s: (write_export(s, b"a"), open(os.path.join(s, "eval_results.json"), "w"))
    )
    with pytest.raises(OutputError, match="--overwrite"):
        ExportFolder(folder).check()
    ExportFolder(folder, overwrite=True).write(lambda s: write_export(s, b"bb"))
    assert sorted(os.listdir(folder)) == ["model.bin", "rlhf_lit.json"]  # the old eval_results.json is gone
    assert read_export(folder) == b"bb"


def test_a_committed_export_has_the_modes_the_umask_gives(tmp_path):
    # the staging folder comes from mkdtemp (0700) and a writer may make a private file (0600): teammates on
    # a shared machine must still be able to read the export (umask 022: folders 0755, files 0644)
    folder = str(tmp_path / "hf")

    def private_writer(staging):
        write_export(staging, b"w")
        os.makedirs(os.path.join(staging, "adapter"))
        os.close(os.open(os.path.join(staging, "adapter", "weights.bin"), os.O_CREAT | os.O_WRONLY, 0o600))

    old_mask = os.umask(0o022)
    try:
        ExportFolder(folder).write(private_writer)
    finally:
        os.umask(old_mask)
    assert oct(os.stat(folder).st_mode & 0o777) == oct(0o755)
    assert oct(os.stat(os.path.join(folder, "adapter")).st_mode & 0o777) == oct(0o755)
    assert oct(os.stat(os.path.join(folder, "adapter", "weights.bin")).st_mode & 0o777) == oct(0o644)
    assert oct(os.stat(os.path.join(folder, "model.bin")).st_mode & 0o777) == oct(0o644)


def test_staged_redirects_writes_only_while_open(tmp_path):
    folder = str(tmp_path / "hf")
    export = ExportFolder(folder)
    staging = export.begin()
    assert staged(folder) == staging
    assert staged(os.path.join(folder, "a", "b.png")) == os.path.join(staging, "a", "b.png")
    assert staged(str(tmp_path / "hf2")) == str(tmp_path / "hf2")
    export.commit()  # nothing was written: nothing changes
    assert staged(folder) == folder and not os.path.exists(folder)


def test_a_commit_killed_between_its_renames_is_recovered(tmp_path):
    folder = str(tmp_path / "hf")
    ExportFolder(folder).write(lambda s: write_export(s, b"old"))
    os.replace(folder, str(tmp_path / ".hf.old-12345"))  # the state a kill between the two renames leaves
    os.makedirs(tmp_path / ".hf.partial-12345-x")
    ExportFolder(folder).recover()
    assert read_export(folder) == b"old"
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_an_export_folder_that_is_a_symbolic_link_is_written_through_it(tmp_path):
    """export_dir -> a folder elsewhere (a bigger disk, say): the export lands in the target, staged beside
    it; the link stays a link, and nothing hidden is left on either side (before, the link was moved aside as
    ``.hf.old-<pid>``, which rmtree refuses, and a real folder took its place)."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "exports").mkdir()
    (tmp_path / "runs").mkdir()
    link = tmp_path / "runs" / "hf"
    link.symlink_to(tmp_path / "disk" / "exports")
    export = ExportFolder(str(link))
    staging = export.begin()
    assert os.path.dirname(staging) == str(tmp_path / "disk")  # beside the target: one file system
    write_export(staged(str(link)), b"new")  # a writer names the path under export_dir
    export.commit()
    assert link.is_symlink() and os.readlink(link) == str(tmp_path / "disk" / "exports")
    assert read_export(str(tmp_path / "disk" / "exports")) == b"new"
    assert os.listdir(tmp_path / "runs") == ["hf"] and os.listdir(tmp_path / "disk") == ["exports"]
    ExportFolder(str(link), overwrite=True).write(lambda s: write_export(s, b"newer"))  # an earlier one
    assert link.is_symlink() and read_export(str(link)) == b"newer"
    assert os.listdir(tmp_path / "runs") == ["hf"] and os.listdir(tmp_path / "disk") == ["exports"]


def test_recover_removes_a_link_moved_aside(tmp_path):
    """What a commit of the earlier code left when export_dir was a link: the link itself as ``.hf.old-<pid>``
    beside a real ``hf``; the next run removes it (rmtree refused it in silence)."""
    (tmp_path / "target").mkdir()
    ExportFolder(str(tmp_path / "hf")).write(lambda s: write_export(s, b"x"))
    (tmp_path / ".hf.old-12345").symlink_to(tmp_path / "target")
    ExportFolder(str(tmp_path / "hf")).recover()
    assert sorted(os.listdir(tmp_path)) == ["hf", "target"] and read_export(str(tmp_path / "hf")) == b"x"
    assert os.listdir(tmp_path / "target") == []  # the link is removed, not what it pointed to


def test_checkpoint_write_failure_keeps_the_last_checkpoint(tmp_path):
    path = str(tmp_path / "last.ckpt")
    AtomicCheckpointIO().save_checkpoint({"step": 1, "w": torch.ones(3)}, path)
    with pytest.raises(OutputError) as err:
        AtomicCheckpointIO(writer=failing_writer(10)).save_checkpoint(
            {"step": 2, "w": torch.zeros(300)}, path
        )
    assert str(tmp_path) in str(err.value) and "bytes" in str(err.value)
    assert torch.load(path)["step"] == 1  # still the complete first checkpoint
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no temporary file left


def test_checkpoint_write_replaces_atomically(tmp_path):
    path = str(tmp_path / "c.ckpt")
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, path)
    io.save_checkpoint({"step": 2}, path)
    assert torch.load(path)["step"] == 2 and os.listdir(tmp_path) == ["c.ckpt"]


def test_a_save_removes_temporary_files_of_dead_processes_only(tmp_path, caplog):
    # a run killed (kill -9) mid-write left last.ckpt.tmp-<its pid>; a live process's file may be being written
    stale = tmp_path / f"last.ckpt.tmp-{dead_pid()}"
    live = tmp_path / f"epoch=1.ckpt.tmp-{os.getpid()}"
    stale.write_bytes(b"half a checkpoint")
    live.write_bytes(b"being written")
    io = AtomicCheckpointIO()
    with caplog.at_level(logging.INFO, logger="rlhf_lit"):
        io.save_checkpoint({"step": 1}, str(tmp_path / "last.ckpt"))
        io.save_checkpoint({"step": 2}, str(tmp_path / "last.ckpt"))  # the folder is swept once
    assert sorted(os.listdir(tmp_path)) == sorted(["last.ckpt", live.name])
    assert torch.load(tmp_path / "last.ckpt")["step"] == 2
    lines = [r.getMessage() for r in caplog.records if "temporary" in r.getMessage()]
    assert lines == [f"checkpoint: removed 1 temporary file(s) of killed runs from {tmp_path}: {stale.name}"]


def test_free_space_is_checked_before_training(tmp_path):
    check_free_space(str(tmp_path / "hf"), 1)
    with pytest.raises(OutputError, match="not enough free space"):
        check_free_space(str(tmp_path / "hf"), 1 << 60)


def test_the_free_space_refusal_applies_and_names_its_margin(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    check_free_space(str(tmp_path / "hf"), int(free / 1.2))  # 1.1 * free/1.2 = 0.92 free: fits with the margin
    needed = int(free / 1.05)  # fits without a margin, not with 10%: 1.1 * free/1.05 = 1.048 free
    with pytest.raises(OutputError) as info:
        check_free_space(str(tmp_path / "hf"), needed)
    message = str(info.value)
    assert f"({needed} bytes) plus a 10% safety margin" in message, message
    assert f"({int(1.1 * needed)} bytes) in all;" in message, message


def test_disk_errors_are_recognised_by_errno_or_message():
    assert disk_errno(OSError(errno.ENOSPC, "x")) == errno.ENOSPC
    assert (
        disk_errno(RuntimeError("Error while serializing: IoError(No space left on device)")) == errno.ENOSPC
    )
    assert disk_errno(RuntimeError("shape mismatch")) is None


def test_run_outputs_locks_both_folders_and_releases_them(tmp_path):
    config = {
        "trainer": {"default_root_dir": str(tmp_path / "run")},
        "model": {"init_args": {"export_dir": str(tmp_path / "run" / "hf")}},
    }
    outputs = RunOutputs.from_config(config)
    outputs.open()
    with pytest.raises(OutputError, match="log/checkpoint folder"):
        RunOutputs.from_config(config).open()
    write_export(staged(str(tmp_path / "run" / "hf")), b"x")
    outputs.close(ok=True)
    assert read_export(str(tmp_path / "run" / "hf")) == b"x"
    assert not [e for e in os.listdir(tmp_path) if e.endswith(".lock")]
    assert not [e for e in os.listdir(tmp_path / "run") if e.startswith(".")]


def test_a_refused_export_names_the_earlier_runs_checkpoints_too(tmp_path):
    """Re-running an ended run: one refusal names both what blocks a fresh run there (the export and the
    checkpoints), so a user who picks another export_dir is not refused a second time by surprise."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "rlhf_lit.json").write_text("{}")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"x")
    config = {
        "trainer": {"default_root_dir": str(tmp_path / "run")},
        "model": {"init_args": {"export_dir": str(tmp_path / "hf")}},
    }
    with pytest.raises(OutputError) as err:
        RunOutputs.from_config(config).open()
    message = str(err.value)
    assert "already holds an earlier export" in message and str(tmp_path / "run" / "checkpoints") in message
    assert "\n" not in message
    # without an export in the way, the checkpoints alone are refused; a resumed run is not
    (tmp_path / "hf" / "rlhf_lit.json").unlink()
    with pytest.raises(OutputError, match="holds checkpoints of an earlier run \\(last.ckpt\\)"):
        RunOutputs.from_config(config).open()
    outputs = RunOutputs.from_config({**config, "ckpt_path": "last"})
    outputs.open()
    outputs.close(ok=False)
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").read_bytes() == b"x"
