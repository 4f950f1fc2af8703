"""``bench/phase_rss.py``'s glibc heap figures (``heap_mb``): what they say when the test allocates and frees
known sizes. glibc only (Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from bench.phase_rss import heap_mb

pytestmark = pytest.mark.skipif(heap_mb() is None, reason="glibc's mallinfo2 (Linux, glibc >= 2.33) only")


def test_a_block_above_glibcs_largest_threshold_is_mmapped_not_in_the_arena():
    before = heap_mb()
    block = torch.ones(16 * 2**20)  # 64 MiB: above 32 MiB, the largest mmap threshold glibc accepts
    during = heap_mb()
    assert during["mmapped"] - before["mmapped"] >= 64.0
    assert abs(during["in_use"] - before["in_use"]) < 8.0
    del block
    assert heap_mb()["mmapped"] - before["mmapped"] < 1.0  # its mapping went back


def test_small_blocks_count_in_use_and_then_free_inside_the_arena():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = heap_mb()
    blocks = [libc.malloc(4096) for _ in range(5120)]  # 20 MiB of 4 KiB blocks: under any default threshold
    during = heap_mb()
    assert during["in_use"] - before["in_use"] >= 20.0
    assert during["arena"] >= during["in_use"] + during["free"] - 1.0  # arena = in use + free (MiB rounding)
    for b in reversed(blocks[1:-1:2]):  # every other block: the holes cannot merge, the arena keeps them
        libc.free(b)
    holes = heap_mb()
    assert during["in_use"] - holes["in_use"] >= 9.9  # 2,559 x 4 KiB = 10.0 MiB freed
    assert holes["free"] - during["free"] >= 9.9  # ... and still inside the arena, as free bytes
    for b in blocks[0::2] + blocks[-1:]:
        libc.free(b)
