"""HeapTrim: the host heap's free pages go back to the system after a step, and nothing else changes."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from rlhf_lit.callbacks.memory import MMAP_THRESHOLD_MAX, HeapTrim, trim_heap

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc only"
)
def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


mallinfo2 = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _has_mallinfo2(), reason="glibc >= 2.33 (mallinfo2)"
)
dynamic_mmap_threshold = pytest.mark.skipif(
    "MALLOC_MMAP_THRESHOLD_" in os.environ, reason="glibc's threshold is fixed by the environment"
)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@glibc
def test_freed_heap_memory_leaves_the_resident_set_only_after_a_trim():
    trim_heap()
    before = _rss_mb()
    # 256 MiB in 64 KiB blocks: below glibc's mmap threshold, so they come from the heap and stay resident
    # when freed; one small block allocated last pins the top so free() alone cannot shrink the heap.
    blocks = [bytearray(64 * 1024) for _ in range(4096)]
    pin = bytearray(64 * 1024)
    assert _rss_mb() - before > 200
    del blocks
    gc.collect()
    held = _rss_mb()
    assert held - before > 200  # freed, but still resident
    assert trim_heap() is True
    assert _rss_mb() < held - 200  # the trim gave at least 200 of the 256 MiB back
    del pin


class _Module:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_the_callback_trims_every_n_batches_and_after_validation_on_a_cpu_only():
    cb = HeapTrim(every_n_steps=2)
    cpu = _Module("cpu")
    for batch_idx in range(5):  # batches 2 and 4
        cb.on_train_batch_end(None, cpu, None, None, batch_idx)
    assert cb.trims == 2
    cb.on_validation_end(None, cpu)
    assert cb.trims == 3
    cb.on_train_batch_end(None, _Module("meta"), None, None, 1)  # not the host's memory: nothing to trim
    assert cb.trims == 3


def test_every_n_steps_below_one_is_refused():
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        HeapTrim(every_n_steps=0)


class _Mallinfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h: struct mallinfo2
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _mmapped(libc, nbytes: int) -> bool:
    """Whether glibc serves a fresh ``malloc(nbytes)`` with its own mapping (``mallinfo2().hblks`` counts them)."""
    before = libc.mallinfo2().hblks
    block = libc.malloc(nbytes)
    mapped = libc.mallinfo2().hblks == before + 1
    libc.free(block)
    return mapped


def _in_a_forked_child(callback: HeapTrim, device: str) -> dict:
    """Run ``callback.setup`` on a trainer of ``device`` in a child process (the threshold outlives the call, so
    not in pytest's) and report whether glibc then maps a 16 MiB and a 512 KiB block on their own."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.mallinfo2.restype = _Mallinfo2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running pytest's exit handlers
        try:
            # a freed (32 MiB - 64 KiB) mapping raises glibc's dynamic threshold above 16 MiB
            libc.free(libc.malloc(32 * 2**20 - 2**16))
            # take every free chunk of 16 MiB or more out of the heap (earlier tests leave hundreds of MiB free),
            # then trim its top: a 16 MiB block must now come from a new mapping or from growing the heap
            held = []
            for _ in range(4096):
                before = libc.mallinfo2()
                held.append(libc.malloc(16 * 2**20))
                after = libc.mallinfo2()
                if (after.arena, after.hblks) != (before.arena, before.hblks):  # not from a free chunk
                    libc.free(held.pop())
                    break
            libc.malloc_trim(0)
            trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
            callback.setup(trainer, _Module("cpu"), "fit")
            seen = {"16mib": _mmapped(libc, 16 * 2**20), "512kib": _mmapped(libc, 512 * 1024)}
            seen["set"] = callback.mmap_threshold_set
            os.write(write, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        seen = json.loads(f.read())
    os.waitpid(pid, 0)
    return seen


@mallinfo2
@dynamic_mmap_threshold
def test_the_mmap_threshold_is_set_in_setup_on_a_cpu():
    # the fixed 1 MiB threshold maps 16 MiB (the dynamic one, at 32 MiB, grew the heap instead), not 512 KiB
    seen = _in_a_forked_child(HeapTrim(mmap_threshold=2**20), "cpu")
    assert seen == {"16mib": True, "512kib": False, "set": True}


@mallinfo2
@dynamic_mmap_threshold
def test_the_mmap_threshold_is_left_alone_by_default_and_off_the_cpu():
    for callback, device in ((HeapTrim(), "cpu"), (HeapTrim(mmap_threshold=2**20), "meta")):
        seen = _in_a_forked_child(callback, device)
        assert seen == {"16mib": False, "512kib": False, "set": False}


@pytest.mark.parametrize("value", [-1, MMAP_THRESHOLD_MAX + 1, 1.5, "1048576", True])
def test_an_mmap_threshold_outside_glibc_range_is_refused(value):
    with pytest.raises(
        ValueError, match=r"mmap_threshold must be a whole number of bytes in \[0, 33554432\]"
    ):
        HeapTrim(mmap_threshold=value)


def test_glibc_bounds_of_the_mmap_threshold_are_accepted():
    assert HeapTrim(mmap_threshold=0).mmap_threshold == 0
    assert HeapTrim(mmap_threshold=32 * 2**20).mmap_threshold == 33554432  # 4 * 1024 * 1024 * sizeof(long)


@pytest.mark.parametrize(
    "config",
    [
        "configs/dpo/smollm2_lora.yaml",
        "configs/ppo/smollm2_lora.yaml",
        "configs/reward/smollm2_lora.yaml",
        "configs/ppo/smollm2_grpo_constraints.yaml",
        "configs/reward/minilm_hh.yaml",
    ],
)
def test_the_measured_real_model_configs_trim_the_heap(config):
    """docs/scale.md measured these with HeapTrim and a 1 MiB mmap threshold (SmolLM2: peaks 1.6-2.4 GB instead
    of up to 5.8 GB; MiniLM: 1.19 instead of 1.38 GB); the configs must keep both."""
    import yaml

    from tests.tiny_runs import REPO_ROOT

    callbacks = yaml.safe_load((REPO_ROOT / config).read_text())["trainer"]["callbacks"]
    trims = [c for c in callbacks if c["class_path"] == "rlhf_lit.callbacks.HeapTrim"]
    assert len(trims) == 1
    assert trims[0].get("init_args", {}).get("mmap_threshold") == 1048576
